"""Host interference measured inside running workers.

A cost profile (`cluster.sim.measure`) times engine steps alone on an idle
core. In a real cluster several workers may share a host's cores with each
other and with the frontend, Ray and the transfer threads, and then a step
takes longer than its isolated cost: it waits for a core (wall > CPU time),
and it runs slower on a core whose caches and sibling hyperthread another
worker is using (CPU time > the isolated cost). On this 2-core validation
host a decode step measured at 14 ms alone took 30 ms while a prefill ran
beside it, and 16 ms when nothing else ran.

`Interference` is that effect as a table: for a node of a given role running
a step of a given kind (prefill, decode or mixed) while ``k`` other nodes of
the same host are busy, its step takes ``factor`` x the profile's cost. It
is fitted from the workers' own step traces (`engine/step_trace.py`, read
with each worker's ``step_trace`` method) of one real run: each recorded
step's wall time (its outputs handed on included) over the profile's
prediction for the same step shape, grouped by how many other workers were
mid-step when it began. The simulator applies it with the same definition
(`ClusterSim` counts the other busy nodes when a node starts a step), so a
run at another load, with other contention, is a prediction, not a replay.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Mapping, Sequence

import numpy as np

from cluster.sim.cost_model import CostModel
from cluster.sim.step_fit import nnls
from engine.step_trace import StepRecord, StepShape

KINDS = ("prefill", "decode", "mixed")
MIN_SAMPLES = 5          # fewer steps in a (role, kind, k) cell: borrow the nearest k with enough


def step_kind(shape: StepShape) -> str:
    if shape.chunks and shape.decode_ctx:
        return "mixed"
    return "prefill" if shape.chunks else "decode"


def shape_sched(shape: StepShape) -> SimpleNamespace:
    """A stand-in for the `SchedulerOutput` of a step of this shape (the fields
    `CostModel.step_seconds` reads)."""
    seqs = [SimpleNamespace(num_new_tokens=n, request=SimpleNamespace(num_computed_tokens=c, num_prompt_tokens=c + n))
            for n, c in shape.chunks]
    seqs += [SimpleNamespace(num_new_tokens=1, request=SimpleNamespace(num_computed_tokens=x - 1, num_prompt_tokens=x - 1))
             for x in shape.decode_ctx]
    return SimpleNamespace(seqs=seqs)


@dataclass(frozen=True)
class Interference:
    """``factors[role][kind][k]``: a step's duration over its isolated cost when
    ``k`` other nodes on the host are busy (k beyond the table: its last entry)."""
    factors: Mapping[str, Mapping[str, Sequence[float]]]
    samples: Mapping[str, Mapping[str, Sequence[int]]] = field(default_factory=dict)
    frontend: FrontendCost | None = None      # the frontend's work, counted as a party when busy

    def __post_init__(self) -> None:
        for role, kinds in self.factors.items():
            for kind, row in kinds.items():
                if kind not in KINDS:
                    raise ValueError(f"interference: step kind must be one of {KINDS}, got {kind!r} for {role!r}")
                if not row or any(not (f > 0) for f in row):
                    raise ValueError(f"interference: factors for {role}/{kind} must be a non-empty list of "
                                     f"positive numbers, got {list(row)}")

    def factor(self, role: str, kind: str, others_busy: int) -> float:
        kinds = self.factors.get(role)
        if not kinds:
            return 1.0
        row = kinds.get(kind) or kinds.get("decode") or next(iter(kinds.values()))
        return float(row[min(others_busy, len(row) - 1)])

    def to_json(self) -> dict:
        return {"format": "pdserve-sim-interference/1",
                "factors": {r: {k: list(v) for k, v in ks.items()} for r, ks in self.factors.items()},
                "samples": {r: {k: list(v) for k, v in ks.items()} for r, ks in self.samples.items()},
                "frontend": self.frontend.to_json() if self.frontend else None}

    @classmethod
    def from_json(cls, data: dict) -> "Interference":
        if data.get("format") != "pdserve-sim-interference/1":
            raise ValueError("interference: expected format 'pdserve-sim-interference/1' "
                             "(written by Interference.to_json)")
        return cls({r: {k: tuple(float(x) for x in v) for k, v in ks.items()} for r, ks in data["factors"].items()},
                   {r: {k: tuple(int(x) for x in v) for k, v in ks.items()}
                    for r, ks in data.get("samples", {}).items()},
                   FrontendCost.from_json(data["frontend"]) if data.get("frontend") else None)


@dataclass(frozen=True)
class FrontendCost:
    """CPU seconds the frontend process (gRPC server, router, Ray client; and on
    the validation host the load client too) spends per request arriving and
    per token streamed. The simulator runs it as one FIFO server: it is busy
    while that work is queued, and then counts as one more busy party on the
    host."""
    arrival_s: float
    token_s: float

    def __post_init__(self) -> None:
        if not (self.arrival_s >= 0 and self.token_s >= 0):
            raise ValueError(f"frontend cost: arrival_s and token_s must be >= 0 seconds, got {self}")

    def to_json(self) -> dict:
        return {"arrival_s": self.arrival_s, "token_s": self.token_s}

    @classmethod
    def from_json(cls, d: dict) -> "FrontendCost":
        return cls(float(d["arrival_s"]), float(d["token_s"]))


def fit_frontend(runs: Sequence[tuple[Sequence[Sequence[float]], Sequence[float], Sequence[float]]],
                 window_s: float = 0.25) -> FrontendCost:
    """Fit from runs of (CPU samples ``[time, process CPU seconds]``, arrival times,
    token times): CPU per window = idle + arrival_s x arrivals + token_s x tokens
    (non-negative least squares over every window)."""
    rows, ys = [], []
    for samples, arrivals, tokens in runs:
        if len(samples) < 2:
            continue
        arr, tok = sorted(arrivals), sorted(tokens)
        i = 0
        while i + 1 < len(samples):
            j = i + 1
            while j + 1 < len(samples) and samples[j][0] - samples[i][0] < window_s:
                j += 1
            a, b = samples[i][0], samples[j][0]
            rows.append([b - a, bisect.bisect_left(arr, b) - bisect.bisect_left(arr, a),
                         bisect.bisect_left(tok, b) - bisect.bisect_left(tok, a)])
            ys.append(samples[j][1] - samples[i][1])
            i = j
    if len(rows) < 3:
        raise ValueError("frontend cost: need CPU samples covering at least 3 windows")
    coef = nnls(np.asarray(rows, dtype=float), np.asarray(ys, dtype=float))
    return FrontendCost(float(coef[1]), float(coef[2]))


def frontend_spans(cost: FrontendCost, arrivals: Sequence[float], tokens: Sequence[float]) -> list[tuple[float, float]]:
    """When a FIFO frontend with these costs is busy (merged intervals)."""
    work = sorted([(t, cost.arrival_s) for t in arrivals] + [(t, cost.token_s) for t in tokens])
    spans: list[list[float]] = []
    for t, w in work:
        if w <= 0:
            continue
        if spans and spans[-1][1] >= t:
            spans[-1][1] += w
        else:
            spans.append([t, t + w])
    return [(a, b) for a, b in spans]


def others_busy(traces: Mapping[str, Sequence[StepRecord]],
                extra: Mapping[str, Sequence[tuple[float, float]]] | None = None) -> dict[str, list[int]]:
    """For every recorded step, how many other parties (nodes, and the busy
    spans in ``extra``, e.g. the frontend's) were busy when it began."""
    spans = {n: sorted((r.start_unix, r.start_unix + r.wall_s + r.emit_s) for r in recs)
             for n, recs in traces.items()}
    spans.update({n: sorted(v) for n, v in (extra or {}).items()})
    starts = {n: [a for a, _ in s] for n, s in spans.items()}
    out: dict[str, list[int]] = {}
    for n, recs in traces.items():
        ks = []
        for r in recs:
            t, k = r.start_unix, 0
            for o in spans:
                if o == n:
                    continue
                i = bisect.bisect_right(starts[o], t) - 1
                k += i >= 0 and spans[o][i][1] > t
            ks.append(k)
        out[n] = ks
    return out


def fit_interference(runs: Sequence[Mapping[str, Sequence[StepRecord]]], roles: Mapping[str, str],
                     cost: CostModel, frontend: FrontendCost | None = None,
                     frontend_work: Sequence[tuple[Sequence[float], Sequence[float]]] = ()) -> Interference:
    """Fit the table from the step traces of real runs (each: node id -> its
    records; ``roles``: node id -> role) against ``cost``, the profile the
    simulator will use. With ``frontend`` (and, per run, its (arrival times,
    token times) in ``frontend_work``), the frontend's busy spans count as one
    more party, as they will in the simulator."""
    if not runs or not any(recs for traces in runs for recs in traces.values()):
        raise ValueError("interference: no step records; run the workers with step_trace_size > 0")
    missing = sorted({n for traces in runs for n in traces} - set(roles))
    if missing:
        raise ValueError(f"interference: no role for nodes {missing}; give every traced node its role")
    if frontend is not None and len(frontend_work) != len(runs):
        raise ValueError("interference: give the frontend's (arrivals, tokens) for every run")
    sums: dict[tuple[str, str, int], list[float]] = {}
    for i, traces in enumerate(runs):
        extra = {"frontend": frontend_spans(frontend, *frontend_work[i])} if frontend is not None else None
        _accumulate(traces, roles, cost, sums, extra)
    return replace(_table(sums), frontend=frontend)


def _accumulate(traces: Mapping[str, Sequence[StepRecord]], roles: Mapping[str, str], cost: CostModel,
                sums: dict[tuple[str, str, int], list[float]], extra) -> None:
    ks = others_busy(traces, extra)
    for n, recs in traces.items():
        for r, k in zip(recs, ks[n]):
            pred = cost.step_seconds(shape_sched(r.shape))
            if pred <= 0:
                continue
            acc = sums.setdefault((roles[n], step_kind(r.shape), k), [0.0, 0.0, 0])
            acc[0] += r.wall_s + r.emit_s
            acc[1] += pred
            acc[2] += 1


def _table(sums: dict[tuple[str, str, int], list[float]]) -> Interference:
    factors: dict[str, dict[str, tuple[float, ...]]] = {}
    samples: dict[str, dict[str, tuple[int, ...]]] = {}
    for role in sorted({key[0] for key in sums}):
        for kind in KINDS:
            cells = {k: v for (r, kd, k), v in sums.items() if r == role and kd == kind}
            if not cells:
                continue
            top = max(cells)
            good = sorted(k for k, v in cells.items() if v[2] >= MIN_SAMPLES) or sorted(cells)
            row, counts = [], []
            for k in range(top + 1):
                src = k if k in cells and cells[k][2] >= MIN_SAMPLES else min(good, key=lambda g: (abs(g - k), g))
                real, pred, _ = cells[src]
                row.append(real / pred)
                counts.append(cells[k][2] if k in cells else 0)
            factors.setdefault(role, {})[kind] = tuple(row)
            samples.setdefault(role, {})[kind] = tuple(counts)
    return Interference(factors, samples)
