"""``pdserve`` command line: ``serve`` (OpenAI-compatible server), ``generate`` (one-shot,
offline) and ``bench`` (when the benchmark package is installed).

Every engine and server flag, and its help text, comes from the config dataclasses' field
docs, so ``--help`` and the code cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys

from pdserve.config import (
    ENGINE_CONFIG_PARTS,
    EngineConfig,
    ModelConfig,
    add_cli_args,
    engine_config_from_args,
)
from pdserve.config_file import CONFIG_FLAG, expand_config_file
from pdserve.progress import QUIET_ENV, progress_enabled

# `pdserve generate`'s sampling when neither a flag nor the generation config sets a field.
_GENERATE_DEFAULTS = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": -1}

_DESCRIPTION = """LLM serving that holds latency SLOs.

  pdserve serve MODEL [flags]     OpenAI-compatible server (see pdserve serve --help);
                                  with --role prefill|decode, a member of a P/D group
  pdserve gateway [flags]         one OpenAI front for P/D groups (P/D-Serve)
  pdserve cluster MODEL --prefill N --decode M
                                  a P/D group and its gateway on this machine
  pdserve generate MODEL --prompt TEXT
  pdserve run-batch MODEL -i IN.jsonl -o OUT.jsonl
                                  OpenAI batch requests answered offline
  pdserve bench ...               load generator and SLO report
  pdserve profile MODEL           fit the multiplex latency predictor on this GPU
  pdserve chat | complete         talk to a running server from the terminal"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_gateway(sub)
    _add_cluster(sub)
    _add_generate(sub)
    _add_run_batch(sub)
    _add_bench(sub)
    _add_profile(sub)
    terminal_clients = _add_terminal_clients(sub)
    for name, command in sub.choices.items():
        _add_common_flags(command, quiet_short=name not in terminal_clients)
        if name != "bench":  # bench's subcommands have flags of their own (compare's --config)
            _add_config_file_flag(command)
        command.set_defaults(parser=command)
    parser.commands = sub.choices  # for expand_config_file
    return parser


def _add_config_file_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(CONFIG_FLAG, dest="config_file", metavar="FILE",
                        help="Read flags from a YAML file: long flag names (dashes or "
                        "underscores) to values, e.g. 'max-model-len: 4096', "
                        "'served-model-name: [a, b]', 'enforce-eager: true'; flags on the "
                        "command line win over the file.")


def _add_common_flags(parser: argparse.ArgumentParser, quiet_short: bool = True) -> None:
    """``quiet_short``: ``-q`` for ``--quiet``; the terminal clients keep ``-q`` for
    ``--quick``, as vLLM's do."""
    group = parser.add_argument_group("output")
    group.add_argument("--debug", action="store_true",
                       help="Show the full traceback of an error instead of one line.")
    group.add_argument(*(("-q", "--quiet") if quiet_short else ("--quiet",)),
                       action="store_true",
                       help="No progress bars (they are also off when stderr is not a terminal).")


def _add_terminal_clients(sub) -> tuple[str, ...]:
    from pdserve.client_cli import add_parsers

    return add_parsers(sub)


_GROUP_TITLES = {"ModelConfig": "model", "CacheConfig": "KV cache",
                 "SchedulerConfig": "scheduler", "DeviceConfig": "device",
                 "TransferConfig": "KV transfer (P/D across instances)"}


def _add_model_arg(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """MODEL as a positional argument or as ``--model`` (vLLM accepts both)."""
    model_field = {f.name: f for f in dataclasses.fields(ModelConfig)}["model"]
    default = default or model_field.default
    parser.add_argument("model", nargs="?", default=None,
                        help=f"{model_field.metadata['help']} (default: {default})")
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                        help="Same as the positional MODEL.")
    parser.set_defaults(model_default=default)


