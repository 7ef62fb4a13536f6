"""``pdserve`` command line: ``serve`` (OpenAI-compatible server), ``generate`` (one-shot,
offline) and ``bench`` (when the benchmark package is installed).

Every engine and server flag, and its help text, comes from the config dataclasses' field
docs, so ``--help`` and the code cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from pdserve.config import ENGINE_CONFIG_PARTS, ModelConfig, add_cli_args, engine_config_from_args

_DESCRIPTION = """LLM serving that holds latency SLOs.

  pdserve serve MODEL [flags]     OpenAI-compatible server (see pdserve serve --help);
                                  with --role prefill|decode, a member of a P/D group
  pdserve gateway [flags]         one OpenAI front for P/D groups (P/D-Serve)
  pdserve cluster MODEL --prefill N --decode M
                                  a P/D group and its gateway on this machine
  pdserve generate MODEL --prompt TEXT
  pdserve bench ...               load generator and SLO report
  pdserve profile MODEL           fit the multiplex latency predictor on this GPU"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_gateway(sub)
    _add_cluster(sub)
    _add_generate(sub)
    _add_bench(sub)
    _add_profile(sub)
    return parser


_GROUP_TITLES = {"ModelConfig": "model", "CacheConfig": "KV cache",
                 "SchedulerConfig": "scheduler", "DeviceConfig": "device",
                 "TransferConfig": "KV transfer (P/D across instances)"}


def _add_model_arg(parser: argparse.ArgumentParser) -> None:
    model_field = {f.name: f for f in dataclasses.fields(ModelConfig)}["model"]
    parser.add_argument("model", nargs="?", default=model_field.default,
                        help=f"{model_field.metadata['help']} (default: {model_field.default})")


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
    add_cli_args(parser.add_argument_group("server"), ServerConfig)
    add_cli_args(parser.add_argument_group("P/D group"), InstanceConfig)
    parser.set_defaults(func=_run_serve)


def _add_gateway(sub) -> None:
    from pdserve.cluster.config import GatewayConfig

    parser = sub.add_parser("gateway", help="Run the gateway in front of P/D groups.",
                            description="OpenAI-compatible front for P/D groups: offers each "
                            "prefill to the group's prefill instances (they refuse what they "
                            "cannot start in time), then relays the decode instance's answer.")
    add_cli_args(parser, GatewayConfig)
    parser.set_defaults(func=_run_gateway)


def _add_generate(sub) -> None:
    parser = sub.add_parser("generate", help="Generate once, offline (no server).",
                            description="Load the model in this process and print completions.")
    parser.add_argument("--prompt", action="append", required=True,
                        help="Prompt text; repeat the flag for several prompts.")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64, help="Most tokens to generate.")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 means greedy.")
    sampling.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass.")
    sampling.add_argument("--top-k", type=int, default=-1, help="Keep the k likeliest tokens.")
    sampling.add_argument("--stop", action="append", default=[], help="Stop string (repeatable).")
    sampling.add_argument("--ignore-eos", action="store_true", help="Keep going past EOS.")
    _add_engine_args(parser)
    parser.set_defaults(func=_run_generate)


def _add_bench(sub) -> None:
    try:
        from pdserve.bench.cli import add_parser
    except ImportError:  # the benchmark package is optional for serving
        return
    add_parser(sub)


def _add_profile(sub) -> None:
    from pdserve.engine.profiler import add_parser

    add_parser(sub)


def _run_serve(args: argparse.Namespace) -> int:
    from pdserve.cluster.config import InstanceConfig
    from pdserve.server.app import serve
    from pdserve.server.config import ServerConfig

    server_config = _config_from_args(ServerConfig, args)
    instance = _config_from_args(InstanceConfig, args)
    engine_config = engine_config_from_args(args)
    lifecycle = None
    if instance.role is not None:
        from pdserve.cluster.instance import GroupMembership

        if engine_config.transfer.kv_transfer_port is None:
            raise SystemExit("--role needs --kv-transfer-port (0 picks a free port)")
        from pdserve.server.pd import resolve_secret

        if resolve_secret(server_config.cluster_secret) is None:
            logging.getLogger("pdserve.instance").warning(
                "no --cluster-secret: anyone who reaches this instance can call its /pd/ "
                "routes; set one (or $PDSERVE_CLUSTER_SECRET) on every member and the gateway")
        model = server_config.served_model_name or engine_config.model.model
        lifecycle = GroupMembership(instance, server_config.port, model)
    serve(engine_config, server_config, lifecycle=lifecycle)
    return 0


def _add_cluster(sub) -> None:
    from pdserve.cluster.config import GatewayConfig
    from pdserve.cluster.launch import add_launch_args

    parser = sub.add_parser("cluster", help="Run a P/D group and its gateway on this machine.",
                            description="Starts --prefill and --decode instances of MODEL "
                            "(`pdserve serve` processes, one GPU each when there are several) "
                            "and serves them through a gateway.")
    add_launch_args(parser)
    add_cli_args(parser.add_argument_group("gateway"), GatewayConfig)
    parser.set_defaults(func=_run_cluster)


def _run_cluster(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from pdserve.cluster.config import GatewayConfig
    from pdserve.cluster.launch import default_gpus, run_cluster

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.gpus is None:
        args.gpus = default_gpus()
    asyncio.run(run_cluster(args, _config_from_args(GatewayConfig, args)))
    return 0


def _run_gateway(args: argparse.Namespace) -> int:
    from pdserve.cluster.app import run_gateway
    from pdserve.cluster.config import GatewayConfig

    run_gateway(_config_from_args(GatewayConfig, args))
    return 0


def _config_from_args(config_cls: type, args: argparse.Namespace):
    return config_cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)})


def _run_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    config = engine_config_from_args(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    llm = LLM(**config.flat())
    for output in llm.generate(args.prompt, params):
        completion = output.outputs[0]
        print(f"--- {output.prompt!r} ({completion.finish_reason})")
        print(completion.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
