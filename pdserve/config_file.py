"""``--config FILE``: a subcommand's flags read from a YAML file, as ``vllm serve --config``.

The file is a mapping of long flag names (``max-model-len`` or ``max_model_len``) to values:

    model: codellama-34b
    load-format: dummy
    schedule: multiplex
    itl-slo-ms: 60
    served-model-name: [code, codellama]
    enforce-eager: true        # a switch: true sets it, false leaves it off

Each entry becomes the flag it names, placed before the command line's own flags, so a
flag given on the command line wins over the file (and argparse checks both alike: a
value out of its choices, a wrong type). A key that names no flag of the subcommand, a
value of the wrong shape or a file that is not a mapping is a usage error naming the key,
never ignored. ``model`` is the model (the positional MODEL or ``--model``) unless the
command line names one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CONFIG_FLAG = "--config"


def expand_config_file(commands: dict[str, argparse.ArgumentParser],
                       argv: list[str]) -> list[str]:
    """``argv`` with the flags of its ``--config`` file put right after the subcommand's
    name (``argv`` as it is where there is no subcommand or no ``--config``)."""
    where = next((i for i, token in enumerate(argv) if not token.startswith("-")), None)
    if where is None or argv[where] not in commands:
        return argv
    parser, given = commands[argv[where]], argv[where + 1:]
    flag = long_options(parser).get(CONFIG_FLAG)
    if flag is None or flag.dest != "config_file":  # a command without the file flag
        return argv
    path, rest = split_config_flag(parser, given)
    if path is None:
        return argv
    entries = read_entries(parser, path)
    # The file's own flag right after its entries: an option there ends a list-valued entry
    # (``served-model-name: [a, b]``), which would otherwise take the command line's
    # positional MODEL as one more value.
    return (argv[:where + 1] + config_tokens(parser, entries, path, rest)
            + [CONFIG_FLAG, path] + rest)


def split_config_flag(parser: argparse.ArgumentParser,
                      argv: list[str]) -> tuple[str | None, list[str]]:
    """The one ``--config FILE`` (or ``--config=FILE``) of ``argv`` (None if there is none)
    and ``argv`` without it; tokens after ``--`` are left as they are."""
    paths, rest, tokens = [], [], iter(enumerate(argv))
    for i, token in tokens:
        if token == "--":
            rest += argv[i:]
            break
        if token == CONFIG_FLAG:
            if i + 1 == len(argv):
                parser.error(f"{CONFIG_FLAG} needs a file")
            paths.append(next(tokens)[1])
        elif token.startswith(CONFIG_FLAG + "="):
            paths.append(token.split("=", 1)[1])
        else:
            rest.append(token)
    if len(paths) > 1:
        parser.error(f"{CONFIG_FLAG} is given {len(paths)} times: give one file")
    return (paths[0] if paths else None), rest


def read_entries(parser: argparse.ArgumentParser, path: str) -> dict:
    import yaml  # only when a file is named

    try:
        text = Path(path).read_text()
    except OSError as exc:
        parser.error(f"{CONFIG_FLAG} {path}: {exc.strerror or exc}")
    try:
        entries = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        parser.error(f"{CONFIG_FLAG} {path}: not valid YAML ({str(exc).splitlines()[0]})")
    if entries is None:
        return {}
    if not isinstance(entries, dict):
        parser.error(f"{CONFIG_FLAG} {path}: the file must be a mapping of flag names to "
                     f"values, not a {type(entries).__name__}")
    return entries


def config_tokens(parser: argparse.ArgumentParser, entries: dict, path: str,
                  given: list[str]) -> list[str]:
    """The command-line tokens of the file's entries, in the file's order."""
    options = long_options(parser)
    flags: dict[str, str] = {}  # flag -> the key that named it, to refuse a flag named twice
    tokens: list[str] = []
    for key, value in entries.items():
        flag = "--" + str(key).replace("_", "-")
        if flag in flags:
            parser.error(f"{CONFIG_FLAG} {path}: {key!r} and {flags[flag]!r} name the same "
                         f"flag {flag}")
        flags[flag] = str(key)
        if flag == CONFIG_FLAG:
            parser.error(f"{CONFIG_FLAG} {path}: a config file cannot name another one")
        if flag not in options:
            parser.error(f"{CONFIG_FLAG} {path}: {key!r} is not a flag of pdserve "
                         f"{parser.prog.split()[-1]} (see --help)")
        if flag == "--model" and names_a_model(parser, given):
            continue  # the command line's model wins, as every other flag does
        tokens += flag_tokens(options[flag], flag, value, f"{CONFIG_FLAG} {path}: {key!r}",
                              parser)
    return tokens


def long_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each ``--flag`` of the parser and its action (argparse keeps them only in its
    private tables; ``_actions`` is the list every argparse version has)."""
    return {option: action for action in parser._actions
            for option in action.option_strings if option.startswith("--")}


def names_a_model(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    """Whether the command line gives the model itself (positional MODEL or ``--model``)."""
    known, _ = parser.parse_known_args(argv)
    return any(getattr(known, dest, None) is not None for dest in ("model", "model_flag"))


def flag_tokens(action: argparse.Action, flag: str, value, where: str,
                parser: argparse.ArgumentParser) -> list[str]:
    """``value`` as the tokens of ``flag`` on a command line."""
    if value is None:
        parser.error(f"{where} has no value: give one or leave the key out")
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            parser.error(f"{where} is a switch: true or false, not {value!r}")
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:  # store_true / store_false: the flag itself is the value
        if not isinstance(value, bool):
            parser.error(f"{where} is a switch: true or false, not {value!r}")
        sets = not isinstance(action, argparse._StoreFalseAction)
        return [flag] if value == sets else []
    many = action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1)
    if isinstance(value, list) and isinstance(action, argparse._AppendAction) and not many:
        return [token for item in value for token in (flag, as_text(item, action))]
    if isinstance(value, list):
        if not many:
            parser.error(f"{where} takes one value, not a list")
        return [flag, *(as_text(item, action) for item in value)]
    return [flag, as_text(value, action)]


def as_text(value, action: argparse.Action) -> str:
    """One value as its command-line text. YAML reads ``on`` and ``off`` as booleans; a flag
    whose choices are ``on`` and ``off`` gets them back."""
    if isinstance(value, bool):
        if action.choices is not None and {"on", "off"} <= set(action.choices):
            return "on" if value else "off"
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value)  # a flag that takes JSON
    return str(value)