def _pick_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    given = [m for m in (args.model, args.model_flag) if m is not None]
    if len(set(given)) > 1:
        parser.error(f"the model is given twice and the two disagree: {args.model!r} and "
                     f"--model {args.model_flag!r}")
    args.model = given[0] if given else args.model_default


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    _add_model_arg(parser)
    for part in ENGINE_CONFIG_PARTS:
        group = parser.add_argument_group(_GROUP_TITLES.get(part.__name__, part.__name__))
        add_cli_args(group, part, skip=("model",))


def _add_serve(sub) -> None:
    from pdserve.server.config import ServerConfig

    parser = sub.add_parser("serve", help="Run the OpenAI-compatible HTTP server.",
                            description="Run the OpenAI-compatible HTTP server: /v1/completions, "
                            "/v1/chat/completions, /v1/models, /health, /metrics.")
    from pdserve.cluster.config import InstanceConfig

    _add_engine_args(parser)
    _add_front_args(parser, ServerConfig, "server")
    add_cli_args(parser.add_argument_group("P/D group"), InstanceConfig)
    parser.set_defaults(func=_run_serve, check=_check_serve)


def _add_front_args(parser: argparse.ArgumentParser, config_cls: type, title: str) -> None:
    """The flags of a server or gateway config, its HTTPS and CORS ones in groups of their
    own (the config inherits them: they would come first)."""
    from pdserve.server.cors import CrossOriginConfig
    from pdserve.server.tls import TLSConfig

    shared = tuple(f.name for part in (TLSConfig, CrossOriginConfig)
                   for f in dataclasses.fields(part))
    add_cli_args(parser.add_argument_group(title), config_cls, skip=shared)
    add_cli_args(parser.add_argument_group("HTTPS"), TLSConfig)
    add_cli_args(parser.add_argument_group("cross-origin requests (CORS)"), CrossOriginConfig)


def _add_gateway(sub) -> None:
    from pdserve.cluster.config import GatewayConfig

    parser = sub.add_parser("gateway", help="Run the gateway in front of P/D groups.",
                            description="OpenAI-compatible front for P/D groups: offers each "
                            "prefill to the group's prefill instances (they refuse what they "
                            "cannot start in time), then relays the decode instance's answer.")
    _add_front_args(parser, GatewayConfig, "gateway")
    parser.set_defaults(func=_run_gateway, check=_check_gateway)


def _add_generate(sub) -> None:
    parser = sub.add_parser("generate", help="Generate once, offline (no server).",
                            description="Load the model in this process and print completions.")
    parser.add_argument("--prompt", action="append", required=True,
                        help="Prompt text; repeat the flag for several prompts.")
    sampling = parser.add_argument_group("sampling")
    # Unset sampling flags fall back to the generation config, then to these defaults.
    sampling.add_argument("--max-tokens", type=int, default=None,
                          help="Most tokens to generate (default: 64).")
    sampling.add_argument("--temperature", type=float, default=None,
                          help="0 means greedy (default: 0).")
    sampling.add_argument("--top-p", type=float, default=None,
                          help="Nucleus sampling mass (default: 1).")
    sampling.add_argument("--top-k", type=int, default=None,
                          help="Keep the k likeliest tokens (default: -1, all).")
    sampling.add_argument("--stop", action="append", default=[], help="Stop string (repeatable).")
    sampling.add_argument("--ignore-eos", action="store_true", help="Keep going past EOS.")
    _add_engine_args(parser)
    parser.set_defaults(func=_run_generate, check=_check_engine_args)


# Server flags that mean nothing to a batch: its server listens on a loopback port of its
# own, open to the batch alone, and keeps no responses (lines run at once, in no order).
_BATCH_SKIPPED_SERVER_FLAGS = ("host", "port", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs",
                               "ssl_cert_reqs", "api_key", "api_key_file", "cluster_secret",
                               "max_stored_responses", "shutdown_timeout", "retry_after",
                               "body_timeout_s", "api_server_count", "allowed_origins",
                               "allow_credentials", "allowed_methods", "allowed_headers")


