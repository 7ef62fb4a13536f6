"""The other HTTP processes of ``pdserve serve --api-server-count N``.

The first process starts the engine with N channels, keeps one, and starts N - 1 of these
processes, each handed one channel: each runs ``build_app`` on its own ``EngineClient`` and
listens on the same port (``SO_REUSEPORT``: the kernel spreads new connections over the
processes). A control pipe between the first process and each other one says when it
listens, and its end tells the other process that the first one is gone.

Life cycle: SIGTERM or SIGINT at the first process is passed on as ``DRAIN_SIGNAL`` (once
per signal: a second one cuts every drain short); the others ignore SIGINT and SIGTERM,
which reach the whole process group (Ctrl-C; systemd's default stop; ``kill -- -PGID``), so
that each signal counts once. Each process drains its own
requests; the first one waits for the others to leave, then stops the engine. A process
that dies stops the whole server (exit code 1, the reason logged): the engine aborts only
the dead process's requests, and the others drain theirs.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

from pdserve.server.app import (
    STATE_KEY,
    build_app,
    drain,
    install_signals,
    listen,
    run_event_loop,
)
from pdserve.server.client import EngineClient, Pipe
from pdserve.server.config import ServerConfig
from pdserve.signals import ignore_group_signals

logger = logging.getLogger("pdserve.server")

LISTENING = "listening"
DRAIN_SIGNAL = signal.SIGUSR1
"""How the first process passes a stop on: a signal of its own, since the others ignore
the ones that reach the whole process group."""
EXIT_GRACE_S = 10.0  # past the drain: the aborted requests' answers and the channel's close


class APIWorkers:
    """The first HTTP process's handle on the others: starts them, passes signals on,
    notices one that dies (``failed``)."""

    def __init__(self, pipes: list[Pipe], config: ServerConfig, api_keys: tuple[bytes, ...],
                 sampling_defaults: dict[str, Any], created: int) -> None:
        self._loop = asyncio.get_running_loop()
        self.failed: asyncio.Future[str] = self._loop.create_future()
        """Resolves with the reason when a process exits before ``stop``."""
        self._stopping = False
        self._signals_sent = 0
        self.processes: list[mp.process.BaseProcess] = []
        self._controls: list[Connection] = []
        for index, pipe in enumerate(pipes, start=1):
            self._start(index, pipe, (config, api_keys, sampling_defaults, created))

    def _start(self, index: int, pipe: Pipe, settings: tuple) -> None:
        ctx = mp.get_context("spawn")  # no fork: this process holds an event loop and threads
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=run_api_server, name=f"pdserve-api-{index}", daemon=True,
                              args=(index, pipe, *settings, theirs))
        process.start()
        # Only the worker may hold its channel, or its death would never read as EOF.
        for end in (theirs, *pipe):
            end.close()
        self.processes.append(process)
        self._controls.append(ours)
        self._loop.add_reader(process.sentinel, self._on_exit, index, process)

    async def started(self, timeout: float) -> None:
        """Until every process listens; RuntimeError naming the first that does not."""
        waits = [self._loop.run_in_executor(None, _wait_listening, index, control, timeout)
                 for index, control in enumerate(self._controls, start=1)]
        for failure in await asyncio.gather(*waits):
            if failure is not None:
                raise RuntimeError(failure)
        pids = ", ".join(str(process.pid) for process in self.processes)
        logger.info("%d more HTTP processes listen (pids %s)", len(self.processes), pids)

    def _on_exit(self, index: int, process: mp.process.BaseProcess) -> None:
        self._loop.remove_reader(process.sentinel)
        if self._stopping or self.failed.done():
            return
        process.join(1.0)  # the sentinel closes as it exits; reap it for the exit code
        reason = (f"HTTP process {index} (pid {process.pid}) exited unexpectedly "
                  f"(code {process.exitcode})")
        logger.error("%s; stopping the server", reason)
        self.failed.set_result(reason)

    def forward_signal(self) -> None:
        """One ``DRAIN_SIGNAL`` to each live process: the first starts its drain, a second
        cuts it."""
        self._stopping = True  # from now on a process that leaves is no failure
        self._signals_sent += 1
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, DRAIN_SIGNAL)

    def stop(self) -> None:
        """Starts every process's drain (unless a signal already did)."""
        self._stopping = True
        if self._signals_sent == 0:
            self.forward_signal()

    async def join(self, drain_timeout: float) -> None:
        """Waits for every process to leave; kills those still there after the drain."""
        for process in self.processes:
            await self._loop.run_in_executor(None, process.join, drain_timeout + EXIT_GRACE_S)
            if process.is_alive():
                logger.warning("HTTP process %s did not exit; killing it", process.pid)
                process.kill()
                await self._loop.run_in_executor(None, process.join, 5.0)
        self._close()

    def kill(self) -> None:
        self._stopping = True
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(5.0)
        self._close()

    def _close(self) -> None:
        for process, control in zip(self.processes, self._controls, strict=True):
            self._loop.remove_reader(process.sentinel)
            control.close()


def _wait_listening(index: int, control: Connection, timeout: float) -> str | None:
    """None once process ``index`` says it listens; else why not."""
    try:
        if control.poll(timeout) and control.recv() == LISTENING:
            return None
    except (EOFError, OSError):
        return f"HTTP process {index} exited before it listened (see its log above)"
    return f"HTTP process {index} did not listen within {timeout:.0f} s"


# ---- in each of the other processes -------------------------------------------------------


def run_api_server(index: int, pipe: Pipe, config: ServerConfig, api_keys: tuple[bytes, ...],
                   sampling_defaults: dict[str, Any], created: int, control: Connection
                   ) -> None:
    """Process entry point of HTTP process ``index`` (1 .. N-1)."""
    ignore_group_signals()  # the first process passes each one on once
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s http-{index} %(levelname)s %(message)s")
    settings = (config, api_keys, sampling_defaults, created)
    run_event_loop(_serve(index, pipe, settings, control))


async def _serve(index: int, pipe: Pipe, settings: tuple, control: Connection) -> None:
    config, api_keys, sampling_defaults, created = settings
    try:
        client = await EngineClient.attach(pipe, config.engine_start_timeout)
    except RuntimeError as exc:
        raise SystemExit(f"pdserve serve (HTTP process {index}): {exc}") from None
    app = build_app(client, config, api_keys, sampling_defaults, index, created)
    runner = await listen(app, config)
    stop, force = install_signals(signals=(DRAIN_SIGNAL,))
    control.send(LISTENING)
    _stop_when_first_process_goes(control, stop)
    await asyncio.wait([asyncio.ensure_future(stop.wait()), client.gave_up],
                       return_when=asyncio.FIRST_COMPLETED)
    await drain(app[STATE_KEY], config.shutdown_timeout, force)
    await runner.cleanup()
    await client.shutdown()
    if client.gave_up.done():
        raise SystemExit(f"pdserve serve (HTTP process {index}): {client.gave_up.result()}")


def _stop_when_first_process_goes(control: Connection, stop: asyncio.Event) -> None:
    """The first process never writes again: the control pipe turns readable only when it
    is gone (killed, say), and then this process must not be left behind."""
    loop = asyncio.get_running_loop()

    def on_readable() -> None:
        loop.remove_reader(control.fileno())
        if not stop.is_set():
            logger.error("the first HTTP process is gone; stopping")
            stop.set()

    loop.add_reader(control.fileno(), on_readable)
