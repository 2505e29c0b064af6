"""A fitted, linear-in-parameters model of one engine step's duration.

A step's seconds are a non-negative combination of what the step does:

==================  ==========================================================
term                value for one scheduled step
==================  ==========================================================
``step``            1 (the fixed per-step overhead: schedule, batch, launch)
``prefill_seq``     prompts that prefill (a chunk) in the step
``decode_seq``      sequences that decode one token in the step
``token``           tokens computed in the step (prefill chunks + decodes)
``fresh_attn``      new^2 when the step's only prefill is one uncached prompt
                    (causal attention on its own K/V)
``prefill_attn``    otherwise prompts x longest chunk x longest context,
                    padded to blocks (the padded-batch attention)
``prefill_kv``      prompts x longest context, padded (cached K/V gathered)
``decode_kv``       decodes x longest decode context, padded (K/V gathered)
``mixed``           1 when prefill and decode paths both run
==================  ==========================================================

The shapes mirror the CPU attention backend (engine/attention/torch_paged.py).
`StepFit.fit` finds the coefficients from measured steps by non-negative
least squares on the *relative* error (each sample weighted by 1 / its
seconds), so millisecond steps count as much as second-long ones. The same
features describe pure prefill, pure decode and mixed steps, so a mixed step
pays the fixed overhead once and multi-sequence prefills pay their
per-sequence cost.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Sequence

import numpy as np

from engine.scheduler_output import SchedulerOutput
from engine.step_trace import StepShape

TERMS = ("step", "prefill_seq", "decode_seq", "token", "fresh_attn", "prefill_attn", "prefill_kv",
         "decode_kv", "mixed")


def _padded(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) * block_size


@dataclass(frozen=True, slots=True)
class StepFeatures:
    prefill_seqs: int = 0
    decode_seqs: int = 0
    tokens: int = 0
    fresh_attn: float = 0.0      # one prompt, nothing cached: causal attention, new^2
    prefill_attn: float = 0.0    # padded batch: prompts x longest chunk x longest context (blocks)
    prefill_kv: float = 0.0      # padded batch: prompts x longest context (blocks) gathered
    decode_kv: float = 0.0       # decodes x longest decode context (blocks) gathered and attended
    mixed: int = 0               # prefill and decode paths both run

    def vector(self) -> np.ndarray:
        return np.array([1.0, self.prefill_seqs, self.decode_seqs, self.tokens, self.fresh_attn,
                         self.prefill_attn, self.prefill_kv, self.decode_kv, self.mixed], dtype=float)

    @classmethod
    def build(cls, chunks: Sequence[tuple[int, int]], decode_ctx: Sequence[int], block_size: int) -> "StepFeatures":
        """A step prefilling ``(new, cached)`` chunks and decoding sequences whose
        contexts (prompt + output so far, the new token included) are ``decode_ctx``.

        Mirrors engine/attention/torch_paged.py: one fresh prompt runs causal
        attention on its own K/V; otherwise prefills run as a padded batch over
        the longest context; decodes gather up to the longest decode context."""
        p, d = len(chunks), len(decode_ctx)
        fresh = attn = pkv = dkv = 0.0
        if p == 1 and chunks[0][1] == 0:
            fresh = float(chunks[0][0]) ** 2
        elif p:
            kv = _padded(max(n + c for n, c in chunks), block_size)
            attn, pkv = p * max(n for n, _ in chunks) * kv, p * kv
        if d:
            dkv = d * _padded(max(decode_ctx), block_size)
        return cls(p, d, sum(n for n, _ in chunks) + d, fresh, attn, pkv, dkv, int(p > 0 and d > 0))

    @classmethod
    def prefill(cls, chunks: Sequence[tuple[int, int]], block_size: int) -> "StepFeatures":
        """A pure prefill step of ``(new, cached)`` chunks."""
        return cls.build(chunks, (), block_size)

    @classmethod
    def decode(cls, batch: int, context_tokens: int, block_size: int) -> "StepFeatures":
        """A pure decode step of ``batch`` equal sequences whose contexts add up to ``context_tokens``."""
        return cls.build((), [max(1, context_tokens // batch)] * batch, block_size)

    @classmethod
    def of(cls, sched: SchedulerOutput, block_size: int) -> "StepFeatures":
        """The features of a step the scheduler formed (before it runs)."""
        return cls.from_shape(StepShape.of(sched), block_size)

    @classmethod
    def from_shape(cls, shape: StepShape, block_size: int) -> "StepFeatures":
        return cls.build(shape.chunks, shape.decode_ctx, block_size)


def shape_sched(shape: StepShape) -> SimpleNamespace:
    """A stand-in for the `SchedulerOutput` of a step of this shape (the fields
    `CostModel.step_seconds` reads): for timed or traced steps."""
    def seq(new: int, computed: int, prompt: int) -> SimpleNamespace:
        return SimpleNamespace(num_new_tokens=new,
                               request=SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt))
    return SimpleNamespace(seqs=[seq(n, c, c + n) for n, c in shape.chunks] +
                           [seq(1, x - 1, x - 1) for x in shape.decode_ctx])


@dataclass(frozen=True)
class StepFit:
    coef: tuple[float, ...]
    block_size: int = 16

    def __post_init__(self) -> None:
        if len(self.coef) != len(TERMS):
            raise ValueError(f"step fit: need {len(TERMS)} coefficients ({', '.join(TERMS)}), got {len(self.coef)}")
        if self.block_size < 1:
            raise ValueError(f"step fit: block_size must be >= 1, got {self.block_size}")
        if any(not np.isfinite(c) or c < 0 for c in self.coef):
            raise ValueError(f"step fit: coefficients must be finite and >= 0, got {self.coef}")

    def seconds(self, f: StepFeatures) -> float:
        return float(np.dot(self.coef, f.vector()))

    def decode_run(self, batch: int, max_ctx: np.ndarray) -> np.ndarray:
        """Pure decode steps of ``batch`` sequences whose longest context is each of
        ``max_ctx`` (vectorised)."""
        c = self.coef
        kv = np.ceil(max_ctx / self.block_size) * self.block_size
        return c[0] + (c[2] + c[3]) * batch + c[7] * batch * kv

    @classmethod
    def fit(cls, features: Sequence[StepFeatures], seconds: Sequence[float], block_size: int) -> "StepFit":
        if len(features) != len(seconds) or len(features) < len(TERMS):
            raise ValueError(f"step fit: need as many step timings as features and at least {len(TERMS)}, "
                             f"got {len(features)} features and {len(seconds)} timings")
        y = np.asarray(seconds, dtype=float)
        if np.any(y <= 0):
            raise ValueError("step fit: every measured step must take > 0 seconds")
        a = np.stack([f.vector() for f in features]) / y[:, None]
        return cls(tuple(float(x) for x in nnls(a, np.ones_like(y))), block_size)

    def to_json(self) -> dict:
        return {"terms": list(TERMS), "coef": list(self.coef), "block_size": self.block_size}

    @classmethod
    def from_json(cls, data: dict) -> "StepFit":
        if list(data.get("terms", [])) != list(TERMS):
            raise ValueError(f"step fit: terms must be {list(TERMS)} in this order, got {data.get('terms')}")
        return cls(tuple(float(x) for x in data["coef"]), int(data.get("block_size", 16)))


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set; small problems)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    # scale columns so the tolerance means the same for every term
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        if passive.all() or np.max(np.where(passive, -np.inf, w)) <= 1e-10:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if np.all(z[passive] > 0):
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x / scale