def _add_run_batch(sub) -> None:
    from pdserve.server.config import ServerConfig

    parser = sub.add_parser(
        "run-batch", help="Answer a file of OpenAI batch requests offline.",
        description="Read OpenAI batch requests (JSONL: custom_id, method, url, body; url "
        "/v1/chat/completions, /v1/completions or /v1/responses), answer each as "
        "`pdserve serve` would, and write one output line per input line in the same "
        "order (OpenAI's batch output format).")
    parser.add_argument("-i", "--input-file", required=True,
                        help="The requests: a local file, - for stdin, or an http(s) URL "
                        "(read with GET).")
    parser.add_argument("-o", "--output-file", required=True,
                        help="The answers: a local file (written whole at the end), - for "
                        "stdout, or an http(s) URL (sent with PUT at the end).")
    parser.add_argument("--server-url", default=None, metavar="URL",
                        help="Send the lines to this running server or P/D gateway (e.g. "
                        "http://gateway:8000) instead of loading MODEL here; its API key "
                        "from $PDSERVE_API_KEY. Engine and server flags are then refused.")
    _add_engine_args(parser)
    add_cli_args(parser.add_argument_group("server"), ServerConfig,
                 skip=_BATCH_SKIPPED_SERVER_FLAGS)
    parser.set_defaults(func=_run_batch, check=_check_run_batch)


def _run_batch(args: argparse.Namespace) -> int:
    from pdserve.server import run_batch

    if args.server_url is not None:
        return run_batch.main_remote(args.server_url, os.environ.get("PDSERVE_API_KEY"),
                                     args.input_file, args.output_file)
    return run_batch.main(args.engine_config, args.server_config, args.input_file,
                          args.output_file)


def _add_bench(sub) -> None:
    try:
        from pdserve.bench.cli import add_parser
    except ImportError:  # the benchmark package is optional for serving
        return
    add_parser(sub)


def _add_profile(sub) -> None:
    from pdserve.engine.profile_args import add_parser

    add_parser(sub).set_defaults(check=_check_profile)


def _run_serve(args: argparse.Namespace) -> int:
    from pdserve.server.app import serve

    lifecycle = None
    if args.instance.role is not None:
        from pdserve.cluster.instance import GroupMembership
        from pdserve.server.pd import resolve_secret

        if resolve_secret(args.server_config.cluster_secret) is None:
            logging.getLogger("pdserve.instance").warning(
                "no --cluster-secret: anyone who reaches this instance can call its /pd/ "
                "routes; set one (or $PDSERVE_CLUSTER_SECRET) on every member and the gateway")
        model = args.server_config.served_model_name[0]
        lifecycle = GroupMembership(args.instance, args.server_config.port, model)
    serve(args.engine_config, args.server_config, lifecycle=lifecycle)
    return 0


def _add_cluster(sub) -> None:
    from pdserve.cluster.config import GatewayConfig
    from pdserve.cluster.launch import add_launch_args

    parser = sub.add_parser("cluster", help="Run a P/D group and its gateway (on this machine, "
                            "or on a Ray cluster with --ray-address).",
                            description="Starts --prefill and --decode instances of MODEL "
                            "(`pdserve serve` processes, one GPU each when there are several) "
                            "and serves them through a gateway.")
    add_launch_args(parser)
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                        help="Same as the positional MODEL.")
    parser.set_defaults(model=None, model_default="tiny")
    _add_front_args(parser, GatewayConfig, "gateway")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="Names every instance answers to (default: the model argument).")
    parser.set_defaults(func=_run_cluster, check=_check_cluster)


