"""FirstTokenHold: when a hand-off's held first token may go to the client."""
from __future__ import annotations

import asyncio

import pytest

from cluster.orchestration.first_token_hold import FirstTokenHold


async def _joined(hold: FirstTokenHold, clean: bool, fail: bool = False) -> None:
    await asyncio.sleep(0)
    hold.expect_admission = clean
    if fail:
        raise RuntimeError("the decode worker died")


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 5))


def test_a_clean_join_holds_until_the_admission():
    async def go():
        hold = FirstTokenHold()
        joining = asyncio.ensure_future(_joined(hold, clean=True))
        waiting = asyncio.ensure_future(hold.wait(joining))
        await joining
        await asyncio.sleep(0.01)
        assert not waiting.done(), "released before the decode node admitted the request"
        hold.end("admitted")
        await waiting
        return hold.reason
    assert _run(go()) == "admitted"


def test_an_admission_before_the_submit_returns_releases_at_once():
    async def go():
        hold = FirstTokenHold()
        never = asyncio.get_running_loop().create_future()
        hold.end("admitted")
        hold.end("a token came first")   # the first reason stays
        await hold.wait(never)
        never.cancel()
        return hold.reason
    assert _run(go()) == "admitted"


@pytest.mark.parametrize("clean, fail", [(False, False), (True, True)])
def test_a_join_without_a_clean_pull_or_a_failed_one_releases_when_it_ends(clean, fail):
    async def go():
        hold = FirstTokenHold()
        joining = asyncio.ensure_future(_joined(hold, clean=clean, fail=fail))
        await hold.wait(joining)
        assert hold.over and joining.done()
        return hold.reason
    assert _run(go()) == "joined without a clean pull"
