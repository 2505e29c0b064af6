"""How long a simulated engine step or KV transfer takes.

One interface (`CostModel`), one implementation filled from interpolation
tables (`TableCostModel`, loaded from JSON; see docs/simulator.md for the
format). Tables hold *whole-step* seconds of pure steps:

- ``prefill[new_tokens][cached_tokens]``: a step that only prefills
  ``new_tokens`` prompt tokens whose sequences already hold ``cached_tokens``
  of context (token-weighted mean over the chunks of the step);
- ``decode[batch_size][context_tokens]``: a step of ``batch_size`` decodes
  whose contexts add up to ``context_tokens``;
- a mixed step costs ``prefill + decode - step_overhead_s`` (the fixed part
  is paid once);
- a transfer costs ``fixed_s + per_descriptor_s * runs + bytes / bandwidth``.

Interpolation is bilinear on each table's grid and linear beyond its edges
(never below zero).

A measured profile may also carry a step fit (`step_fit.StepFit`: per-step
overhead + per-sequence + per-token + attention terms, fitted to the
measurements) and a mode: ``table`` (interpolate as above), ``fit`` (the fit
alone, for every step shape: pure, mixed, multi-sequence) or ``fit+residual``
(the fit plus the bilinearly interpolated table-minus-fit residual, exact at
the grid points).
"""
from __future__ import annotations

import abc
import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from cluster.tools.sim.step_fit import StepFeatures, StepFit
from engine.scheduler_output import SchedulerOutput
from engine.step_trace import StepShape

FIT_MODES = ("table", "fit", "fit+residual")


class Table2D:
    """Bilinear interpolation of ``values[i][j]`` at (xs[i], ys[j]); linear
    extrapolation outside the grid, clamped at 0."""

    def __init__(self, name: str, xs: Sequence[float], ys: Sequence[float],
                 values: Sequence[Sequence[float]], signed: bool = False) -> None:
        self.name = name
        self.floor = -np.inf if signed else 0.0
        self.xs, self.ys = [float(x) for x in xs], [float(y) for y in ys]
        self.v = np.asarray(values, dtype=float)
        self._grid = np.asarray(self.ys)
        self._span = np.diff(self._grid)
        self._rows: dict[float, tuple[np.ndarray, np.ndarray]] = {}    # along_y's row per x (few: batch sizes)
        if self.v.shape != (len(self.xs), len(self.ys)):
            raise ValueError(f"table {name!r}: values must be {len(self.xs)} rows x {len(self.ys)} "
                             f"columns (one row per first-axis point), got shape {self.v.shape}")
        for axis, pts in (("first", self.xs), ("second", self.ys)):
            if not pts or any(b <= a for a, b in zip(pts, pts[1:])):
                raise ValueError(f"table {name!r}: {axis} axis must be non-empty and strictly "
                                 f"increasing, got {pts}")
        if (not signed and np.any(self.v < 0)) or not np.all(np.isfinite(self.v)):
            raise ValueError(f"table {name!r}: seconds must be finite and >= 0")

    @staticmethod
    def _bracket(pts: list[float], x: float) -> tuple[int, float]:
        """Index i of the segment [pts[i], pts[i+1]] used for x and the weight of pts[i+1]."""
        if len(pts) == 1:
            return 0, 0.0
        i = min(max(bisect.bisect_right(pts, x) - 1, 0), len(pts) - 2)
        return i, (x - pts[i]) / (pts[i + 1] - pts[i])

    def __call__(self, x: float, y: float) -> float:
        i, wx = self._bracket(self.xs, x)
        j, wy = self._bracket(self.ys, y)
        v = self.v
        i1 = min(i + 1, len(self.xs) - 1)
        j1 = min(j + 1, len(self.ys) - 1)
        a = v[i, j] + (v[i, j1] - v[i, j]) * wy
        b = v[i1, j] + (v[i1, j1] - v[i1, j]) * wy
        return max(self.floor, float(a + (b - a) * wx))

    def along_y(self, x: float, ys: np.ndarray) -> np.ndarray:
        """Values at fixed x for many y (vectorised; same rule as __call__)."""
        row = self._rows.get(x)
        if row is None:
            i, wx = self._bracket(self.xs, x)
            i1 = min(i + 1, len(self.xs) - 1)
            r = self.v[i] + (self.v[i1] - self.v[i]) * wx
            # per segment j of the y grid: the value's and y's rise across it (a run asks per batch size)
            if len(self._rows) >= 4096:
                self._rows.clear()
            row = self._rows[x] = (r, np.diff(r))
        r, rise = row
        grid = self._grid
        if not len(rise):
            return np.maximum(np.full(ys.shape, r[0]), self.floor)
        j = np.searchsorted(grid, ys, side="right") - 1
        np.minimum(j, len(grid) - 2, out=j)
        np.maximum(j, 0, out=j)
        out = r[j] + rise[j] * ((ys - grid[j]) / self._span[j])
        return np.maximum(out, self.floor, out=out)

    def to_json(self, x_name: str, y_name: str) -> dict:
        return {x_name: self.xs, y_name: self.ys, "seconds": self.v.tolist()}