def _run_cluster(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from pdserve.cluster.launch import default_gpus, run_cluster

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.gpus is None:
        args.gpus = default_gpus()
    asyncio.run(run_cluster(args, args.gateway_config))
    return 0


def _run_gateway(args: argparse.Namespace) -> int:
    from pdserve.cluster.app import run_gateway

    run_gateway(args.gateway_config)
    return 0


def _config_from_args(config_cls: type, args: argparse.Namespace):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)}
    return config_cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _run_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    params = SamplingParams(**_generate_sampling(args), stop=args.stop,
                            ignore_eos=args.ignore_eos)
    llm = LLM(**args.engine_config.flat())
    for output in llm.generate(args.prompt, params):
        completion = output.outputs[0]
        print(f"--- {output.prompt!r} ({completion.finish_reason})")
        print(completion.text)
    return 0


def _generate_sampling(args: argparse.Namespace) -> dict:
    """Flags the user set, else the generation config's defaults, else ``generate``'s own."""
    from pdserve.model.generation_config import sampling_defaults

    model = args.engine_config.model
    values = {**_GENERATE_DEFAULTS, **sampling_defaults(model.generation_config, model.model)}
    for name in _GENERATE_DEFAULTS:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return values


# ---- checks: every flag is validated before the model loads --------------------------------


class UsageError(Exception):
    """A mistake in the command line or its surroundings: one line, no traceback."""


def _check_engine_args(args: argparse.Namespace) -> None:
    """Builds ``args.engine_config``: the model resolved to a local folder (hub ids are
    downloaded), its shapes read, device, dtype and the tensor-parallel split checked."""
    from pdserve.model.arch import get_arch
    from pdserve.model.generation_config import read_generation_config
    from pdserve.model.hub import resolve_model_config

    _pick_model(args.parser, args)
    config = engine_config_from_args(args)
    model = resolve_model_config(config.model)
    arch = get_arch(model)
    read_generation_config(model.generation_config, model.model)
    _check_device(config.device.device, model.dtype)
    _check_graph_steps(config)
    args.engine_config = dataclasses.replace(config, model=model)
    from pdserve.engine.tp import check_tp_config  # imports torch: after the flag checks

    check_tp_config(args.engine_config, arch)


def _check_device(device: str, dtype: str) -> None:
    import torch

    from pdserve.model.loader import resolve_dtype

    if device != "auto" and not device.startswith(("cpu", "cuda")):
        raise UsageError(f"--device {device}: use auto, cuda, cuda:N or cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA GPU is visible to this process")
    resolve_dtype(dtype, "cpu")


def _check_graph_steps(config) -> None:
    """--mux-graph-step-tokens where no prefill-step graphs are captured stops before the
    model loads: its "graph" steps would run eagerly and learn an eager cost unasked."""
    if not config.scheduler.mux_graph_step_tokens:  # off, or the engine's default
        return
    where = "on the CPU" if _runs_on_cpu(config) else (
        "under tensor parallelism" if config.device.tensor_parallel_size > 1 else None)
    if where is not None:
        raise UsageError(f"--mux-graph-step-tokens {config.scheduler.mux_graph_step_tokens}: "
                         f"no prefill-step graphs are captured {where}; leave it at 0")


def _runs_on_cpu(config) -> bool:
    """Whether the engine will run on the CPU (``--device cpu``, or auto without a GPU)."""
    import torch

    return config.device.device == "cpu" or not torch.cuda.is_available()


