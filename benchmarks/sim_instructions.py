"""Measured: instructions the fleet simulator executes per request, over a fixed window of
simulated time (valgrind's callgrind: a count the host's other work does not move, unlike
CPU seconds on a shared host).

The fleet of ``benchmarks/sim_fleet.py --compare none`` (same defaults, same seed) runs
uninstrumented-for-counting up to ``--start-s``; the window up to ``--end-s`` runs inside a
ctypes callback, and callgrind counts only while ``ffi_call`` is on the stack
(``--toggle-collect=ffi_call``), so setting up the fleet and the time before the window are
not counted. The result divides the instructions by the requests that arrived in the
window. A compiled simulator's C code (``PDSERVE_COMPILE_SIM=1``, docs/cluster.md) runs
inside that call too and is counted with the rest; the result says which ran
(``"compiled"``).

    python benchmarks/sim_instructions.py \\
        --trace benchmarks/data/mooncake_conversation_trace.jsonl \\
        --engine-results benchmarks/results/engine_h200_codellama34b.json \\
        --out benchmarks/results/sim_instructions_<revision>.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import sim_fleet  # noqa: E402
from pdserve.bench.report import result_header, write_json  # noqa: E402
from pdserve.sim import compiled  # noqa: E402
from pdserve.sim.fleet import FleetSim, Lengths  # noqa: E402

# The window runs inside this C call, the only ffi_call of the run: callgrind counts there.
_COUNTED = ctypes.CFUNCTYPE(None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True, help="Mooncake-format jsonl: lengths.")
    parser.add_argument("--engine-results", required=True, help="bench_engine.py JSON.")
    parser.add_argument("--model", default="codellama-34b", help="Preset: KV bytes per token.")
    parser.add_argument("--instances", type=int, default=10_000)
    parser.add_argument("--scenarios", type=int, default=200)
    parser.add_argument("--gateways", type=int, default=4)
    parser.add_argument("--duration-s", type=float, default=3600.0,
                        help="The run the window is taken from (its arrivals and tide).")
    parser.add_argument("--start-s", type=float, default=40.0, help="The window's start.")
    parser.add_argument("--end-s", type=float, default=45.0, help="The window's end.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    parser.add_argument("--inside", help=argparse.SUPPRESS)  # the run under valgrind
    args = parser.parse_args(argv)
    if not 0 <= args.start_s < args.end_s <= args.duration_s:
        parser.error("need 0 <= --start-s < --end-s <= --duration-s")
    return args


def build_fleet(args: argparse.Namespace) -> FleetSim:
    """``sim_fleet.py --compare none``'s fleet (its own code and defaults): on-demand
    dispatch, dynamic ratio."""
    fleet_args = sim_fleet.parse_args([
        "--trace", args.trace, "--engine-results", args.engine_results, "--model", args.model,
        "--instances", str(args.instances), "--scenarios", str(args.scenarios),
        "--gateways", str(args.gateways), "--duration-s", str(args.duration_s),
        "--seed", str(args.seed)])
    (labels,) = sim_fleet.configurations("none")
    return sim_fleet.build_fleet(fleet_args, sim_fleet.latency_model(fleet_args),
                                 Lengths.from_trace(args.trace), labels)


def run_window(args: argparse.Namespace) -> dict:
    """Runs the fleet to the window, then the window inside the counted C call."""
    fleet = build_fleet(args)
    fleet.begin(args.duration_s)
    fleet.loop.run(until=args.start_s)
    before = fleet.arrived()
    failure: list[BaseException] = []

    def window() -> None:
        try:
            fleet.loop.run(until=args.end_s)
        except BaseException as error:  # ctypes would print and drop it
            failure.append(error)

    _COUNTED(window)()
    if failure:
        raise failure[0]
    return {"arrivals": fleet.arrived() - before, "num_instances": fleet.num_instances,
            "compiled": compiled()}


def counted_instructions(callgrind_out: str) -> int:
    """The ``totals:`` (or ``summary:``) line of a callgrind output file: instructions."""
    text = Path(callgrind_out).read_text()
    match = re.search(r"^(?:totals|summary):\s*(\d+)", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{callgrind_out} has no totals line")
    return int(match.group(1))


def under_callgrind(argv: list[str], workdir: str) -> tuple[dict, int]:
    """Runs this script with ``--inside`` under callgrind; its window and the count."""
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    out, report = os.path.join(workdir, "callgrind.out"), os.path.join(workdir, "window.json")
    command = ["valgrind", "--tool=callgrind", "--collect-atstart=no",
               "--toggle-collect=ffi_call", f"--callgrind-out-file={out}",
               sys.executable, str(Path(__file__).resolve()), *argv, "--inside", report]
    subprocess.run(command, check=True, stderr=subprocess.DEVNULL)
    return json.loads(Path(report).read_text()), counted_instructions(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.inside:
        Path(args.inside).write_text(json.dumps(run_window(args)))
        return 0
    passed = [a for a in argv if a != "--out" and a != args.out]
    config = {k: v for k, v in vars(args).items() if k not in ("out", "inside")}
    # Before the count: the revision that ran (a commit during the minutes it takes would
    # otherwise be named in its place).
    header = result_header(config)
    with tempfile.TemporaryDirectory() as workdir:
        window, instructions = under_callgrind(passed, workdir)
    result = {**header, "kind": "measurement", **window,
              "instructions": instructions,
              "instructions_per_request": instructions / max(1, window["arrivals"])}
    print(f"{window['arrivals']} arrivals in [{args.start_s}, {args.end_s}) s: "
          f"{instructions:,} instructions, {result['instructions_per_request']:,.0f} a request")
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
