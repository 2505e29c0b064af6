"""Sampler: greedy, seeds, truncation (top-k/top-p/min-p), penalties, logprobs."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.sampler import TOP_P_CANDIDATES, Sampler, SamplingState, apply_penalties, truncate
from engine.sampling_params import SamplingParams

V = 64


def state(**kw) -> SamplingState:
    prompt = kw.pop("prompt", [1, 2, 3])
    output = kw.pop("output", None)
    return SamplingState.create(SamplingParams(**kw), prompt, output)


def rand_logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def sampler(seed: int = 1234) -> Sampler:
    return Sampler(torch.Generator().manual_seed(seed))


def log_probs(probs: list[float], vocab: int = V) -> torch.Tensor:
    """Logits whose softmax is ``probs`` on the first ids and ~0 elsewhere."""
    row = torch.full((vocab,), -1e4)
    row[: len(probs)] = torch.log(torch.tensor(probs))
    return row


def draw(row: torch.Tensor, n: int, **kw) -> Counter:
    """Sample ``n`` times from ``row`` in one batch of unseeded states."""
    out = sampler().sample(row.expand(n, -1).clone(), [state(**kw) for _ in range(n)])
    return Counter(out.token_ids)


# ---------------------------------------------------------------- greedy
def test_greedy_is_argmax_and_fast_path_has_no_logprobs():
    logits = rand_logits(8)
    out = sampler().sample(logits, [state(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_tie_takes_first_index_like_transformers():
    logits = torch.zeros(1, V)
    logits[0, [7, 3, 40]] = 5.0
    assert sampler().sample(logits, [state(temperature=0.0)]).token_ids == [3]


def test_greedy_rows_unaffected_by_random_rows_in_batch():
    logits = rand_logits(6)
    states = [state(temperature=0.0) if i % 2 == 0 else state(temperature=1.5, top_p=0.9) for i in range(6)]
    out = sampler().sample(logits, states)
    assert [out.token_ids[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(-1).tolist()


def test_greedy_matches_transformers_generate(tiny_llama_dir):
    from tiny_models import hf_greedy, load_hf_model

    model = load_hf_model(tiny_llama_dir)
    prompt = [5, 17, 42, 9, 100]
    expected = hf_greedy(model, prompt, 8)
    ids, s, smp = list(prompt), state(temperature=0.0, prompt=prompt), sampler()
    with torch.no_grad():
        for _ in range(8):
            logits = model(torch.tensor([ids])).logits[:, -1, :]
            tok = smp.sample(logits, [s]).token_ids[0]
            ids.append(tok)
            s.output_token_ids.append(tok)
    assert ids[len(prompt):] == expected


# ---------------------------------------------------------------- seeds
def run_seeded(seed: int, steps: int, companions: list[SamplingState], position: int) -> list[int]:
    """Sample ``steps`` tokens for a seeded request placed among companions."""
    target = state(seed=seed, temperature=1.0, top_k=20, prompt=[1])
    smp, toks = sampler(seed=999 + len(companions)), []
    for step in range(steps):
        states = companions[:position] + [target] + companions[position:]
        logits = rand_logits(len(states), seed=10_000 + step * 7 + len(states))
        logits[position] = rand_logits(1, seed=step)[0]   # the target's logits depend only on the step
        tok = smp.sample(logits, states).token_ids[position]
        toks.append(tok)
        target.output_token_ids.append(tok)
    return toks


def test_seed_reproduces_tokens_whatever_the_batch():
    alone = run_seeded(7, 30, [], 0)
    crowd = [state(temperature=0.8), state(temperature=0.0), state(seed=8, top_p=0.5),
             state(temperature=1.3, min_p=0.1, repetition_penalty=1.2, logprobs=3)]
    assert run_seeded(7, 30, crowd, 2) == alone
    assert run_seeded(7, 30, crowd[:1], 1) == alone


def test_different_seeds_differ_and_unseeded_draws_vary():
    a, b = run_seeded(7, 30, [], 0), run_seeded(8, 30, [], 0)
    assert a != b
    logits = torch.zeros(200, V)  # uniform: unseeded rows must not all agree
    assert len(set(sampler().sample(logits, [state() for _ in range(200)]).token_ids)) > 20


def test_n_samples_of_a_seeded_prompt_differ_but_reproduce():
    params, logits = SamplingParams(seed=3, n=2), torch.zeros(2, 1000)

    def two_samples() -> list[tuple[int, ...]]:
        states = [SamplingState.create(params, [1], sample_index=i) for i in range(2)]
        smp = sampler()
        steps = [smp.sample(logits, states).token_ids for _ in range(6)]
        return list(zip(*steps))

    first = two_samples()
    assert first == two_samples() and first[0] != first[1]


# ---------------------------------------------------------------- truncation
def test_top_k_support_is_exactly_the_k_highest():
    row = torch.linspace(0, 3, V)[torch.randperm(V, generator=torch.Generator().manual_seed(3))]
    counts = draw(row, 3000, top_k=5)
    assert set(counts) == set(row.topk(5).indices.tolist())


def test_top_k_alone_keeps_k_ids_even_when_one_holds_all_the_mass():
    logits = torch.zeros(1, V)
    logits[0, 9] = 40.0   # softmax rounds to exactly 1.0 for id 9
    out = truncate(logits, [state(top_k=3)])
    assert int(torch.isfinite(out).sum()) == 3


def test_top_k_varies_per_row_in_one_batch():
    row = torch.linspace(0, 1, V)
    states = [state(top_k=2) for _ in range(500)] + [state(top_k=6) for _ in range(500)]
    toks = sampler().sample(row.expand(1000, -1).clone(), states).token_ids
    assert set(toks[:500]) == {V - 1, V - 2}
    assert set(toks[500:]) == set(range(V - 6, V))


def test_top_p_restricts_to_nucleus_with_renormalised_frequencies():
    row = log_probs([0.4, 0.3, 0.2, 0.1])
    n = 6000
    counts = draw(row, n, top_p=0.75)
    assert set(counts) == {0, 1, 2}   # 0.4 + 0.3 < 0.75, so id 2 is in, id 3 is out
    for tok, p in ((0, 0.4 / 0.9), (1, 0.3 / 0.9), (2, 0.2 / 0.9)):
        assert abs(counts[tok] / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_top_p_always_keeps_the_most_likely_token():
    assert set(draw(log_probs([0.9, 0.1]), 500, top_p=0.05)) == {0}


def reference_support(row: torch.Tensor, k: int, p: float) -> set[int]:
    """Plain per-row top-k then top-p (renormalised over the top-k), by full sort."""
    order = row.argsort(descending=True).tolist()
    if k:
        order = order[:k]
    if p >= 1.0:
        return set(order)
    probs = torch.softmax(row[order].double(), -1).tolist()
    kept, mass = [], 0.0
    for tok, pr in zip(order, probs):
        if kept and mass >= p:
            break
        kept.append(tok)
        mass += pr
    return set(kept)


@pytest.mark.parametrize("scale, k, p", [
    (8.0, 0, 0.9),      # peaked: the nucleus is among the first candidates
    (0.3, 0, 0.9),      # flat: the nucleus is far wider than the candidates -> full sort
    (0.3, 0, 0.999),
    (2.0, 100, 0.5),    # top-k then top-p inside it
    (0.3, 1000, 0.95),  # top-k wider than the candidate window
    (1.0, 7, 1.0),
])
def test_top_k_top_p_support_matches_full_sort_reference(scale, k, p):
    vocab = 4 * TOP_P_CANDIDATES + 17
    logits = rand_logits(4, seed=int(scale * 10) + k, vocab=vocab) * scale
    states = [state(top_k=k, top_p=p) for _ in range(4)]
    out = truncate(logits, states)
    for r in range(4):
        got = set(torch.isfinite(out[r]).nonzero().squeeze(1).tolist())
        assert got == reference_support(logits[r], k, p)
    if scale == 0.3 and k == 0:
        assert len(got) > TOP_P_CANDIDATES   # really exercised the fallback


def test_mixed_truncation_rows_in_one_batch_match_their_own_reference():
    vocab = 2 * TOP_P_CANDIDATES
    logits = rand_logits(4, seed=5, vocab=vocab) * torch.tensor([[8.0], [0.3], [2.0], [1.0]])
    cfg = [(0, 0.8), (0, 0.95), (300, 0.9), (3, 1.0)]
    out = truncate(logits, [state(top_k=k, top_p=p) for k, p in cfg])
    for r, (k, p) in enumerate(cfg):
        assert set(torch.isfinite(out[r]).nonzero().squeeze(1).tolist()) == reference_support(logits[r], k, p)


def test_min_p_drops_tokens_below_fraction_of_max():
    counts = draw(log_probs([0.5, 0.3, 0.15, 0.05]), 4000, min_p=0.2)   # threshold 0.1
    assert set(counts) == {0, 1, 2}


def test_temperature_sharpens_the_distribution():
    row = log_probs([0.5, 0.3, 0.2])
    n, t = 6000, 0.5
    counts = draw(row, n, temperature=t)
    expected = torch.softmax(row / t, -1)
    for tok in range(3):
        p = float(expected[tok])
        assert abs(counts[tok] / n - p) < 4 * math.sqrt(p * (1 - p) / n)


# ---------------------------------------------------------------- penalties
def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    s = state(prompt=[0, 5], output=[1, 3, 3], repetition_penalty=2.0, frequency_penalty=0.5,
              presence_penalty=0.25)
    got = apply_penalties(logits, [s])[0].tolist()
    # id0: prompt, positive -> 2/2; id1: output x1, negative -> -1*2 - 0.5 - 0.25;
    # id3: output x2 -> 3/2 - 2*0.5 - 0.25; id5: prompt only -> 1/2 (no freq/presence);
    expected = [1.0, -2.75, 0.5, 0.25, -2.0, 0.5]
    assert got == pytest.approx(expected)


def test_penalties_change_greedy_choice_and_track_live_output_list():
    logits = torch.tensor([[0.0, 0.0, 2.0, 2.5]])
    out: list[int] = []
    s = state(temperature=0.0, prompt=[0], output=out, presence_penalty=1.0)
    smp = sampler()
    assert smp.sample(logits, [s]).token_ids == [3]
    out.append(3)            # the engine appends to the request's own list
    assert smp.sample(logits, [s]).token_ids == [2]   # 2.5 - 1.0 < 2.0


def test_repetition_penalty_is_applied_to_prompt_tokens():
    logits = torch.tensor([[3.0, 2.0]])
    s = state(temperature=0.0, prompt=[0], repetition_penalty=2.0)
    assert sampler().sample(logits, [s]).token_ids == [1]


# ---------------------------------------------------------------- logprobs
def test_logprobs_are_raw_log_softmax_with_top_k_alternatives():
    logits = rand_logits(3)
    states = [state(temperature=0.0, logprobs=3), state(temperature=0.7, logprobs=0, repetition_penalty=1.5),
              state(temperature=0.0)]
    out = sampler().sample(logits, states)
    ref = torch.log_softmax(logits, -1)
    lp0, lp1, lp2 = out.logprobs
    assert lp2 is None
    assert lp0.token_id == out.token_ids[0]
    assert lp0.logprob == pytest.approx(float(ref[0, out.token_ids[0]]))
    top_vals, top_ids = ref[0].topk(3)
    assert [t for t, _ in lp0.top] == top_ids.tolist()
    assert [v for _, v in lp0.top] == pytest.approx(top_vals.tolist())
    assert lp1.top == () and lp1.logprob == pytest.approx(float(ref[1, out.token_ids[1]]))


# ---------------------------------------------------------------- bad input
def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="one row per state"):
        sampler().sample(torch.zeros(2, V), [state()])
    with pytest.raises(ValueError, match="one row per state"):
        sampler().sample(torch.zeros(V), [state()])
    with pytest.raises(ValueError, match=f"token id {V + 5} is outside"):
        sampler().sample(torch.zeros(1, V), [state(output=[V + 5], frequency_penalty=1.0)])
