"""``pdserve profile``'s command line, apart from the profiler: building every subcommand's
parser must not import torch (the profiler does, at ~1 s), so that ``pdserve --help`` and a
mistyped flag answer at once."""

from __future__ import annotations

import argparse

DESCRIPTION = ("``pdserve profile``: time the engine's own launches, fit the latency "
               "predictor, save it.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "profile", help="Profile decode/prefill latency per SM split; fit and save the "
        "multiplex latency predictor.", description=DESCRIPTION)
    parser.add_argument("model", nargs="?", default="codellama-34b",
                        help="Preset name or checkpoint folder (default: codellama-34b).")
    parser.add_argument("--load-format", default="auto", help="auto | dummy | safetensors.")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None, help="A .json file, or a folder (default: "
                        "$PDSERVE_PROFILE_DIR or ~/.cache/pdserve/profiles).")
    parser.add_argument("--decode-sms", default=None,
                        help="Decode SM counts to profile, comma-separated (default "
                        "16,24,32,48,64, the serving default).")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="Profile the model split over this many GPUs (saved apart from "
                        "the one-GPU profile).")
    parser.add_argument("--quick", action="store_true",
                        help="A tiny grid for small models and smoke tests.")
    parser.set_defaults(func=_run)
    return parser


def _run(args: argparse.Namespace) -> int:
    from pdserve.engine.profiler import run

    return run(args)
