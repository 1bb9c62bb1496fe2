"""pull's bounded concurrency: at most `limit` transfers at once; a failure starts nothing new,
lets those under way finish, and is raised."""

from __future__ import annotations

import asyncio

import pytest

from controller.pull import in_flight


def test_at_most_limit_run_at_once_and_all_run() -> None:
    running, peak, done = 0, 0, []

    async def work(i: int) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        running -= 1
        done.append(i)

    asyncio.run(in_flight(list(range(20)), work, 4))
    assert peak == 4 and sorted(done) == list(range(20))


def test_a_failure_starts_nothing_new_lets_the_others_finish_and_is_raised() -> None:
    started, finished = [], []
    gate = asyncio.Event

    async def main() -> None:
        release = gate()

        async def work(i: int) -> None:
            started.append(i)
            if i == 1:
                raise OSError("disk full")
            await release.wait()
            finished.append(i)

        async def open_later() -> None:
            while 1 not in started:
                await asyncio.sleep(0)
            await asyncio.sleep(0)
            release.set()

        opener = asyncio.create_task(open_later())
        with pytest.raises(OSError, match="disk full"):
            await in_flight(list(range(10)), work, 3)
        await opener

    asyncio.run(main())
    assert sorted(started) == [0, 1, 2] and sorted(finished) == [0, 2]
