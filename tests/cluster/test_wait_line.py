"""The gateway's line of refused requests: first come, first served; woken one at a time."""

from __future__ import annotations

import asyncio

from pdserve.cluster.gateway import WaitLine


def test_wake_one_releases_the_head_of_the_line_in_order():
    async def run() -> list[str]:
        line, order = WaitLine(), []

        async def waiter(name: str, first: bool = False) -> None:
            await line.wait(10.0, first=first)
            order.append(name)

        tasks = [asyncio.ensure_future(waiter("a"))]
        await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(waiter("b")))
        await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(waiter("head", first=True)))  # a retry keeps its place
        await asyncio.sleep(0)
        assert len(line) == 3
        for _ in range(3):
            line.wake_one()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert len(line) == 0
        return order

    assert asyncio.run(run()) == ["head", "a", "b"]


def test_a_waiter_looks_again_after_its_timeout_and_leaves_the_line():
    async def run() -> None:
        line = WaitLine()
        loop = asyncio.get_running_loop()
        start = loop.time()
        await line.wait(0.05, first=False)
        assert 0.04 < loop.time() - start < 1.0
        assert len(line) == 0
        line.wake_one()  # nobody waiting: a no-op

    asyncio.run(run())
