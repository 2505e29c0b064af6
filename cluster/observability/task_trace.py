"""Where an asyncio task waits: the chain of awaits from its coroutine down to the
innermost awaitable, for log lines about streams that stopped moving.

    describe_task(task) -> "Generate:87 -> _generate:120 -> _write:104 -> ... -> Future"
"""
from __future__ import annotations

import asyncio


def await_chain(obj, depth: int = 24) -> list[str]:
    """`function:line` of each coroutine / async generator frame in the await chain of
    `obj`, then the type of whatever the innermost one awaits (a Future, a grpc op ...)."""
    out: list[str] = []
    while obj is not None and depth > 0:
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None) or getattr(obj, "gi_frame", None)
        out.append(f"{frame.f_code.co_name}:{frame.f_lineno}" if frame is not None else type(obj).__name__)
        obj = getattr(obj, "cr_await", None) or getattr(obj, "ag_await", None) or getattr(obj, "gi_yieldfrom", None)
        depth -= 1
    return out


def describe_task(task: asyncio.Task | None) -> str:
    if task is None:
        return "(no task)"
    if task.done():
        return f"{task.get_name()}: done"
    return f"{task.get_name()}: " + " -> ".join(await_chain(task.get_coro()))
