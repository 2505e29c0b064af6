"""Logits -> next tokens for a whole batch in one vectorised pass.

Per row, in this order (the transformers order for the warpers):
1. repetition penalty (HF: positive logits / p, negative * p, over prompt +
   output tokens), then frequency and presence penalties (OpenAI: minus
   ``f * count + p * (count > 0)`` over output tokens);
2. greedy rows (temperature < 1e-5): argmax, the first index on ties, as
   transformers does;
3. random rows: temperature, top-k, top-p (renormalised within the top-k
   survivors), min-p (see :func:`truncate`), then one inverse-CDF draw: a
   single uniform number per row. A seeded request draws it from its own
   ``torch.Generator``, so its tokens do not depend on what else is in the
   batch; the others share the engine's generator.

Logprobs are ``log_softmax`` of the *raw* logits, before penalties,
temperature and truncation (vLLM v1's default "raw_logprobs"): the model's
own belief, comparable across requests whatever their sampling settings.
An all-greedy batch without penalties or logprobs is a bare argmax.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams

GREEDY_EPS = 1e-5            # temperatures below this are treated as greedy
TOP_P_CANDIDATES = 256       # top-p looks for its nucleus among these first
_NEG_INF = float("-inf")


@dataclass
class SamplingState:
    """What the sampler needs to know about one sequence. ``output_token_ids``
    may be the request's live list: token counts update lazily from it."""
    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    _counts: dict[int, int] = field(default_factory=dict, repr=False)
    _num_counted: int = field(default=0, repr=False)
    _prompt_unique: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids: Sequence[int] = (),
               output_token_ids: list[int] | None = None, device: torch.device | str = "cpu",
               sample_index: int = 0) -> SamplingState:
        """``sample_index`` (0..n-1) offsets the seed, as vLLM does, so the n
        samples of one seeded prompt differ yet each is reproducible."""
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed + sample_index)
        return cls(params, prompt_token_ids, output_token_ids if output_token_ids is not None else [], gen)

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    def output_counts(self) -> dict[int, int]:
        """Occurrences of each output token id (updated from the live list)."""
        for t in self.output_token_ids[self._num_counted:]:
            self._counts[t] = self._counts.get(t, 0) + 1
        self._num_counted = len(self.output_token_ids)
        return self._counts

    def seen_token_ids(self, device: torch.device) -> torch.Tensor:
        """Unique ids of prompt + output (what the repetition penalty touches)."""
        if self._prompt_unique is None or self._prompt_unique.device != device:
            self._prompt_unique = torch.unique(torch.as_tensor(list(self.prompt_token_ids), dtype=torch.long,
                                                               device=device))
        out = torch.as_tensor(list(self.output_counts()), dtype=torch.long, device=device)
        return torch.unique(torch.cat([self._prompt_unique, out]))


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        """``generator`` draws for requests without a seed (default: a fresh
        one seeded from torch's default RNG on first use)."""
        self._generator = generator

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [num_seqs, vocab] with one row per state: got shape "
                             f"{tuple(logits.shape)} for {len(states)} states")
        if not states:
            return SamplerOutput([], [])
        logits = logits.float()
        pen_rows = [i for i, s in enumerate(states) if s.has_penalties]
        lp_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if not pen_rows and not lp_rows and all(s.greedy for s in states):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(states))  # fast path
        raw = logits
        if pen_rows:
            logits = logits.clone()
            logits[pen_rows] = apply_penalties(logits[pen_rows], [states[i] for i in pen_rows])
        tokens = logits.argmax(dim=-1)
        rand_rows = [i for i, s in enumerate(states) if not s.greedy]
        if rand_rows:
            rand_states = [states[i] for i in rand_rows]
            probs = torch.softmax(truncate(logits[rand_rows], rand_states), dim=-1)
            tokens[rand_rows] = _draw(probs, self._uniforms(rand_states, probs.device))
        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(states)
        if lp_rows:
            _fill_logprobs(raw, token_list, states, lp_rows, logprobs)
        return SamplerOutput(token_list, logprobs)

    def _uniforms(self, states: Sequence[SamplingState], device: torch.device) -> torch.Tensor:
        """One U[0, 1) float64 per row: seeded rows from their own generator."""
        u = torch.empty(len(states), dtype=torch.float64, device=device)
        shared = [i for i, s in enumerate(states) if s.generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), dtype=torch.float64, device=device,
                                   generator=self._engine_generator(device))
        for i, s in enumerate(states):  # per-request generators: unavoidable loop
            if s.generator is not None:
                u[i] = torch.rand(1, dtype=torch.float64, device=device, generator=s.generator)[0]
        return u

    def _engine_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        return self._generator


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first id whose cumulative mass exceeds u * total."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).clamp_(max=probs.shape[1] - 1)
    # float rounding at the very top of the CDF must never pick a masked id
    bad = probs.gather(1, idx) == 0
    return torch.where(bad, probs.argmax(dim=-1, keepdim=True), idx).squeeze(1)


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Penalised copy of ``logits`` [len(states), V] (repetition, then frequency
    and presence). Touches only the ids each sequence has seen."""
    logits, vocab, dev = logits.clone(), logits.shape[1], logits.device
    rep_r, rep_c, rep_p, out_r, out_c, out_v = [], [], [], [], [], []
    for r, s in enumerate(states):
        p = s.params
        if p.repetition_penalty != 1.0:
            seen = s.seen_token_ids(dev)
            rep_r.append(torch.full_like(seen, r))
            rep_c.append(seen)
            rep_p.append(torch.full(seen.shape, p.repetition_penalty, device=dev))
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            counts = s.output_counts()
            if counts:
                c = torch.tensor(list(counts.values()), dtype=torch.float32, device=dev)
                out_r.append(torch.full(c.shape, r, dtype=torch.long, device=dev))
                out_c.append(torch.tensor(list(counts), dtype=torch.long, device=dev))
                out_v.append(p.frequency_penalty * c + p.presence_penalty)
    if rep_r:
        rows, cols, pen = torch.cat(rep_r), _check_ids(torch.cat(rep_c), vocab), torch.cat(rep_p)
        v = logits[rows, cols]
        logits[rows, cols] = torch.where(v > 0, v / pen, v * pen)
    if out_r:
        rows, cols = torch.cat(out_r), _check_ids(torch.cat(out_c), vocab)
        logits[rows, cols] -= torch.cat(out_v)   # (row, id) pairs are unique: no accumulation needed
    return logits


def truncate(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; removed ids become -inf."""
    dev, vocab = logits.device, logits.shape[1]
    temps = torch.tensor([s.params.temperature for s in states], dtype=torch.float32, device=dev)
    logits = logits / temps.unsqueeze(1)
    ks = [s.params.top_k if 0 < s.params.top_k < vocab else 0 for s in states]
    rows = [i for i, s in enumerate(states) if ks[i] or s.params.top_p < 1.0]
    if rows:
        logits[rows] = _top_k_top_p(logits[rows], [ks[i] for i in rows], [states[i].params.top_p for i in rows])
    m_rows = [i for i, s in enumerate(states) if s.params.min_p > 0.0]
    if m_rows:
        sub = logits[m_rows]
        probs = torch.softmax(sub, dim=-1)
        min_p = torch.tensor([states[i].params.min_p for i in m_rows], device=dev).unsqueeze(1)
        logits[m_rows] = sub.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, _NEG_INF)
    return logits


