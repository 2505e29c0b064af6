"""Logits -> next tokens for a whole batch in one vectorised pass.

Per row, in this order (the transformers order for the warpers):
1. repetition penalty (HF: positive logits / p, negative * p, over prompt +
   output tokens), then frequency and presence penalties (OpenAI: minus
   ``f * count + p * (count > 0)`` over output tokens);
2. greedy rows (temperature < 1e-5): argmax, the first index on ties, as
   transformers does;
3. random rows: temperature, top-k, top-p, min-p, then one draw with the
   exponential race (argmax of probs / Exp(1) noise). A seeded request draws
   its noise from its own ``torch.Generator``, so its tokens do not depend on
   what else is in the batch; the others share the engine's generator.

Logprobs are ``log_softmax`` of the *raw* logits, before penalties,
temperature and truncation (vLLM v1's default "raw_logprobs"): the model's
own belief, comparable across requests whatever their sampling settings.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams

GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy


@dataclass
class SamplingState:
    """What the sampler needs to know about one sequence. ``output_token_ids``
    may be the request's live list: token counts update lazily from it."""
    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    _counts: torch.Tensor | None = field(default=None, repr=False)
    _num_counted: int = field(default=0, repr=False)
    _prompt_mask: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids: Sequence[int] = (),
               output_token_ids: list[int] | None = None, device: torch.device | str = "cpu") -> SamplingState:
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed)
        return cls(params, prompt_token_ids, output_token_ids if output_token_ids is not None else [], gen)

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    def output_counts(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """Occurrences of each token id in the output so far, float32 [V]."""
        if self._counts is None or self._counts.shape[0] != vocab_size or self._counts.device != device:
            self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self._num_counted = 0
        new = self.output_token_ids[self._num_counted:]
        if new:
            ids = _ids_tensor(new, vocab_size, device, "output")
            self._counts.index_add_(0, ids, torch.ones(len(new), dtype=torch.float32, device=device))
            self._num_counted += len(new)
        return self._counts

    def prompt_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """Which token ids occur in the prompt, bool [V]."""
        m = self._prompt_mask
        if m is None or m.shape[0] != vocab_size or m.device != device:
            m = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if len(self.prompt_token_ids):
                m[_ids_tensor(self.prompt_token_ids, vocab_size, device, "prompt")] = True
            self._prompt_mask = m
        return m


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
        want_lp = [s.params.logprobs is not None for s in states]
        pen_rows = [i for i, s in enumerate(states) if s.has_penalties]
        if not pen_rows and not any(want_lp) and all(s.greedy for s in states):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(states))  # fast path

        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        if pen_rows:
            logits = logits.clone()
            logits[pen_rows] = apply_penalties(logits[pen_rows], [states[i] for i in pen_rows])
        tokens = logits.argmax(dim=-1)
        rand_rows = [i for i, s in enumerate(states) if not s.greedy]
        if rand_rows:
            tokens[rand_rows] = self._sample_random(logits[rand_rows], [states[i] for i in rand_rows])
        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(states)
        if raw_logprobs is not None:
            _fill_logprobs(raw_logprobs, token_list, states, logprobs)
        return SamplerOutput(token_list, logprobs)

    def _sample_random(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        probs = torch.softmax(_truncate(logits, states), dim=-1)
        noise = torch.empty_like(probs)
        shared = [i for i, s in enumerate(states) if s.generator is None]
        if shared:
            noise[shared] = torch.empty((len(shared), probs.shape[1]), dtype=probs.dtype,
                                        device=probs.device).exponential_(generator=self._engine_generator(probs.device))
        for i, s in enumerate(states):  # per-request generators: unavoidable loop
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # never 0/0 on a masked token
        return (probs / noise).argmax(dim=-1)

    def _engine_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        return self._generator


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Penalised copy of ``logits`` [len(states), V] (repetition, then frequency and presence)."""
    vocab, dev = logits.shape[1], logits.device
    counts = torch.stack([s.output_counts(vocab, dev) for s in states])
    rep = torch.tensor([s.params.repetition_penalty for s in states], device=dev).unsqueeze(1)
    freq = torch.tensor([s.params.frequency_penalty for s in states], device=dev).unsqueeze(1)
    pres = torch.tensor([s.params.presence_penalty for s in states], device=dev).unsqueeze(1)
    seen = torch.stack([s.prompt_mask(vocab, dev) for s in states]) | (counts > 0)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def _truncate(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p: masked logits become -inf."""
    dev, vocab = logits.device, logits.shape[1]
    temps = torch.tensor([s.params.temperature for s in states], dtype=torch.float32, device=dev)
    logits = logits / temps.unsqueeze(1)
    ks = [min(s.params.top_k, vocab) if s.params.top_k > 0 else vocab for s in states]
    if any(k < vocab for k in ks):
        k_t = torch.tensor(ks, device=dev).unsqueeze(1)
        top_vals, top_idx = logits.topk(max(ks), dim=-1)
        keep = torch.arange(top_idx.shape[1], device=dev).unsqueeze(0) < k_t
        masked = torch.full_like(logits, float("-inf"))
        masked.scatter_(1, top_idx, torch.where(keep, top_vals, float("-inf")))
        full_rows = (k_t.squeeze(1) >= vocab)
        logits = torch.where(full_rows.unsqueeze(1), logits, masked)
    p_rows = [i for i, s in enumerate(states) if s.params.top_p < 1.0]
    if p_rows:
        logits[p_rows] = _top_p(logits[p_rows], [states[i].params.top_p for i in p_rows])
    m_rows = [i for i, s in enumerate(states) if s.params.min_p > 0.0]
    if m_rows:
        sub = logits[m_rows]
        probs = torch.softmax(sub, dim=-1)
        min_p = torch.tensor([states[i].params.min_p for i in m_rows], device=dev).unsqueeze(1)
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        logits[m_rows] = sub.masked_fill(probs < threshold, float("-inf"))
    return logits


def _top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p
    (the most likely token always stays)."""
    p = torch.tensor(top_ps, dtype=torch.float32, device=logits.device).unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # drop a token when the mass strictly before it already reaches top_p
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _fill_logprobs(raw: torch.Tensor, tokens: list[int], states: Sequence[SamplingState],
                   out: list[TokenLogprob | None]) -> None:
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    chosen = raw[rows, [tokens[i] for i in rows]].tolist()
    max_k = max(states[i].params.logprobs or 0 for i in rows)
    top_vals = top_idx = None
    if max_k:
        top_vals, top_idx = (t.tolist() for t in raw[rows].topk(max_k, dim=-1))
    for j, i in enumerate(rows):
        k = states[i].params.logprobs or 0
        top = tuple(zip(top_idx[j][:k], top_vals[j][:k])) if k else ()
        out[i] = TokenLogprob(tokens[i], chosen[j], top)


def _ids_tensor(ids: Sequence[int], vocab_size: int, device: torch.device, what: str) -> torch.Tensor:
    t = torch.as_tensor(list(ids), dtype=torch.long, device=device)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        bad = next(int(x) for x in ids if not 0 <= int(x) < vocab_size)
        raise ValueError(f"{what} token id {bad} is outside the logits' vocabulary of {vocab_size}; "
                         "validate token ids against the tokenizer before sampling")
    return t
