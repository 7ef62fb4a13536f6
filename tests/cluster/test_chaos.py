"""Chaos: a group of 2 prefill + 2 decode instances (real processes, tiny model, CPU) answers
at least 200 streaming requests while instances are SIGKILLed and restarted. Nothing may be
lost: every request completes, with the text a fault-free run gave (greedy)."""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter

import aiohttp
import pytest

from tests.cluster.group import Group, kill, start_group, stream, wait_until

# ~105 s on an idle 2-core machine; several times that when other work shares the cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUM_REQUESTS = 200  # at least: more while a kill waits for a replacement to join
MAX_REQUESTS = 2000  # where the load ends even if no replacement joins (the test then fails)
CONCURRENCY = 8
PROMPTS = [f"Chaos request {i} begins with" for i in range(10)]
BODY = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "stream_options": {"include_usage": True}}
KILL_AFTER = (15, 50, 85, 120, 155)  # completed requests at which one instance is killed


class Chaos:
    """Kills a random instance (never the last live one of its role) each time the load
    passes a mark in ``KILL_AFTER``, and starts a replacement that joins when it is ready."""

    def __init__(self, group: Group, seed: int = 7) -> None:
        self.group = group
        self.random = random.Random(seed)
        self.kills: list[str] = []
        self.restarts = 0
        self.failed_restarts: list[str] = []  # why a replacement did not join
        self._next = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def completed(self, count: int) -> None:
        """A kill whose mark has passed waits while no role has a spare instance (the
        replacements are still starting)."""
        with self._lock:
            if self._next < len(KILL_AFTER) and count >= KILL_AFTER[self._next]:
                self._next += self._kill_one()

    def _kill_one(self) -> bool:
        roles = dict(self.group.roles)  # replacements join from other threads
        spare = [n for n, r in roles.items() if list(roles.values()).count(r) > 1]
        if not spare:
            return False
        name = self.random.choice(sorted(spare))
        role = roles[name]
        kill(self.group.members[name])
        self.group.remove(name)  # as its ZooKeeper node would, once its session expired
        self.kills.append(name)
        thread = threading.Thread(target=self._replace, args=(f"{name}r", role))
        thread.start()
        self._threads.append(thread)
        return True

    @property
    def finished(self) -> bool:
        return self._next >= len(KILL_AFTER)

    def _replace(self, name: str, role: str) -> None:
        try:
            self.group.add(name, role)
        except Exception as exc:  # noqa: BLE001 - reported by the test, not lost in a thread
            self.failed_restarts.append(f"{name}: {exc}"[:2000])
            return
        self.restarts += 1

    def join(self) -> None:
        for thread in self._threads:
            thread.join(300)


@pytest.fixture
def group():
    group = start_group(max_attempts=8)
    yield group
    group.close()


async def _load(url: str, chaos: Chaos) -> list:
    """``NUM_REQUESTS`` requests, ``CONCURRENCY`` at a time, and more for as long as a kill
    waits for a spare instance: the load outlasts every kill however fast the host serves it
    (a replacement starting takes seconds). The chaos hears of each completion."""
    results: list = []
    done = 0
    loop = asyncio.get_running_loop()

    def more() -> bool:
        return len(results) < NUM_REQUESTS or \
            (not chaos.finished and len(results) < MAX_REQUESTS)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while more():
            index = len(results)  # one event loop: no other worker runs in between
            results.append(None)
            body = {**BODY, "prompt": PROMPTS[index % len(PROMPTS)]}
            try:
                results[index] = await stream(session, url, body)
            except (aiohttp.ClientError, OSError) as exc:  # counted as lost below
                results[index] = exc
            done += 1
            await loop.run_in_executor(None, chaos.completed, done)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*[worker(session) for _ in range(CONCURRENCY)])
    return results


def test_nothing_is_lost_while_instances_are_killed_and_restarted(group):
    url = group.gateway.http.url
    expected = {}
    for prompt in PROMPTS:  # the fault-free answers
        got = asyncio.run(_single(url, {**BODY, "prompt": prompt}))
        assert got.done and got.error is None
        expected[prompt] = got.text
    chaos = Chaos(group)
    results = asyncio.run(_load(url, chaos))
    chaos.join()
    outcome = Counter(_judge(r, expected[PROMPTS[i % len(PROMPTS)]])
                      for i, r in enumerate(results))
    retries = {stage: group.retries(stage) for stage in ("prefill", "resume")}
    print(f"\n{len(results)} requests, kills {chaos.kills}, restarts {chaos.restarts}, "
          f"outcome {dict(outcome)}, gateway retries {retries}")
    assert len(chaos.kills) == len(KILL_AFTER) and len(results) >= NUM_REQUESTS
    assert outcome == Counter({"completed, same text": len(results)})
    wait_until(lambda: chaos.restarts + len(chaos.failed_restarts) == len(chaos.kills),
               timeout=60)
    assert not chaos.failed_restarts


async def _single(url: str, body: dict):
    async with aiohttp.ClientSession() as session:
        return await stream(session, url, body)


def _judge(result, want: str) -> str:
    if isinstance(result, BaseException) or result is None:
        return "lost"
    if result.status != 200 or result.error is not None:
        return f"failed: {result.status} {result.error}"
    if not result.done or result.text != want:
        return "completed, wrong text"
    if result.usage is None or result.usage["completion_tokens"] != BODY["max_tokens"]:
        return "completed, wrong usage"
    return "completed, same text"
