"""Start-up waits for its workers with `gather_reporting`: results in order, the first failure
at once, and a log line naming the workers still pending (a worker Ray cannot place used to
make `pdserve serve` hang without a word)."""
from __future__ import annotations

import asyncio
import logging

import pytest

from cluster.orchestration.launcher import gather_reporting


async def _after(s: float, value: object) -> object:
    await asyncio.sleep(s)
    return value


async def _fail_after(s: float) -> None:
    await asyncio.sleep(s)
    raise RuntimeError("actor died while loading its model")


def test_results_in_order_and_the_slow_one_is_named(caplog):
    """decode-0 finishes only once a report has named it (no race with the clock)."""
    caplog.set_level(logging.WARNING, logger="pdserve.launcher")

    async def run() -> list[object]:
        reported = asyncio.Event()

        async def decode_ready() -> str:
            await reported.wait()
            return "b"

        def describe() -> str:
            reported.set()
            return "free: {'pdserve_decode': 0.0}"
        return await gather_reporting({"prefill-0": _after(0.0, "a"), "decode-0": decode_ready()},
                                      every_s=0.05, describe=describe)

    assert asyncio.run(run()) == ["a", "b"]
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all("decode-0" in m and "prefill-0" not in m and "pdserve_decode" in m for m in lines)


def test_the_first_failure_is_raised_at_once_and_the_rest_cancelled():
    async def run() -> tuple[BaseException, asyncio.Task]:
        forever = asyncio.ensure_future(asyncio.sleep(3600))
        with pytest.raises(RuntimeError, match="actor died") as err:
            await gather_reporting({"a": forever, "b": _fail_after(0.01)}, every_s=60, describe=str)
        await asyncio.sleep(0)
        return err.value, forever

    _, forever = asyncio.run(run())
    assert forever.cancelled()


def test_quiet_when_all_are_ready_in_time(caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.launcher")
    assert asyncio.run(gather_reporting({"w": _after(0, 1)}, every_s=5, describe=str)) == [1]
    assert not caplog.records
