"""A thread that drives an LLMEngine: commands in, step deltas out.

Every engine mutation runs on this one thread, between steps, so the
engine needs no locks. Callers (an asyncio frontend, a Ray actor) submit
callables with `call(fn)` and get a concurrent Future; `on_deltas` receives
each step's deltas (all requests of the step at once) on the loop thread, and
before the step's forward the `admitted` deltas of hand-offs it takes in.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, TypeVar

from engine.llm_engine import LLMEngine
from engine.outputs import StepDelta
from engine.step_trace import StepRecord, StepTrace

log = logging.getLogger("pdserve.engine_loop")
T = TypeVar("T")


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_deltas: Callable[[list[StepDelta]], None],
                 idle_callback: Callable[[LLMEngine], None] | None = None, idle_interval: float = 1.0,
                 name: str = "engine-loop", step_trace: StepTrace | None = None) -> None:
        self.engine = engine
        self.step_trace = step_trace
        self._last_end = 0.0
        if step_trace is not None:
            engine.record_step_shapes = True
        self._on_deltas = on_deltas
        self._idle_callback = idle_callback
        self._idle_interval = idle_interval
        self._commands: deque[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future]] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.steps = 0
        self.error: BaseException | None = None
        # published after every step / command batch, readable from any thread without
        # waiting for a long step: the latest stats and the KV events not yet taken
        self._pub_lock = threading.Lock()
        self._latest_stats = engine.stats()
        self._events: deque = deque(maxlen=1 << 16)   # a lagging reader sees an event-id gap and resyncs

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def call(self, fn: Callable[[LLMEngine], T]) -> "concurrent.futures.Future[T]":
        """Run `fn(engine)` on the loop thread before the next step."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping or self.error is not None:
            fut.set_exception(RuntimeError("the engine loop is stopped"))
            return fut
        self._commands.append((fn, fut))
        self._wake.set()
        return fut

    def snapshot(self):
        """(latest EngineStats, KV events since the last call); never blocks on a step."""
        with self._pub_lock:
            events = list(self._events)
            self._events.clear()
            return self._latest_stats, events

    def _publish(self) -> None:
        stats, events = self.engine.stats(), self.engine.drain_kv_events()
        with self._pub_lock:
            self._latest_stats = stats
            self._events.extend(events)

    def _run_commands(self) -> None:
        while self._commands:
            fn, fut = self._commands.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # the caller gets it; the loop goes on
                fut.set_exception(e)

    def _step(self) -> bool:
        """One engine step and its outputs; True if it computed tokens."""
        trace = self.step_trace
        if trace is not None:
            t_unix, p0, c0 = time.time(), time.perf_counter(), time.thread_time()
        deltas = self.engine.step(self._on_deltas)   # admissions go out before the step's forward
        if trace is not None:
            p1, c1 = time.perf_counter(), time.thread_time()
        self.steps += 1
        if deltas:
            self._on_deltas(deltas)
        did_work = self.engine.last_step_tokens > 0
        shape = self.engine.last_step_shape      # set whenever the step scheduled tokens
        if trace is not None and did_work and shape is not None:
            p2 = time.perf_counter()
            gap = p0 - self._last_end if self._last_end else 0.0
            trace.append(StepRecord(t_unix, p1 - p0, c1 - c0, p2 - p1, gap, shape))
            self._last_end = p2
        return did_work

    def _run(self) -> None:
        try:
            while not self._stopping:
                had_commands = bool(self._commands)
                self._run_commands()
                if had_commands:      # requests just added count in the stats while the next step runs
                    self._publish()
                did_work = False
                if self.engine.has_unfinished():
                    did_work = self._step()
                if did_work:
                    self._publish()
                if not did_work and not self._commands:
                    if not self._wake.wait(self._idle_interval if not self.engine.has_unfinished() else 0.002):
                        if self._idle_callback is not None and not self.engine.has_unfinished():
                            self._idle_callback(self.engine)
                    self._wake.clear()
        except BaseException as e:  # a bug in the engine: fail every pending caller loudly
            log.exception("engine loop crashed")
            self.error = e
            while self._commands:
                _, fut = self._commands.popleft()
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError(f"engine loop crashed: {e!r}"))
