"""A bounded record of the engine loop's steps: what each step computed and
how long it took, in wall time and in the loop thread's own CPU time.

Off by default (`EngineConfig.step_trace_size` = 0). When on, the engine
loop appends one `StepRecord` per step that computed tokens; a reader
(`AsyncEngine.step_trace()`, a worker's `step_trace` Ray method) takes the
records since its last read. The oldest records are dropped when the reader
lags (`StepTrace.dropped` counts them).

Uses: seeing where a worker's time goes under real load (a step's wall time
against its CPU time shows how long it waited for a core or the GIL; the
time between steps is the loop's own overhead), and fitting the fleet
simulator's cost model to steps measured inside running workers
(`cluster/tools/sim/insitu.py`).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass

from engine.scheduler_output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computed: prefill chunks ``(new tokens, tokens already
    computed)`` and the context of each decoding sequence (its new token
    included)."""
    chunks: tuple[tuple[int, int], ...]
    decode_ctx: tuple[int, ...]

    @classmethod
    def of(cls, sched: SchedulerOutput) -> "StepShape":
        """The shape of a step the scheduler formed, taken before it runs."""
        chunks, dctx = [], []
        for s in sched.seqs:
            n, c = s.num_new_tokens, s.request.num_computed_tokens
            if n == 1 and c >= s.request.num_prompt_tokens:
                dctx.append(c + 1)
            else:
                chunks.append((n, c))
        return cls(tuple(chunks), tuple(dctx))

    @property
    def tokens(self) -> int:
        return sum(n for n, _ in self.chunks) + len(self.decode_ctx)


@dataclass(frozen=True, slots=True)
class StepRecord:
    start_unix: float        # time.time() when the step began (comparable across processes on a host)
    wall_s: float            # LLMEngine.step(): schedule, model, sample, bookkeeping
    cpu_s: float             # the loop thread's CPU time in that step (wall - cpu = waiting for a core / the GIL)
    emit_s: float            # handing the step's outputs on (on_deltas)
    gap_s: float             # from the previous recorded step's end to this start: publishing
                             # stats, commands between steps, idle waits
    shape: StepShape

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = {"chunks": [list(c) for c in self.shape.chunks], "decode_ctx": list(self.shape.decode_ctx)}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "StepRecord":
        shape = StepShape(tuple((int(n), int(c)) for n, c in d["shape"]["chunks"]),
                          tuple(int(x) for x in d["shape"]["decode_ctx"]))
        return cls(float(d["start_unix"]), float(d["wall_s"]), float(d["cpu_s"]), float(d["emit_s"]),
                   float(d["gap_s"]), shape)


class StepTrace:
    """A ring of the latest ``size`` step records; written by the engine loop
    thread, read (and emptied) from any thread."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"step trace size must be >= 1 record, got {size}")
        self._records: deque[StepRecord] = deque(maxlen=size)
        self._lock = threading.Lock()
        self.recorded = 0
        self.dropped = 0

    def append(self, rec: StepRecord) -> None:
        with self._lock:
            if len(self._records) == self._records.maxlen:
                self.dropped += 1
            self._records.append(rec)
            self.recorded += 1

    def drain(self) -> list[StepRecord]:
        with self._lock:
            out = list(self._records)
            self._records.clear()
            return out
