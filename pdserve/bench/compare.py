"""Several engine configurations, one after another, on the same GPU and the same workloads.

Each configuration is ``NAME=SERVER ARGS`` (a server this command starts, waits for on
``/health``, benchmarks, then stops with SIGTERM before the next one takes the GPU) or
``NAME@URL`` (a server already running elsewhere, e.g. a vLLM or SGLang peer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from pdserve.bench.client import HttpBackend
from pdserve.bench.report import print_summary
from pdserve.bench.runner import GoodputOptions, RunContext, SloOptions, run_workload
from pdserve.bench.spec import WorkloadSpec
from pdserve.bench.timeline import make_source
from pdserve.bench.workloads import BenchError

DEFAULT_SERVER_CMD = f"{shlex.quote(sys.executable)} -m pdserve serve {{model}} " \
                     "--host 127.0.0.1 --port {port}"
STOP_GRACE_S = 60.0
# A /health request costs a fraction of a millisecond; each poll later than the start
# is time the compare waits for nothing.
HEALTH_POLL_S = 0.1


@dataclass(frozen=True)
class ServerConfig:
    name: str
    args: tuple[str, ...] = ()
    url: str | None = None
    """Set for a server this command does not own."""


def parse_config(text: str) -> ServerConfig:
    """``NAME=ARGS`` (launched here) or ``NAME@URL`` (already running)."""
    at, eq = text.find("@"), text.find("=")
    if at > 0 and (eq < 0 or at < eq):
        return ServerConfig(text[:at].strip(), url=text[at + 1:].strip())
    if eq <= 0:
        raise BenchError(f"bad config {text!r}: expected NAME=SERVER ARGS or NAME@URL")
    return ServerConfig(text[:eq].strip(), tuple(shlex.split(text[eq + 1:])))


class ManagedServer:
    """One server subprocess: started in its own process group so a SIGTERM reaches any
    workers it spawned, with its output in a log file (a full pipe would stall it)."""

    def __init__(self, command: list[str], port: int, log_path: Path,
                 host: str = "127.0.0.1") -> None:
        self.command = command
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")  # noqa: SIM115 - handed to the child; closed in stop()
        log.write("$ " + shlex.join(self.command) + "\n")
        log.flush()
        self._log = log
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    async def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode} before "
                                       f"becoming healthy; log: {self.log_path}")
                if await _healthy(session, self.url):
                    return
                await asyncio.sleep(HEALTH_POLL_S)
        raise TimeoutError(f"server not healthy after {timeout_s:.0f} s; log: {self.log_path}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        self.proc = None


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/health") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


def server_command(template: str, model: str, port: int, config: ServerConfig,
                   common_args: list[str]) -> list[str]:
    """The launch command: ``template`` ({model}, {port} filled), then shared and own args."""
    base = shlex.split(template.format(model=shlex.quote(model), port=port))
    return base + list(common_args) + list(config.args)


@dataclass
class CompareOptions:
    model: str = "tiny"
    port: int = 8100
    server_cmd: str = DEFAULT_SERVER_CMD
    common_args: tuple[str, ...] = ()
    startup_timeout_s: float = 1800.0
    log_dir: Path = Path("bench_logs")
    timeline_path: str | None = "/metrics"
    """Polled on each server during runs; None: no timeline."""
    extra_body: dict | None = None


async def run_compare(configs: list[ServerConfig], specs: list[WorkloadSpec], slo: SloOptions,
                      goodput: GoodputOptions, ctx: RunContext, opts: CompareOptions) -> dict:
    """Every workload against every configuration; one server on the GPU at a time."""
    runs: list[dict] = []
    for config in configs:
        runs.extend(await _run_config(config, specs, slo, goodput, ctx, opts))
    return {"model": opts.model, "configs": [_describe(c) for c in configs], "runs": runs}


def _describe(config: ServerConfig) -> dict:
    return {"name": config.name, "server_args": list(config.args), "url": config.url}


async def _run_config(config: ServerConfig, specs: list[WorkloadSpec], slo: SloOptions,
                      goodput: GoodputOptions, ctx: RunContext,
                      opts: CompareOptions) -> list[dict]:
    server = None
    url = config.url
    try:
        if url is None:
            command = server_command(opts.server_cmd, opts.model, opts.port, config,
                                     list(opts.common_args))
            server = ManagedServer(command, opts.port, opts.log_dir / f"{config.name}.log")
            print(f"[compare] {config.name}: {shlex.join(command)}", flush=True)
            server.start()
            await server.wait_healthy(opts.startup_timeout_s)
            url = server.url
        return await _run_specs(config, url, specs, slo, goodput, ctx, opts)
    except (BenchError, RuntimeError, TimeoutError, OSError) as exc:
        print(f"[compare] {config.name} failed: {exc}", flush=True)
        return [{**_describe(config), "error": str(exc), "workload": s.describe()} for s in specs]
    finally:
        if server is not None:
            server.stop()


async def _run_specs(config: ServerConfig, url: str, specs: list[WorkloadSpec],
                     slo: SloOptions, goodput: GoodputOptions, ctx: RunContext,
                     opts: CompareOptions) -> list[dict]:
    backend = HttpBackend(url, extra_body=opts.extra_body)
    await backend.start()
    timeline = make_source(url + opts.timeline_path) if opts.timeline_path else None
    run_ctx = dataclasses.replace(ctx, timeline=timeline)
    runs = []
    try:
        for spec in specs:
            result = await run_workload(backend, spec, slo, goodput, run_ctx)
            runs.append({**_describe(config), "engine": backend.engine_info, **result})
            print_summary(result, f"{config.name} / {spec.name}")
    finally:
        await backend.close()
    return runs
