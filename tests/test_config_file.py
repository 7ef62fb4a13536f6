"""``--config FILE``: a subcommand's flags from YAML, the command line winning, every key
checked as the flag it names."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.config_file import expand_config_file


def parsed(tmp_path, text: str, *argv: str, command: str = "serve"):
    path = tmp_path / "flags.yaml"
    path.write_text(text)
    parser = build_parser()
    return parser.parse_args(expand_config_file(parser.commands,
                                                [command, *argv, "--config", str(path)]))


def refusal(tmp_path, capsys, text: str, *argv: str, command: str = "serve") -> str:
    with pytest.raises(SystemExit) as exit_info:
        parsed(tmp_path, text, *argv, command=command)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_every_kind_of_flag_from_the_file(tmp_path):
    args = parsed(tmp_path, "model: tiny\nport: 8123\nmax_model_len: 512\n"
                  "served-model-name: [a, b]\nenforce-eager: true\ndecode-gemv: off\n"
                  "itl-slo-ms: 45.5\n")
    assert (args.model_flag, args.port, args.max_model_len) == ("tiny", 8123, 512)
    assert args.served_model_name == ["a", "b"]
    assert args.enforce_eager is True
    assert args.decode_gemv == "off"  # YAML's boolean off, back to the flag's choice
    assert args.itl_slo_ms == 45.5
    assert args.config_file.endswith("flags.yaml")


def test_the_command_line_wins_over_the_file(tmp_path):
    args = parsed(tmp_path, "model: tiny\nport: 8123\nserved-model-name: [a, b]\n",
                  "other-model", "--port", "9000")
    assert (args.model, args.model_flag, args.port) == ("other-model", None, 9000)
    assert args.served_model_name == ["a", "b"]  # the list ended before MODEL


def test_a_false_switch_leaves_it_off_and_a_negatable_one_says_no(tmp_path):
    args = parsed(tmp_path, "enforce-eager: false\noverlap-schedule: false\n")
    assert args.enforce_eager is False
    assert args.overlap_schedule is False


@pytest.mark.parametrize(("text", "needle"), [
    ("pipeline-parallel-size: 2\n", "'pipeline-parallel-size' is not a flag of pdserve serve"),
    ("port: [1, 2]\n", "'port' takes one value, not a list"),
    ("enforce-eager: yes please\n", "'enforce-eager' is a switch: true or false"),
    ("port:\n", "'port' has no value"),
    ("max-model-len: 1\nmax_model_len: 2\n", "name the same flag --max-model-len"),
    ("- port\n", "must be a mapping of flag names to values, not a list"),
    ("port: [\n", "not valid YAML"),
    ("config: other.yaml\n", "cannot name another one"),
    ("port: eighty\n", "invalid int value: 'eighty'"),
])
def test_a_bad_entry_is_a_usage_error_naming_it(tmp_path, capsys, text, needle):
    assert needle in refusal(tmp_path, capsys, text)


def test_a_missing_file_and_two_files_are_refused(tmp_path, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(expand_config_file(
            parser.commands, ["serve", "--config", str(tmp_path / "absent.yaml")]))
    assert "absent.yaml: No such file or directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        expand_config_file(parser.commands, ["serve", "--config", "a", "--config=b"])
    assert "--config is given 2 times" in capsys.readouterr().err


def test_other_subcommands_read_their_own_flags(tmp_path, capsys):
    args = parsed(tmp_path, "prompt: hello\nmax-tokens: 3\n", "tiny", command="generate")
    assert (args.model, args.prompt, args.max_tokens) == ("tiny", ["hello"], 3)
    args = parsed(tmp_path, "prompt: [one, two]\n", "tiny", command="generate")
    assert args.prompt == ["one", "two"]  # a repeatable flag, repeated
    assert "'port' is not a flag of pdserve generate" in refusal(
        tmp_path, capsys, "port: 1\n", command="generate")


def test_bench_compare_keeps_its_own_config_flag():
    parser = build_parser()
    argv = ["bench", "compare", "--config", "a=--schedule chunked"]
    assert expand_config_file(parser.commands, argv) == argv


def test_tokens_after_a_double_dash_are_left_as_they_are(tmp_path):
    path = tmp_path / "flags.yaml"
    path.write_text("port: 8123\n")
    parser = build_parser()
    argv = ["serve", "--config", str(path), "--", "--config", "x"]
    assert expand_config_file(parser.commands, argv) == [
        "serve", "--port", "8123", "--config", str(path), "--", "--config", "x"]
