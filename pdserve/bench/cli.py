"""``pdserve bench serve | compare | plot`` (also ``python -m pdserve.bench ...``).

- ``serve``: one or more workloads against a running OpenAI-compatible server
  (``--host``/``--port`` or ``--base-url``; pdserve, vLLM or SGLang alike) or an
  in-process engine (``--backend engine``).
- ``compare``: the same workloads against several engine configurations, each server
  started, benchmarked and stopped in turn; one JSON and one report.
- ``plot``: the plots and the report of a saved result.

Flag names follow ``vllm bench serve`` where one exists. The exit status is 1 when any
request failed (the first distinct errors are printed), 2 when the run could not start.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import shlex
import sys
from pathlib import Path

from pdserve.bench.spec import DATASETS, WorkloadSpec, parse_spec
from pdserve.bench.workloads import BenchError


def _rates(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", help="sharegpt: a ShareGPT JSON file (without it: "
                   "synthetic ShareGPT-like lengths); mooncake: the jsonl trace.")
    g.add_argument("--tokenizer", help="The served model's tokenizer.json (or its folder), "
                   "to tokenize a ShareGPT file. Default: the model's folder, or pdserve's "
                   "byte-level tokenizer for a pdserve preset.")
    g.add_argument("--workload", action="append", default=[], metavar="SPEC",
                   help="NAME[:key=value,...], e.g. 'sharegpt:num=200,rate=4' or "
                        "'mooncake:path=trace.jsonl,trace_duration_s=60'; repeatable. Keys are "
                        "WorkloadSpec fields (aliases num, rate, concurrency, trace); the other "
                        "flags give the defaults. Without it: one workload from --dataset-name.")
    g.add_argument("--num-prompts", type=int, default=100,
                   help="Requests per run (mooncake: a cap on the rows replayed).")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--max-context", type=int, help="Clip prompts to fit prompt + output.")
    g.add_argument("--vocab-size", type=int, default=256,
                   help="Prompt token ids are drawn below this.")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="mooncake without --request-rate: multiply trace times.")
    g.add_argument("--trace-start-s", type=float, default=0.0)
    g.add_argument("--trace-duration-s", type=float, help="mooncake: replay this window only.")
    g.add_argument("--trace-block-size", type=int, default=512, help="Tokens per hash id.")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load and SLOs")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="Requests/s (inf: all at once). mooncake: rescale the trace to it.")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of arrival gaps: 1 Poisson, < 1 burstier.")
    g.add_argument("--max-concurrency", type=int, help="Cap on requests in flight.")
    g.add_argument("--ttft-slo-ms", type=float)
    g.add_argument("--itl-slo-ms", type=float, help="Compared with each request's TPOT.")
    g.add_argument("--goodput", action="store_true",
                   help="Search the highest rate with SLO attainment >= --goodput-target.")
    g.add_argument("--goodput-rates", type=_rates, default=(),
                   help="Comma-separated rates to sweep instead of bisecting.")
    g.add_argument("--goodput-start-rate", type=float, default=1.0)
    g.add_argument("--goodput-min-rate", type=float, default=0.01)
    g.add_argument("--goodput-max-rate", type=float, default=1024.0)
    g.add_argument("--goodput-tolerance", type=float, default=0.1,
                   help="Stop bisecting when (high - low) / high is below this.")
    g.add_argument("--goodput-max-probes", type=int, default=10)
    g.add_argument("--goodput-target", type=float, default=0.9)


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--out", help="Write the result JSON here.")
    g.add_argument("--report", help="Markdown report (default: next to --out, .md).")
    g.add_argument("--plot-dir", help="Write PNG plots here.")
    g.add_argument("--no-progress", "--disable-tqdm", dest="progress", action="store_false")
    g.add_argument("--no-samples", dest="samples", action="store_false",
                   help="Leave per-request samples and timelines out of the JSON.")
    g.add_argument("--timeline-interval-ms", type=float, default=250.0)
    g.add_argument("--warmup-requests", type=int, default=2,
                   help="Unmeasured requests (the workload's first ones, output capped at 4 "
                        "tokens) sent before each workload; absorbs kernel compilation.")


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _add_request_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--extra-body", type=_json_object,
                   help="JSON object merged (top-level keys replace) into every request. "
                        "Default: '{\"return_engine_timing\": true}' for a pdserve server "
                        "(every chunk states its token count), nothing for others. E.g. "
                        "'{\"logprobs\": 0}' for a server that states counts only that way, "
                        "'{\"stream_options\": {\"include_usage\": true}}' for one that "
                        "rejects continuous_usage_stats.")


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="Benchmark one server or an in-process engine.")
    p.add_argument("--backend", choices=("http", "engine"), default="http")
    p.add_argument("--host", help="Server host (default 127.0.0.1), as in vllm bench serve.")
    p.add_argument("--port", type=int, help="Server port (default 8000).")
    p.add_argument("--base-url", help="e.g. http://10.0.0.2:8000; instead of --host/--port.")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", help="http: the model name sent (default: the server's first "
                   "/v1/models entry); engine: the preset or checkpoint to load.")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="engine: an EngineConfig field, e.g. schedule=chunked; repeatable.")
    p.add_argument("--timeline-url", help="Poll this during runs (…/metrics: Prometheus "
                   "text, else a JSON object of numbers). Default: BASE_URL/metrics.")
    p.add_argument("--no-timeline", dest="timeline", action="store_false")
    _add_request_args(p)
    for add in (_add_workload_args, _add_load_args, _add_output_args):
        add(p)
    p.set_defaults(func=handler, bench_mode="serve")


def _add_compare(sub) -> None:
    from pdserve.bench.compare import DEFAULT_SERVER_CMD

    p = sub.add_parser("compare", help="The same workloads against several configurations.")
    p.add_argument("--model", default="tiny", help="Passed to every server started.")
    p.add_argument("--config", action="append", required=True, metavar="NAME=ARGS|NAME@URL",
                   help="e.g. 'chunk512=--schedule chunked --chunk-size 512', or "
                        "'vllm@http://host:8000' for a server already running; repeatable.")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARGS",
                   help="Arguments given to every server started (shell-split).")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--server-cmd", default=DEFAULT_SERVER_CMD,
                   help="Launch template with {model} and {port}.")
    p.add_argument("--startup-timeout-s", type=float, default=1800.0)
    p.add_argument("--log-dir", help="Server logs (default: next to --out).")
    p.add_argument("--timeline-path", default="/metrics", help="'' for no timeline.")
    _add_request_args(p)
    for add in (_add_workload_args, _add_load_args, _add_output_args):
        add(p)
    p.set_defaults(func=handler, bench_mode="compare")


def _add_plot(sub) -> None:
    p = sub.add_parser("plot", help="Plots and report of saved results (several: merged).")
    p.add_argument("result", nargs="+", help="Result JSON files; runs of several are merged "
                   "(e.g. a comparison split over several device sessions).")
    p.add_argument("--plot-dir", help="Default: next to the first result.")
    p.add_argument("--report")
    p.add_argument("--out", help="Write the merged result here.")
    p.set_defaults(func=handler, bench_mode="plot")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``bench`` (with serve / compare / plot) on a parent CLI's subparsers."""
    parser = subparsers.add_parser("bench", help="Benchmark a server: latency, SLOs, goodput.",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench_mode", required=True)
    for add in (_add_serve, _add_compare, _add_plot):
        add(sub)
    return parser


# --- handlers ---------------------------------------------------------------------------------

def workload_specs(args: argparse.Namespace) -> list[WorkloadSpec]:
    defaults = WorkloadSpec(
        dataset=args.dataset_name, num_prompts=args.num_prompts,
        input_len=args.random_input_len, output_len=args.random_output_len,
        range_ratio=args.random_range_ratio, path=args.dataset_path,
        max_context=args.max_context, vocab_size=args.vocab_size, seed=args.seed,
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, trace_time_scale=args.trace_time_scale,
        trace_start_s=args.trace_start_s, trace_duration_s=args.trace_duration_s,
        block_size=args.trace_block_size)
    return [parse_spec(text, defaults) for text in args.workload] or [defaults]


def _options(args: argparse.Namespace):
    from pdserve.bench.runner import GoodputOptions, RunContext, SloOptions

    slo = SloOptions(args.ttft_slo_ms, args.itl_slo_ms)
    goodput = GoodputOptions(args.goodput, args.goodput_rates, args.goodput_start_rate,
                             args.goodput_min_rate, args.goodput_max_rate,
                             args.goodput_tolerance, args.goodput_max_probes,
                             args.goodput_target)
    ctx = RunContext(progress=args.progress, timeline_interval_s=args.timeline_interval_ms / 1e3,
                     keep_samples=args.samples, warmup_requests=args.warmup_requests)
    return slo, goodput, ctx


def _engine_args(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg needs KEY=VALUE, got {pair!r}")
        out[key.strip()] = _literal(value.strip())
    return out


def _literal(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def base_url(args: argparse.Namespace) -> str:
    """``--base-url``, or ``http://HOST:PORT`` from ``--host`` / ``--port``; not both."""
    if args.base_url and (args.host or args.port):
        raise BenchError("give either --base-url or --host/--port, not both")
    if args.base_url:
        return args.base_url
    return f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"


def _make_backend(args: argparse.Namespace):
    if args.backend == "engine":
        from pdserve.bench.engine_backend import EngineBackend, build_engine

        engine_args = _engine_args(args.engine_arg)
        return EngineBackend(lambda: build_engine(args.model or "tiny", engine_args)), None
    from pdserve.bench.client import HttpBackend
    from pdserve.bench.timeline import make_source

    timeline = None
    if args.timeline:
        timeline = make_source(args.timeline_url or base_url(args).rstrip("/") + "/metrics")
    return HttpBackend(base_url(args), args.model, args.endpoint, args.extra_body), timeline


async def _serve(args: argparse.Namespace) -> dict:
    from pdserve.bench.report import print_summary
    from pdserve.bench.runner import run_workload

    slo, goodput, ctx = _options(args)
    backend, timeline = _make_backend(args)
    ctx = dataclasses.replace(ctx, timeline=timeline)
    config = {"name": args.model or args.backend, "backend": args.backend,
              "base_url": base_url(args) if args.backend == "http" else None,
              "engine_args": _engine_args(args.engine_arg)}
    await backend.start()
    config["name"] = getattr(backend, "model", None) or config["name"]
    config["extra_body"] = getattr(backend, "extra_body", None)
    config["engine"] = getattr(backend, "engine_info", None)
    owned_by = getattr(backend, "owned_by", "pdserve")  # the in-process engine is pdserve's
    try:
        ctx = dataclasses.replace(ctx, tokenizer=_tokenizer(args, config["name"], owned_by))
        runs = []
        for spec in workload_specs(args):
            result = await run_workload(backend, spec, slo, goodput, ctx)
            print_summary(result, spec.name)
            runs.append({"name": config["name"], **result})
    finally:
        await backend.close()
    return _single_or_runs(config, runs)


def _single_or_runs(config: dict, runs: list[dict]) -> dict:
    from pdserve.bench.report import result_header

    head = result_header(config)
    # One workload: its metrics at the top level, as `vllm bench serve` users expect.
    if len(runs) == 1:
        return {**head, **runs[0]}
    return {**head, "runs": runs}


def _tokenizer(args: argparse.Namespace, model: str, owned_by: str | None):
    """The served model's tokenizer when a workload reads text, else None."""
    from pdserve.bench.sharegpt import served_tokenizer

    needs_text = any(s.dataset == "sharegpt" and s.path for s in workload_specs(args))
    return served_tokenizer(args.tokenizer, model, owned_by) if needs_text else None


async def _compare(args: argparse.Namespace) -> dict:
    from pdserve.bench.compare import CompareOptions, parse_config, run_compare
    from pdserve.bench.report import result_header

    slo, goodput, ctx = _options(args)
    # The servers compare starts are pdserve's, serving --model.
    ctx = dataclasses.replace(ctx, tokenizer=_tokenizer(args, args.model, "pdserve"))
    log_dir = Path(args.log_dir) if args.log_dir else _default_log_dir(args.out)
    common = [a for text in args.server_arg for a in shlex.split(text)]
    opts = CompareOptions(args.model, args.port, args.server_cmd, tuple(common),
                          args.startup_timeout_s, log_dir, args.timeline_path or None,
                          args.extra_body)
    configs = [parse_config(text) for text in args.config]
    result = await run_compare(configs, workload_specs(args), slo, goodput, ctx, opts)
    return {**result_header({"name": "compare", "model": args.model,
                             "server_args": common}), **result}


def _default_log_dir(out: str | None) -> Path:
    if out:
        return Path(out).with_suffix("").parent / (Path(out).stem + "_logs")
    return Path("bench_logs")


def _write_outputs(result: dict, out: str | None, report: str | None,
                   plot_dir: str | None) -> None:
    from pdserve.bench.report import markdown_report, write_json

    if out:
        write_json(result, out)
        print(f"result: {out}")
    report = report or (str(Path(out).with_suffix(".md")) if out else None)
    if report:
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        Path(report).write_text(markdown_report(result))
        print(f"report: {report}")
    if plot_dir:
        from pdserve.bench.plots import plot_all

        for path in plot_all(result, plot_dir):
            print(f"plot: {path}")


def _check_plotting(args: argparse.Namespace) -> None:
    """Plots asked for without matplotlib: say so before the run, not after it."""
    if args.plot_dir is None and args.bench_mode != "plot":
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("plots need matplotlib: pip install 'pdserve[bench]'") from None


def handler(args: argparse.Namespace) -> int:
    """Runs the ``bench`` mode chosen on the command line; returns the exit status."""
    try:
        _check_plotting(args)
        result = _result_of(args)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plot_dir = args.plot_dir
    if args.bench_mode == "plot":
        plot_dir = plot_dir or str(Path(args.result[0].removesuffix(".gz")).with_suffix("")) \
            + "_plots"
    _write_outputs(result, args.out, args.report, plot_dir)
    return _report_problems(result)


def _result_of(args: argparse.Namespace) -> dict:
    if args.bench_mode == "plot":
        from pdserve.bench.report import load_json, merge_results

        try:
            return merge_results([load_json(path) for path in args.result])
        except (OSError, json.JSONDecodeError) as exc:
            raise BenchError(f"cannot read a result: {exc}") from None
    run = _serve if args.bench_mode == "serve" else _compare
    return asyncio.run(run(args))


def _report_problems(result: dict) -> int:
    """Prints failed requests and approximate token counts; 1 when any request failed."""
    from pdserve.bench.report import approximate_count_lines, failure_lines

    for line in approximate_count_lines(result):
        print(f"warning: {line}", file=sys.stderr)
    failures = failure_lines(result)
    for line in failures:
        print(line, file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m pdserve.bench MODE ...``: the same parser as ``pdserve bench``."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench_mode", required=True)
    for add in (_add_serve, _add_compare, _add_plot):
        add(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
