"""Sampler statistics: top-k/top-p restrict, seeds reproduce, RAS swaps only in its window."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import TOPK_MAX, SamplingParams, SlotSampling, exponential_noise, sample


def _draws(logits, n, *, temperature=1.0, top_p=1.0, top_k=TOPK_MAX, seed0=0):
    B = n
    lg = logits.expand(B, -1)
    seeds = torch.arange(seed0, seed0 + B)
    return sample(lg, torch.full((B,), temperature), torch.full((B,), top_p),
                  torch.full((B,), top_k), seeds, torch.zeros(B, dtype=torch.long), 1)


def test_candidates_match_full_vocabulary_rule():
    """Drawing over the TOPK_MAX best equals the reference rule over the whole row (sort,
    top-p on the un-tempered softmax, top-k, temperature, argmax(p / E)) with the same E."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4097, generator=g) * 3
    B, V = logits.shape
    temp, top_p, top_k = torch.full((B,), 0.8), torch.full((B,), 0.8), torch.full((B,), 30)
    seeds, steps = torch.arange(B), torch.full((B,), 7)
    got = sample(logits, temp, top_p, top_k, seeds, steps, 3)
    srt, order = torch.sort(logits, dim=-1, descending=True)
    remove = torch.softmax(srt, -1).cumsum(-1) > top_p[:, None]
    remove[:, 0] = False
    remove |= torch.arange(V)[None] >= top_k[:, None]
    mask = torch.empty_like(remove).scatter_(1, order, remove)
    probs = torch.softmax(logits.masked_fill(mask, float("-inf")) / 0.8, -1)
    want = torch.argmax(probs / exponential_noise(seeds, steps, 3, V), -1)
    assert torch.equal(got, want)


def test_top_k_restricts():
    logits = torch.linspace(0, 1, 50)[None]
    d = _draws(logits, 4000, top_k=5)
    assert set(d.tolist()) == {45, 46, 47, 48, 49}
    big = torch.linspace(0, 1, 4097)[None]  # candidates are cut to TOPK_MAX before top_k
    assert set(_draws(big, 2000, top_k=3).tolist()) == {4094, 4095, 4096}


def test_top_p_restricts_on_untempered_logits():
    # probabilities 0.5, 0.3, 0.2 (then ~0); cumulative 0.5, 0.8, 1.0. The reference removes
    # entries whose cumulative probability exceeds top_p (keeping the best): 0.85 keeps {0, 1}.
    # The mask is computed before the temperature, so a high temperature must not widen it.
    p = torch.tensor([0.5, 0.3, 0.2, 1e-9])
    d = _draws(p.log()[None], 4000, top_p=0.85, temperature=3.0)
    assert set(d.tolist()) == {0, 1}
    d = _draws(p.log()[None], 500, top_p=0.7, temperature=3.0)
    assert set(d.tolist()) == {0}


def test_distribution_matches_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    d = _draws(logits, 20000, temperature=0.7)
    freq = torch.bincount(d, minlength=4).float() / d.numel()
    want = torch.softmax(logits[0] / 0.7, dim=0)
    assert torch.allclose(freq, want, atol=0.015)


def test_seeds_reproduce_and_are_batch_independent():
    logits = torch.randn(1, 300)
    a = _draws(logits, 64, seed0=100)
    b = _draws(logits, 64, seed0=100)
    assert torch.equal(a, b)
    # row i's draw depends only on its own seed, not on who else is in the batch
    c = _draws(logits, 8, seed0=104)
    assert torch.equal(a[4:12], c)
    assert len(set(a.tolist())) > 10  # different seeds, different draws


def test_noise_is_exponential():
    e = exponential_noise(torch.arange(4), torch.arange(4), 3, 50_000)
    idx = torch.tensor([[5, 70_000, 2]]).expand(4, -1)
    assert torch.equal(exponential_noise(torch.arange(4), torch.arange(4), 3, idx)[:, 0], e[:, 5])
    assert e.min() > 0
    assert abs(float(e.mean()) - 1.0) < 0.01 and abs(float(e.var()) - 1.0) < 0.03


def test_greedy_rows():
    logits = torch.randn(3, 40)
    out = sample(logits, torch.tensor([0.0, 0.0, 0.0]), torch.ones(3), torch.full((3,), 40),
                 torch.arange(3), torch.zeros(3, dtype=torch.long), 1)
    assert torch.equal(out, logits.argmax(-1))


def test_ras_swaps_only_when_main_token_is_in_window():
    n_sem = 8
    s = SlotSampling(2, "cpu")
    # main sampling is greedy-ish (top_k=1) but RAS draws at temperature 1 over all tokens
    s.assign(0, SamplingParams(temperature=1.0, top_p=1.0, top_k=1, ras_top_p=1.0), seed=1)
    s.assign(1, SamplingParams(temperature=1.0, top_p=1.0, top_k=1, ras_window=0), seed=1)
    logits = torch.zeros(2, n_sem + 1)
    logits[:, 3] = 5.0
    slots = torch.tensor([0, 1])
    out0 = s.sample_main(slots, logits, n_sem)  # step 0: the prefill frame, never enters
    assert out0.tolist() == [3, 3]
    s.advance(slots)
    assert s.window[0].max() == -1
    out1 = s.sample_main(slots, logits, n_sem)  # window empty: no swap, token pushed
    assert out1.tolist() == [3, 3] and not s.last_ras_condition.any()
    s.advance(slots)
    assert s.window[0, -1] == 3
    # now 3 is in slot 0's window: the condition fires for slot 0 only (RAS off for slot 1)
    s.sample_main(slots, logits, n_sem)
    assert s.last_ras_condition.tolist() == [True, False]


def test_ras_ignores_im_end():
    n_sem = 4
    s = SlotSampling(1, "cpu")
    s.assign(0, SamplingParams(temperature=1.0, top_k=1), seed=0)
    logits = torch.full((1, n_sem + 1), -5.0)
    logits[0, n_sem] = 5.0  # <|im_end|>
    for _ in range(3):
        s.sample_main(torch.tensor([0]), logits, n_sem)
        s.advance(torch.tensor([0]))
    assert not s.last_ras_condition.any()


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0}, {"top_k": 0}, {"top_k": 500},
                                {"seed": -3},
                                {"ras_window": 100}])
def test_params_validation(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_fast_draw_with_its_rows_follows_the_slots_draw():
    """sample_fast_embed: the codes of sample_fast and their table rows; without a
    draw_embed of its own, the rule is the slots' `draw` (never another one)."""
    s = SlotSampling(3, "cpu")
    for slot in range(3):
        s.assign(slot, SamplingParams(temperature=0.8, top_p=0.9, top_k=20), seed=slot)
    logits, table = torch.randn(3, 50), torch.randn(50, 6)
    codes, rows = s.sample_fast_embed(slice(0, 3), logits, 4, table)
    assert torch.equal(codes, s.sample_fast(slice(0, 3), logits, 4))
    assert torch.equal(rows, table[codes])
    last = torch.tensor([49, 48, 47])
    odd = SlotSampling(3, "cpu", draw=lambda logits, *a: last)
    codes, rows = odd.sample_fast_embed(slice(0, 3), logits, 4, table)
    assert torch.equal(codes, last) and torch.equal(rows, table[last])
