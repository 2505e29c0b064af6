"""Host interference measured inside running workers.

A cost profile (`cluster.tools.sim.measure`) times engine steps alone on an idle
core. In a real cluster several workers may share a host's cores with each
other and with the frontend, Ray and the transfer threads, and then a step
takes longer than its isolated cost: it waits for a core (wall > CPU time),
and it runs slower on a core whose caches and sibling hyperthread another
worker is using (CPU time > the isolated cost). On this 2-core validation
host a decode step measured at 14 ms alone took 30 ms while a prefill ran
beside it, and 16 ms when nothing else ran.

`Interference` is that effect as processor sharing: while ``k`` other
parties on the host are busy (worker nodes mid-step, and the frontend while
it has work queued), a step of a given kind (prefill, decode or mixed) on a
node of a given role runs at ``1 / factor[k]`` of its isolated speed. The
factors are fitted from the workers' own step traces (`engine/step_trace.py`,
read with each worker's ``step_trace`` method) of real runs: each step's
isolated cost (the profile's prediction for its shape) must equal the sum,
over the time it spent at each ``k``, of that time / ``factor[k]``. The
simulator applies the same rule (`SimNode.retime`: every step in flight is
re-timed when another party on the host starts or stops), so a run at
another load, with other contention, is a prediction, not a replay. The
frontend's work per arrival and per streamed token (`FrontendCost`) is fitted
from its process CPU time.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from cluster.tools.sim.cost_model import CostModel
from cluster.tools.sim.step_fit import nnls, shape_sched
from engine.step_trace import StepRecord, StepShape

KINDS = ("prefill", "decode", "mixed")
MIN_SAMPLES = 5          # fewer step-equivalents at some k: that k shares the nearest k's factor
JITTER_POINTS = 21       # quantiles (0, 5, ..., 100 %) kept of each step kind's residual ratio


def step_kind(shape: StepShape) -> str:
    if shape.chunks and shape.decode_ctx:
        return "mixed"
    return "prefill" if shape.chunks else "decode"


@dataclass(frozen=True)
class Interference:
    """``factors[role][kind][k]``: while ``k`` other parties on the host are
    busy, a step of this kind on a node of this role runs at ``1 / factor`` of
    its isolated speed (k beyond the table: its last entry)."""
    factors: Mapping[str, Mapping[str, Sequence[float]]]
    samples: Mapping[str, Mapping[str, Sequence[int]]] = field(default_factory=dict)
    frontend: FrontendCost | None = None      # the frontend's work, counted as a party when busy
    # jitter[role][kind]: evenly spaced quantiles (mean 1) of each real step's wall time over the
    # model's (isolated cost x factors over its k): the variation the factors do not explain
    # (time slices, cache misses). The simulator draws one per step; empty: none
    jitter: Mapping[str, Mapping[str, Sequence[float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for role, kinds in self.factors.items():
            for kind, row in kinds.items():
                if kind not in KINDS:
                    raise ValueError(f"interference: step kind must be one of {KINDS}, got {kind!r} for {role!r}")
                if not row or any(not (f > 0) for f in row):
                    raise ValueError(f"interference: factors for {role}/{kind} must be a non-empty list of "
                                     f"positive numbers, got {list(row)}")
        for role, kinds in self.jitter.items():
            for kind, row in kinds.items():
                if len(row) < 2 or any(not (q > 0) for q in row) or list(row) != sorted(row):
                    raise ValueError(f"interference: jitter for {role}/{kind} must be at least 2 positive "
                                     f"quantiles in increasing order, got {list(row)}")

    def jitter_at(self, role: str, kind: str, u: float) -> float:
        """The jitter quantile at ``u`` in [0, 1] (interpolated); 1 without a table."""
        row = self.jitter.get(role, {}).get(kind)
        if not row:
            return 1.0
        x = u * (len(row) - 1)
        i = min(int(x), len(row) - 2)
        return float(row[i] + (row[i + 1] - row[i]) * (x - i))

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
                "jitter": {r: {k: list(v) for k, v in ks.items()} for r, ks in self.jitter.items()},
                "frontend": self.frontend.to_json() if self.frontend else None}

    @classmethod
    def from_json(cls, data: dict) -> "Interference":
        if data.get("format") != "pdserve-sim-interference/1":
            raise ValueError("interference: expected format 'pdserve-sim-interference/1' "
                             "(written by Interference.to_json)")
        return cls({r: {k: tuple(float(x) for x in v) for k, v in ks.items()} for r, ks in data["factors"].items()},
                   {r: {k: tuple(int(x) for x in v) for k, v in ks.items()}
                    for r, ks in data.get("samples", {}).items()},
                   FrontendCost.from_json(data["frontend"]) if data.get("frontend") else None,
                   {r: {k: tuple(float(x) for x in v) for k, v in ks.items()}
                    for r, ks in data.get("jitter", {}).items()})


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


def occupancy(traces: Mapping[str, Sequence[StepRecord]],
              extra: Mapping[str, Sequence[tuple[float, float]]] | None = None) -> dict[str, list[np.ndarray]]:
    """For every recorded step, the fraction of its duration during which ``k``
    other parties (nodes, and the busy spans in ``extra``, e.g. the
    frontend's) were busy, for k = 0 .. number of other parties."""
    spans = {n: sorted((r.start_unix, r.start_unix + r.wall_s + r.emit_s) for r in recs)
             for n, recs in traces.items()}
    spans.update({n: sorted(v) for n, v in (extra or {}).items()})
    starts = {n: [a for a, _ in s] for n, s in spans.items()}
    parties = len(spans)
    out: dict[str, list[np.ndarray]] = {}
    for n, recs in traces.items():
        rows = []
        for r in recs:
            a, b = r.start_unix, r.start_unix + r.wall_s + r.emit_s
            edges = [(a, 0)]
            for o, sp in spans.items():
                if o == n:
                    continue
                i = max(bisect.bisect_right(starts[o], a) - 1, 0)
                while i < len(sp) and sp[i][0] < b:
                    x, y = max(sp[i][0], a), min(sp[i][1], b)
                    if y > x:
                        edges += [(x, 1), (y, -1)]
                    i += 1
            edges.sort()
            frac = np.zeros(parties)
            k, t = 0, a
            for x, d in edges:
                frac[k] += x - t
                k, t = k + d, x
            frac[k] += b - t
            rows.append(frac / (b - a) if b > a else np.eye(parties)[0])
        out[n] = rows
    return out


def fit_interference(runs: Sequence[Mapping[str, Sequence[StepRecord]]], roles: Mapping[str, str],
                     cost: CostModel, frontend: FrontendCost | None = None,
                     frontend_work: Sequence[tuple[Sequence[float], Sequence[float]]] = (),
                     by_load: bool = True, jitter: bool = False, monotone: bool = True) -> Interference:
    """Fit the table from the step traces of real runs (each: node id -> its
    records; ``roles``: node id -> role) against ``cost``, the profile the
    simulator will use. With ``frontend`` (and, per run, its (arrival times,
    token times) in ``frontend_work``), the frontend's busy spans count as one
    more party, as they will in the simulator.

    The model: while ``k`` others are busy a step runs at ``1 / factor[k]``
    of its isolated speed, so its wall time is about its isolated cost x the
    time-weighted mean of ``factor[k]`` over the step. The factors are fitted
    per role and step kind by non-negative least squares weighted by 1 /
    isolated cost (with one column this is total wall time / total isolated
    cost, so rare steps that waited long for a core count by their time, not
    by their ratio). ``monotone`` (the default) fits the increments from
    each k to the next, all non-negative, so no factor is below the one for
    fewer busy parties: with a few steps at some k, a free fit can otherwise
    say steps ran faster with more of the host busy (on the 2P+2D validation
    runs it gave 7.0x at k=3 and 1.75x at k=4), and the simulator would act on
    it. ``by_load=False`` fits one factor per role and step
    kind whatever the others do (the mean in-situ slowdown of the runs).
    ``jitter``: also keep the quantiles of each step's wall time over the
    model's, normalised to mean 1, so the simulator spreads step times as
    the real ones spread (kinds with at least MIN_SAMPLES steps). Off by
    default: on the validation host it fixed the low p90 ITL of 2P+2D but
    made 1P+1D's 18-38% too high (docs/simulator.md)."""
    _check_runs(runs, roles, frontend, frontend_work)
    rows, width = _step_rows(runs, roles, cost, frontend, frontend_work, by_load)
    factors: dict[str, dict[str, tuple[float, ...]]] = {}
    samples: dict[str, dict[str, tuple[int, ...]]] = {}
    jit: dict[str, dict[str, tuple[float, ...]]] = {}
    for (role, kind), got in sorted(rows.items()):
        fit = _fit_kind(got, width, monotone)
        factors.setdefault(role, {})[kind] = fit.factors
        samples.setdefault(role, {})[kind] = fit.samples
        if jitter and len(got) >= MIN_SAMPLES:
            jit.setdefault(role, {})[kind] = fit.jitter(got)
    return Interference(factors, samples, frontend, jit)


_Row = tuple[np.ndarray, float, float]      # (occupancy fractions, isolated cost, measured wall) of one step


def _check_runs(runs: Sequence[Mapping[str, Sequence[StepRecord]]], roles: Mapping[str, str],
                frontend: FrontendCost | None, frontend_work: Sequence[tuple[Sequence[float], Sequence[float]]]) -> None:
    if not runs or not any(recs for traces in runs for recs in traces.values()):
        raise ValueError("interference: no step records; run the workers with step_trace_size > 0")
    missing = sorted({n for traces in runs for n in traces} - set(roles))
    if missing:
        raise ValueError(f"interference: no role for nodes {missing}; give every traced node its role")
    if frontend is not None and len(frontend_work) != len(runs):
        raise ValueError("interference: give the frontend's (arrivals, tokens) for every run")


def _step_rows(runs: Sequence[Mapping[str, Sequence[StepRecord]]], roles: Mapping[str, str], cost: CostModel,
               frontend: FrontendCost | None, frontend_work: Sequence[tuple[Sequence[float], Sequence[float]]],
               by_load: bool) -> tuple[dict[tuple[str, str], list[_Row]], int]:
    """Every step with a positive isolated cost, by (role, step kind); and the
    widest occupancy vector (parties + 1)."""
    rows: dict[tuple[str, str], list[_Row]] = {}
    width = 0
    for i, traces in enumerate(runs):
        extra = {"frontend": frontend_spans(frontend, *frontend_work[i])} if frontend is not None else None
        occ = occupancy(traces, extra) if by_load else {n: [np.ones(1)] * len(recs) for n, recs in traces.items()}
        for n, recs in traces.items():
            for r, frac in zip(recs, occ[n]):
                pred = cost.step_seconds(shape_sched(r.shape))
                if pred > 0:
                    rows.setdefault((roles[n], step_kind(r.shape)), []).append((frac, pred, r.wall_s + r.emit_s))
                    width = max(width, len(frac))
    return rows, width


@dataclass(frozen=True)
class _KindFit:
    """One (role, step kind)'s fit: its factor and step count for k = 0 .. top."""
    factors: tuple[float, ...]
    samples: tuple[int, ...]
    merged: np.ndarray          # the weighted design matrix, columns merged onto well-sampled k
    f: np.ndarray               # the fitted factor per merged column

    def jitter(self, got: Sequence[_Row]) -> tuple[float, ...]:
        """Quantiles of wall time over the model's, normalised to mean 1."""
        model = self.merged @ self.f * np.sqrt([pred for _, pred, _ in got])     # isolated cost x mean factor
        ratio = np.array([wall for _, _, wall in got]) / model
        q = np.quantile(ratio / ratio.mean(), np.linspace(0, 1, JITTER_POINTS))
        return tuple(float(x) for x in np.maximum(q, 1e-3))


def _fit_kind(got: Sequence[_Row], width: int, monotone: bool) -> _KindFit:
    a = np.zeros((len(got), width))
    b = np.zeros(len(got))
    for j, (frac, pred, wall) in enumerate(got):
        a[j, :len(frac)] = frac * np.sqrt(pred)          # wall ~ pred x sum_k frac_k factor_k, weight 1 / pred
        b[j] = wall / np.sqrt(pred)
    # step-equivalents seen at each k (each step spreads 1 over the k it ran at)
    weight = sum(np.pad(frac, (0, width - len(frac))) for frac, _, _ in got)
    top = max((k for k in range(width) if weight[k] > 0), default=0)
    good = [k for k in range(top + 1) if weight[k] >= MIN_SAMPLES] or [int(np.argmax(weight))]
    near = [min(good, key=lambda g: (abs(g - k), g)) for k in range(top + 1)]
    merged = np.zeros((len(got), len(good)))
    for k in range(top + 1):
        merged[:, good.index(near[k])] += a[:, k]
    if monotone:
        # f_j = d_0 + ... + d_j with every d >= 0: a step never runs faster with more parties busy
        cum = np.cumsum(merged[:, ::-1], axis=1)[:, ::-1]
        f = np.cumsum(nnls(cum, b))
    else:
        f = nnls(merged, b)
    pos = f[f > 0]
    f = np.where(f > 0, f, pos.min() if len(pos) else 1.0)
    return _KindFit(tuple(float(f[good.index(near[k])]) for k in range(top + 1)),
                    tuple(int(round(weight[k])) for k in range(top + 1)), merged, f)