def _top_k_top_p(logits: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Keep each row's top-k (k = 0: all), then the smallest most-likely set
    whose mass (renormalised over the top-k) reaches top_p. The nucleus is
    searched among the top candidates first, sorting the whole row only when
    the candidates cannot hold it."""
    dev, vocab = logits.device, logits.shape[1]
    width = max([k for k in ks if k] + ([min(vocab, TOP_P_CANDIDATES)] if not all(ks) else []))
    vals, idx = logits.topk(width, dim=-1)
    n_cand = torch.tensor([k or width for k in ks], device=dev).unsqueeze(1)
    keep = torch.arange(width, device=dev).unsqueeze(0) < n_cand
    has_k = torch.tensor([k > 0 for k in ks], device=dev).unsqueeze(1)
    p = torch.tensor([pp if pp < 1.0 else float("inf") for pp in ps], device=dev).unsqueeze(1)
    cand = vals.masked_fill(~keep, _NEG_INF)
    norm = torch.where(has_k, cand.logsumexp(-1, keepdim=True), logits.logsumexp(-1, keepdim=True))
    probs = (cand - norm).exp()
    keep &= (probs.cumsum(-1) - probs) < p     # drop once the mass before an id reaches top_p
    keep[:, 0] = True                          # the most likely id always stays
    out = torch.full_like(logits, _NEG_INF).scatter_(1, idx, vals.masked_fill(~keep, _NEG_INF))
    overflow = (~has_k & (probs.sum(-1, keepdim=True) < p)).squeeze(1) if width < vocab else None
    if overflow is not None and bool(overflow.any()):
        rows = overflow.nonzero().squeeze(1)
        out[rows] = _top_p_full(logits[rows], p[rows])
    return out


def _top_p_full(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= p
    drop[:, 0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), _NEG_INF)


def _fill_logprobs(raw: torch.Tensor, tokens: list[int], states: Sequence[SamplingState],
                   rows: list[int], out: list[TokenLogprob | None]) -> None:
    lp = torch.log_softmax(raw[rows], dim=-1)
    chosen_list = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=raw.device)).squeeze(1).tolist()
    max_k = max(states[i].params.logprobs or 0 for i in rows)
    top_vals = top_idx = []
    if max_k:
        v, ix = lp.topk(max_k, dim=-1)
        top_vals, top_idx = v.tolist(), ix.tolist()
    for j, i in enumerate(rows):
        k = states[i].params.logprobs or 0
        top = tuple(zip(top_idx[j][:k], top_vals[j][:k])) if k else ()
        out[i] = TokenLogprob(tokens[i], chosen_list[j], top)


def _check_ids(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise ValueError(f"token id {bad} is outside the logits' vocabulary of {vocab_size}; "
                         "validate token ids against the tokenizer before sampling")
    return ids
