"""sealer.KeyedLocks: one lock per artifact while it is needed, none left behind."""

from __future__ import annotations

import asyncio

from sidecar.sealer import KeyedLocks


def test_holders_of_one_key_take_turns_and_leave_nothing_behind() -> None:
    async def scenario() -> None:
        locks = KeyedLocks()
        order: list[str] = []
        first_in = asyncio.Event()
        release_first = asyncio.Event()

        async def first() -> None:
            async with locks.hold("a"):
                order.append("first in")
                first_in.set()
                await release_first.wait()
                order.append("first out")

        async def second() -> None:
            await first_in.wait()
            async with locks.hold("a"):
                order.append("second in")

        async def other() -> None:
            await first_in.wait()
            async with locks.hold("b"):  # another key never waits for "a"
                order.append("other in")

        tasks = [asyncio.create_task(f()) for f in (first, second, other)]
        await first_in.wait()
        while "other in" not in order:
            await asyncio.sleep(0)
        assert len(locks) == 1  # "a", held by first with second waiting; "b" already gone
        release_first.set()
        await asyncio.gather(*tasks)
        assert order == ["first in", "other in", "first out", "second in"]
        assert len(locks) == 0

    asyncio.run(scenario())


def test_a_holder_that_fails_still_lets_go() -> None:
    async def scenario() -> None:
        locks = KeyedLocks()
        try:
            async with locks.hold("a"):
                raise RuntimeError("boom")
        except RuntimeError:
            pass
        assert len(locks) == 0
        async with locks.hold("a"):
            assert len(locks) == 1

    asyncio.run(scenario())