@dataclass(frozen=True)
class TransferCost:
    fixed_s: float
    per_descriptor_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if self.fixed_s < 0 or self.per_descriptor_s < 0 or self.bandwidth_bytes_per_s <= 0:
            raise ValueError("transfer: fixed_s and per_descriptor_s must be >= 0 and "
                             "bandwidth_bytes_per_s > 0 (bytes per second)")

    def seconds(self, descriptors: int, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return self.fixed_s + self.per_descriptor_s * descriptors + nbytes / self.bandwidth_bytes_per_s


class CostModel(abc.ABC):
    """What the simulator asks of a node's hardware."""
    kv_bytes_per_token: int
    kv_capacity_tokens: int

    @abc.abstractmethod
    def step_seconds(self, sched: SchedulerOutput) -> float:
        """Duration of one engine step running ``sched`` (before it is applied)."""

    @abc.abstractmethod
    def decode_run(self, batch: int, context0: int, steps: int, max_context0: int | None = None) -> np.ndarray:
        """Durations of ``steps`` consecutive pure-decode steps of ``batch``
        sequences whose contexts add up to ``context0`` in the first step
        (each step adds ``batch``); ``max_context0``: the longest of them."""

    @abc.abstractmethod
    def transfer_seconds(self, descriptors: int, nbytes: int) -> float: ...


class TableCostModel(CostModel):
    def __init__(self, name: str, prefill: Table2D, decode: Table2D, step_overhead_s: float,
                 transfer: TransferCost, kv_bytes_per_token: int, kv_capacity_tokens: int,
                 meta: dict | None = None, fit: StepFit | None = None, fit_mode: str = "fit") -> None:
        if step_overhead_s < 0 or kv_bytes_per_token <= 0 or kv_capacity_tokens <= 0:
            raise ValueError("step_overhead_s must be >= 0, kv_bytes_per_token and "
                             "kv_capacity_tokens > 0")
        if fit_mode not in FIT_MODES:
            raise ValueError(f"fit mode must be one of {FIT_MODES}, got {fit_mode!r}")
        self.name = name
        self.prefill, self.decode = prefill, decode
        self.step_fit = fit                       # kept (and saved) whatever the mode
        self.fit = None if fit_mode == "table" else fit
        self.fit_mode = fit_mode if fit is not None else "table"
        self._p_res = self._d_res = None
        if self.fit is not None and fit_mode == "fit+residual":
            self._p_res = Table2D("prefill residual", prefill.xs, prefill.ys,
                                  [[v - fit.seconds(StepFeatures.prefill([(int(n), int(c))], fit.block_size))
                                    for c, v in zip(prefill.ys, row)] for n, row in zip(prefill.xs, prefill.v)],
                                  signed=True)
            self._d_res = Table2D("decode residual", decode.xs, decode.ys,
                                  [[v - fit.seconds(StepFeatures.decode(int(b), int(x), fit.block_size))
                                    for x, v in zip(decode.ys, row)] for b, row in zip(decode.xs, decode.v)],
                                  signed=True)
        self.step_overhead_s = step_overhead_s
        self.transfer = transfer
        self.kv_bytes_per_token = kv_bytes_per_token
        self.kv_capacity_tokens = kv_capacity_tokens
        self.meta = dict(meta or {})

    def pure_prefill(self, new_tokens: int, cached_tokens: float) -> float:
        if self.fit is None:
            return self.prefill(new_tokens, cached_tokens)
        t = self.fit.seconds(StepFeatures.prefill([(new_tokens, int(cached_tokens))], self.fit.block_size))
        return max(0.0, t + self._p_res(new_tokens, cached_tokens)) if self._p_res else t

    def pure_decode(self, batch: int, context_tokens: int) -> float:
        if self.fit is None:
            return self.decode(batch, context_tokens)
        t = self.fit.seconds(StepFeatures.decode(batch, context_tokens, self.fit.block_size))
        return max(0.0, t + self._d_res(batch, context_tokens)) if self._d_res else t

    def step_seconds(self, sched: SchedulerOutput) -> float:
        shape = StepShape.of(sched)
        p_new, p_ctx, d_n, d_ctx = _step_sums(shape)
        if self.fit is not None:
            t = self.fit.seconds(StepFeatures.from_shape(shape, self.fit.block_size))
            if self._p_res is not None:
                t += (self._p_res(p_new, p_ctx / p_new) if p_new else 0.0) + \
                    (self._d_res(d_n, d_ctx) if d_n else 0.0)
            return max(0.0, t)
        if p_new and d_n:
            return (self.prefill(p_new, p_ctx / p_new) + self.decode(d_n, d_ctx)
                    - self.step_overhead_s)
        if p_new:
            return self.prefill(p_new, p_ctx / p_new)
        return self.decode(d_n, d_ctx) if d_n else 0.0

    def decode_run(self, batch: int, context0: int, steps: int, max_context0: int | None = None) -> np.ndarray:
        ctx = context0 + batch * np.arange(steps, dtype=float)
        if self.fit is None:
            return self.decode.along_y(batch, ctx)
        longest = (max_context0 if max_context0 is not None else context0 / batch) + np.arange(steps, dtype=float)
        t = self.fit.decode_run(batch, longest)
        return np.maximum(t + self._d_res.along_y(batch, ctx), 0.0) if self._d_res else t

    def transfer_seconds(self, descriptors: int, nbytes: int) -> float:
        return self.transfer.seconds(descriptors, nbytes)

    # ---- file format -----------------------------------------------------
    def to_json(self) -> dict:
        return {"name": self.name, "format": "pdserve-sim-cost/1", **self.meta,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_capacity_tokens": self.kv_capacity_tokens,
                "step_overhead_s": self.step_overhead_s,
                "prefill": self.prefill.to_json("new_tokens", "cached_tokens"),
                "decode": self.decode.to_json("batch_size", "context_tokens"),
                "transfer": {"fixed_s": self.transfer.fixed_s,
                             "per_descriptor_s": self.transfer.per_descriptor_s,
                             "bandwidth_bytes_per_s": self.transfer.bandwidth_bytes_per_s},
                **({"fit": {**self.step_fit.to_json(), "mode": self.fit_mode}} if self.step_fit else {})}

    @classmethod
    def from_json(cls, data: dict) -> "TableCostModel":
        missing = [k for k in ("name", "kv_bytes_per_token", "kv_capacity_tokens", "step_overhead_s",
                               "prefill", "decode", "transfer") if k not in data]
        if missing:
            raise ValueError(f"cost profile lacks {missing}: see docs/simulator.md, 'Cost-model "
                             "file format'")
        p, d = data["prefill"], data["decode"]
        meta = {k: v for k, v in data.items() if k in ("source", "description", "hardware", "model",
                                                       "scheduler", "block_size")}
        fit = StepFit.from_json(data["fit"]) if "fit" in data else None
        return cls(data["name"], Table2D("prefill", p["new_tokens"], p["cached_tokens"], p["seconds"]),
                   Table2D("decode", d["batch_size"], d["context_tokens"], d["seconds"]),
                   float(data["step_overhead_s"]), TransferCost(**data["transfer"]),
                   int(data["kv_bytes_per_token"]), int(data["kv_capacity_tokens"]), meta,
                   fit, data["fit"].get("mode", "fit") if fit is not None else "fit")

    def with_mode(self, fit_mode: str) -> "TableCostModel":
        """The same profile predicting by ``fit_mode`` ("table", "fit" or "fit+residual")."""
        if fit_mode != "table" and self.step_fit is None:
            raise ValueError(f"profile {self.name!r} has no step fit: measure it again to use mode {fit_mode!r}")
        return TableCostModel(self.name, self.prefill, self.decode, self.step_overhead_s, self.transfer,
                              self.kv_bytes_per_token, self.kv_capacity_tokens, self.meta,
                              self.step_fit, fit_mode)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


class ScaledCost(CostModel):
    """Another cost model with every engine step ``factor x base + add_s`` long
    (transfers unchanged): e.g. a CPU profile measured in isolation, calibrated
    for what a real worker loses on a shared machine (CPU taken by its
    neighbours: ``factor``; per-step work outside ``LLMEngine.step()``: ``add_s``)."""

    def __init__(self, base: CostModel, factor: float, add_s: float = 0.0) -> None:
        if factor <= 0 or add_s < 0:
            raise ValueError(f"step scale factor must be > 0 and add_s >= 0 seconds, got {factor} and {add_s}")
        self.base, self.factor, self.add_s = base, factor, add_s
        self.name = f"{getattr(base, 'name', 'cost')} x{factor:g} +{add_s * 1e3:g}ms"
        self.kv_bytes_per_token = base.kv_bytes_per_token
        self.kv_capacity_tokens = base.kv_capacity_tokens

    def step_seconds(self, sched: SchedulerOutput) -> float:
        return self.factor * self.base.step_seconds(sched) + self.add_s

    def decode_run(self, batch: int, context0: int, steps: int, max_context0: int | None = None) -> np.ndarray:
        return self.factor * self.base.decode_run(batch, context0, steps, max_context0) + self.add_s

    def transfer_seconds(self, descriptors: int, nbytes: int) -> float:
        return self.base.transfer_seconds(descriptors, nbytes)


def _step_sums(shape: StepShape) -> tuple[int, int, int, int]:
    """(prefill tokens, sum of new x cached over prefill chunks, decodes, decode context)."""
    return (sum(n for n, _ in shape.chunks), sum(n * c for n, c in shape.chunks),
            len(shape.decode_ctx), sum(shape.decode_ctx))


PROFILE_DIR = Path(__file__).parent / "profiles"


def load_cost_model(name_or_path: str) -> TableCostModel:
    """A profile by file path or by name in cluster/tools/sim/profiles/ (``h100``, ...)."""
    path = Path(name_or_path)
    if not path.exists():
        path = PROFILE_DIR / f"{name_or_path}.json"
    if not path.exists():
        names = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
        raise ValueError(f"no cost profile {name_or_path!r}: give a JSON file path or one of {names}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"cost profile {path} is not valid JSON: {e}") from None
    return TableCostModel.from_json(data)


def prefill_alone_s(pure_prefill, chunk: int, prompt: int, cached: int) -> float:
    """Seconds a prompt's prefill takes on an idle node: its uncached tokens in
    chunks of ``chunk``, each attending to what came before."""
    t, done = 0.0, max(0, cached)
    while done < prompt:
        n = min(chunk, prompt - done)
        t += pure_prefill(n, done)
        done += n
    return t