def _check_serve(args: argparse.Namespace) -> None:
    from pdserve.cluster.config import InstanceConfig
    from pdserve.model.tokenizer import load_chat_template
    from pdserve.server.config import ServerConfig

    _check_engine_args(args)
    server = _config_from_args(ServerConfig, args)
    if not server.served_model_name:  # the model as typed, not the folder a hub id became
        server = dataclasses.replace(server, served_model_name=(args.model,))
    if server.chat_template is not None:
        load_chat_template(server.chat_template)
    _check_front(server)
    args.instance = _config_from_args(InstanceConfig, args)
    if args.instance.role is not None and server.ssl_certfile is not None:
        raise UsageError("--role with --ssl-certfile: the gateway and the other members reach "
                         "an instance over plain HTTP (give the gateway the TLS flags)")
    if args.instance.role is not None and server.api_server_count > 1:
        raise UsageError("--role takes --api-server-count 1: each HTTP process would keep "
                         "its own /pd/prefill admission, and the gateway sees one instance")
    if args.engine_config.transfer.kv_transfer_port is not None:
        from pdserve.sched.policies import role_refusal

        why = role_refusal(args.engine_config.scheduler.schedule)
        if why is not None:
            raise UsageError(why)
    _check_kv_transport(args.engine_config)
    if args.instance.role is not None:
        if args.engine_config.transfer.kv_transfer_port is None:
            raise UsageError("--role needs --kv-transfer-port (0 picks a free port)")
        _check_registry(args.instance.registry)
    _check_port_free(server.host, server.port, "--port")
    args.server_config = server


def _check_front(config) -> None:
    """What a server or gateway needs before anything starts: its TLS files and aiohttp-cors."""
    from pdserve.server.cors import cors_library

    _check_tls(config)
    try:
        cors_library()
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None


def _check_tls(config) -> None:
    """The TLS files read before anything starts: a missing or bad one is one line."""
    import ssl

    try:
        config.ssl_context()
    except (OSError, ssl.SSLError) as exc:
        files = [f"--ssl-certfile {config.ssl_certfile}", f"--ssl-keyfile {config.ssl_keyfile}"]
        if config.ssl_ca_certs:
            files.append(f"--ssl-ca-certs {config.ssl_ca_certs}")
        raise UsageError(f"{' / '.join(files)}: cannot be loaded "
                         f"({getattr(exc, 'strerror', None) or exc})") from None


def _check_run_batch(args: argparse.Namespace) -> None:
    from pdserve.model.tokenizer import load_chat_template
    from pdserve.server.config import ServerConfig

    def local(path: str) -> bool:
        return path != "-" and not path.startswith(("http://", "https://"))

    if local(args.input_file) and not os.path.isfile(args.input_file):
        raise UsageError(f"--input-file {args.input_file}: no such file")
    folder = os.path.dirname(os.path.abspath(args.output_file))
    if local(args.output_file) and not os.access(folder, os.W_OK):
        raise UsageError(f"--output-file {args.output_file}: cannot write in {folder}")
    if args.server_url is not None:
        _check_remote_batch(args)
        return
    _check_engine_args(args)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)
             if f.name not in _BATCH_SKIPPED_SERVER_FLAGS}
    server = ServerConfig(**{k: tuple(v) if isinstance(v, list) else v
                             for k, v in given.items()}, max_stored_responses=0)
    if not server.served_model_name:
        server = dataclasses.replace(server, served_model_name=(args.model,))
    if server.chat_template is not None:
        load_chat_template(server.chat_template)
    _check_front(server)
    args.server_config = server


def _check_remote_batch(args: argparse.Namespace) -> None:
    """A batch sent to a running server takes no model and no engine or server flag: the
    server it names answers as it was started."""
    if not args.server_url.startswith(("http://", "https://")):
        raise UsageError(f"--server-url {args.server_url}: give an http:// or https:// URL")
    own = ("command", "input_file", "output_file", "server_url", "quiet", "debug")
    changed = sorted(name for name, value in vars(args).items()
                     if name not in own and value != args.parser.get_default(name))
    if changed:
        flag = "MODEL" if changed[0] in ("model", "model_flag") else "--" + changed[0].replace(
            "_", "-")
        raise UsageError(f"{flag} with --server-url: the server at {args.server_url} "
                         "answers as it was started; leave it out")


def _check_kv_transport(config) -> None:
    """An explicit --kv-transport that cannot work here stops before the model loads."""
    transfer = config.transfer
    if transfer.kv_transport != "auto" and transfer.kv_transfer_port is None:
        raise UsageError(f"--kv-transport {transfer.kv_transport} needs --kv-transfer-port "
                         "(0 picks a free port)")
    if transfer.kv_transport == "ipc" and _runs_on_cpu(config):
        raise UsageError("--kv-transport ipc needs KV on a CUDA device; this instance runs on "
                         "cpu (use tcp, or p2p for gloo between CPU instances)")


def _check_gateway(args: argparse.Namespace) -> None:
    from pdserve.cluster.config import GatewayConfig

    args.gateway_config = _config_from_args(GatewayConfig, args)
    _check_front(args.gateway_config)
    _check_registry(args.gateway_config.registry)
    _check_port_free(args.gateway_config.host, args.gateway_config.port, "--port")


def _check_cluster(args: argparse.Namespace) -> None:
    """The model is resolved (and downloaded) once here; the instances then find it in the
    cache. Served names travel to every instance."""
    from pdserve.cluster.launch import default_gpus, gpu_groups, gpu_list
    from pdserve.cluster.ray_launch import ray_args_refusal
    from pdserve.dist.shard import tp_refusal
    from pdserve.model.arch import get_arch
    from pdserve.model.hub import resolve_model_config

    if (why := ray_args_refusal(args)) is not None:
        raise UsageError(why)
    _pick_model(args.parser, args)
    arch = get_arch(resolve_model_config(ModelConfig(model=args.model)))
    if (why := tp_refusal(arch, args.tensor_parallel_size)) is not None:
        raise UsageError(why)  # the GPUs are the instances' to count, on their machines
    if not args.ray_address:  # the GPUs this machine hands out, given or found
        gpus = args.gpus if args.gpus is not None else default_gpus()
        gpu_groups(gpu_list(gpus), 1, args.tensor_parallel_size)
    if args.served_model_name:
        args.serve_args += ["--served-model-name", *args.served_model_name]
    _check_gateway(args)


def _check_profile(args: argparse.Namespace) -> None:
    from pdserve.model.arch import get_arch
    from pdserve.model.hub import resolve_model_config

    model = resolve_model_config(ModelConfig(model=args.model, load_format=args.load_format))
    arch = get_arch(model)
    _check_device(args.device, args.dtype)
    from pdserve.engine.tp import check_tp_config  # imports torch: after the cheaper checks

    check_tp_config(EngineConfig.from_flat(model=model.model, device=args.device,
                                           tensor_parallel_size=args.tensor_parallel_size),
                    arch)
    args.model = model.model


def _check_registry(url: str) -> None:
    if not url.startswith("zk://"):
        return
    try:
        import kazoo  # noqa: F401 - only its presence is checked here
    except ImportError:
        raise UsageError(f"registry {url} needs the kazoo package: "
                         "pip install 'pdserve[cluster]'") from None


def _check_port_free(host: str, port: int, flag: str) -> None:
    # SO_REUSEADDR as aiohttp sets it: a port in TIME_WAIT is free, a listening one is not.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise UsageError(f"{flag} {port}: cannot listen on {host}:{port} "
                             f"({exc.strerror or exc})") from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    message = text[0] if text else type(exc).__name__
    if isinstance(exc, UsageError | ValueError | OSError | NotImplementedError):
        return message
    return f"{type(exc).__name__}: {message} (--debug shows the traceback)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(expand_config_file(parser.commands, argv))
    if args.quiet:
        os.environ[QUIET_ENV] = "1"  # inherited by the engine process and launched instances
    if not progress_enabled():  # huggingface_hub's download bars follow the same rule
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if hasattr(args, "check"):
        code = _guarded(args, args.check)
        if code:
            return 2  # found before anything started: a mistake in the command line
    return _guarded(args, args.func)


def _guarded(args: argparse.Namespace, step) -> int:
    try:
        return step(args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the one place errors become a line for a person
        if args.debug:
            raise
        print(f"pdserve: error: {_one_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
