"""Tests for lockgate.runner.sampler: filters, penalties, seeds, distributions, logprobs.

Statistical tests use fixed generator seeds, so they are deterministic; their thresholds are
loose enough for a correct sampler and far too tight for a wrong one.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lockgate.plan import SamplingBatch
from lockgate.runner.sampler import (
    SampleOutput,
    apply_penalties,
    greedy_output,
    plain_greedy,
    sample,
    step_seed,
)

# ----------------------------------------------------------------------------- helpers

_DEFAULTS: dict[str, tuple[float, type]] = {
    "temperature": (1.0, np.float32),
    "top_p": (1.0, np.float32),
    "top_k": (-1, np.int64),
    "min_p": (0.0, np.float32),
    "repetition_penalty": (1.0, np.float32),
    "frequency_penalty": (0.0, np.float32),
    "presence_penalty": (0.0, np.float32),
    "seeds": (0, np.int64),
    "has_seed": (False, np.bool_),
    "seed_steps": (0, np.int64),
    "num_logprobs": (-1, np.int64),
}


def make_batch(s: int, prompt=None, output=None, suppress=None, **knobs) -> SamplingBatch:
    """A SamplingBatch of ``s`` rows: scalars broadcast, sequences taken per row."""
    arrays = {}
    for name, (default, dtype) in _DEFAULTS.items():
        val = knobs.pop(name, default)
        arrays[name] = np.broadcast_to(np.asarray(val, dtype=dtype), (s,)).copy()
    assert not knobs, f"unknown knobs {knobs}"
    b = SamplingBatch(**arrays)
    for name, rows in (("prompt", prompt), ("output", output), ("suppress", suppress)):
        if rows is not None:
            assert len(rows) == s
            ids, off = SamplingBatch.ragged(rows)
            setattr(b, f"{name}_ids", ids)
            setattr(b, f"{name}_offsets", off)
        else:
            setattr(b, f"{name}_offsets", np.zeros(s + 1, dtype=np.int64))
    return b


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def chi2_ok(tokens: np.ndarray, probs: np.ndarray) -> tuple[bool, float, float]:
    """Pearson chi-square of ``tokens`` against ``probs`` at p = 1e-4 (Wilson-Hilferty)."""
    n = tokens.size
    counts = np.bincount(tokens, minlength=probs.size).astype(np.float64)
    expected = probs * n
    assert counts[expected == 0].sum() == 0, "drew a token whose probability is 0"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    d = int(keep.sum()) - 1
    z = 3.719  # one-sided normal quantile at 1e-4
    crit = d * (1 - 2 / (9 * d) + z * math.sqrt(2 / (9 * d))) ** 3
    return stat < crit, stat, crit


def nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    """Smallest set of most likely tokens whose total probability reaches top_p (float64)."""
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    n = int(np.searchsorted(cum, top_p)) + 1  # first index with cum >= top_p, inclusive
    return {int(t) for t in order[:n]}


# ----------------------------------------------------------------------------- greedy / suppress


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(dtype):
    logits = torch.randn(32, 500, generator=gen(0)).to(dtype)
    out = sample(logits, make_batch(32, temperature=0.0))
    assert out.tokens.dtype == torch.int64 and out.tokens.shape == (32,)
    assert torch.equal(out.tokens, logits.float().argmax(-1))


def test_plain_greedy_batches_and_their_output():
    """The runner's argmax-only path is for batches where the token is the argmax and nothing else
    is reported; its output is what sample() gives such a batch."""
    assert plain_greedy(make_batch(4, temperature=0.0))
    assert not plain_greedy(make_batch(4, temperature=[0.0, 0.0, 0.7, 0.0]))
    assert not plain_greedy(make_batch(4, temperature=0.0, num_logprobs=[-1, 0, -1, -1]))  # logprobs asked
    assert not plain_greedy(make_batch(4, temperature=0.0, repetition_penalty=1.1))
    assert not plain_greedy(make_batch(2, temperature=0.0, suppress=[[3], []]))
    grammar = make_batch(2, temperature=0.0)
    grammar.allowed_rows, grammar.allowed = np.array([1]), np.zeros((1, 10), np.int32)  # a constrained row
    assert not plain_greedy(grammar)
    logits = torch.randn(4, 300, generator=gen(5))
    want, got = sample(logits, make_batch(4, temperature=0.0)), greedy_output(logits.argmax(-1))
    for a, b in zip(want.to_numpy(), got.to_numpy(), strict=True):
        np.testing.assert_array_equal(a, b)  # NaN logprobs equal as arrays


def test_input_logits_never_modified():
    logits = torch.randn(8, 50, generator=gen(1))
    before = logits.clone()
    b = make_batch(8, temperature=[0, 1, 0.5, 1, 0, 2, 1, 1], top_k=3, top_p=0.8, min_p=0.1,
                   repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5,
                   prompt=[[1, 2]] * 8, output=[[3, 3]] * 8, suppress=[[0]] * 8)
    sample(logits, b, gen(0))
    assert torch.equal(logits, before)


def test_suppressed_ids_never_chosen_even_when_argmax():
    s, v = 400, 20
    logits = torch.randn(s, v, generator=gen(2))
    logits[:, 7] = 50.0  # argmax everywhere
    logits[:, 3] = 49.0  # runner-up everywhere
    # Half greedy, half sampling at high temperature; out-of-range ids must be ignored, not crash.
    temps = np.where(np.arange(s) % 2 == 0, 0.0, 5.0)
    b = make_batch(s, temperature=temps, suppress=[[7, 3, v + 5, -1]] * s)
    tokens = sample(logits, b, gen(3)).tokens.numpy()
    assert not np.isin(tokens, [7, 3]).any()
    # Greedy rows pick the best remaining token.
    rest = logits.clone()
    rest[:, [3, 7]] = float("-inf")
    assert np.array_equal(tokens[::2], rest.argmax(-1).numpy()[::2])
    # Suppression is per row: a row without suppress ids still picks 7 greedily.
    b2 = make_batch(2, temperature=0.0, suppress=[[7], []])
    assert sample(logits[:2], b2).tokens.tolist()[1] == 7


# ----------------------------------------------------------------------------- filters


def test_top_k_1_with_temperature_equals_greedy():
    logits = torch.randn(64, 300, generator=gen(4))
    seeded = np.arange(64) % 3 == 0
    b = make_batch(64, temperature=1.7, top_k=1, has_seed=seeded, seeds=np.arange(64))
    assert torch.equal(sample(logits, b, gen(5)).tokens, logits.argmax(-1))
    # Also through the sorted (top_p) path.
    b = make_batch(64, temperature=1.7, top_k=1, top_p=0.99)
    assert torch.equal(sample(logits, b, gen(6)).tokens, logits.argmax(-1))


@pytest.mark.parametrize("top_p", [1.0, 0.95])  # topk-only path and sorted path
def test_top_k_only_yields_k_largest(top_p):
    v, reps = 40, 800
    base = torch.randn(5, v, generator=gen(7)) * 0.3  # flat: every allowed token is likely
    ks = np.array([1, 2, 3, 5, 10])
    logits = base.repeat(reps, 1)  # [5 * reps, V], row i uses base[i % 5]
    k_rows = np.tile(ks, reps)
    tokens = sample(logits, make_batch(5 * reps, temperature=1.0, top_k=k_rows, top_p=top_p), gen(8)).tokens
    tokens = tokens.numpy().reshape(reps, 5)
    for j, k in enumerate(ks):
        allowed = set(torch.topk(base[j], int(k)).indices.tolist())
        drawn = set(tokens[:, j].tolist())
        assert drawn <= allowed, (k, drawn - allowed)
        if top_p == 1.0:
            assert drawn == allowed  # every one of the k is reachable


def test_top_k_distribution_is_renormalised_softmax():
    v, s = 12, 20000
    row = torch.randn(v, generator=gen(9))
    tokens = sample(row.repeat(s, 1), make_batch(s, temperature=0.8, top_k=4), gen(10)).tokens.numpy()
    p = softmax(row.double().numpy() / 0.8)
    keep = np.zeros(v, bool)
    keep[np.argsort(-p)[:4]] = True
    p = np.where(keep, p, 0.0)
    ok, stat, crit = chi2_ok(tokens, p / p.sum())
    assert ok, (stat, crit)


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
def test_top_p_only_yields_nucleus(top_p):
    v, s, temp = 30, 6000, 0.7
    rng = np.random.default_rng(11)
    while True:  # logits whose cumulative sums stay clear of top_p (no float-boundary ambiguity)
        row = rng.normal(0, 1.5, v)
        probs = softmax(row / temp)
        if np.min(np.abs(np.cumsum(np.sort(probs)[::-1]) - top_p)) > 1e-3:
            break
    allowed = nucleus(probs, top_p)
    logits = torch.tensor(row, dtype=torch.float32).repeat(s, 1)
    tokens = sample(logits, make_batch(s, temperature=temp, top_p=top_p), gen(12)).tokens.numpy()
    assert set(tokens.tolist()) <= allowed
    keep = np.zeros(v, bool)
    keep[list(allowed)] = True
    target = np.where(keep, probs, 0.0)
    ok, stat, crit = chi2_ok(tokens, target / target.sum())
    assert ok, (stat, crit)


def test_top_p_cuts_at_first_token_reaching_top_p_and_keeps_its_ties():
    # probs exactly [0.5, 0.25, 0.25, 0]: token 0 alone reaches 0.5; tokens 1 and 2 are tied.
    logits = torch.tensor([[0.0, -1000.0, -1000.0, -1000.0],
                           [math.log(2.0), 0.0, 0.0, -1000.0]]).repeat(400, 1)
    b = make_batch(800, temperature=1.0, top_p=np.tile([0.5, 0.6], 400).astype(np.float32))
    tokens = sample(logits, b, gen(25)).tokens.numpy().reshape(400, 2)
    assert set(tokens[:, 0].tolist()) == {0}
    assert set(tokens[:, 1].tolist()) == {0, 1, 2}  # 0.5 + 0.25 >= 0.6: the tie keeps 2 as well
    b = make_batch(800, temperature=1.0, top_p=0.45)
    assert set(sample(logits, b, gen(26)).tokens.tolist()) == {0}


def test_top_p_nucleus_wider_than_sorted_head():
    """A flat row whose nucleus spans most of a 5000-token vocabulary (head widening path)."""
    v, s = 5000, 200
    row = torch.randn(v, generator=gen(27)) * 0.1
    probs = softmax(row.double().numpy())
    allowed = nucleus(probs, 0.9 + 1e-4)  # slack for float32 cumsum at the boundary token
    assert len(allowed) > 1000
    tokens = sample(row.repeat(s, 1), make_batch(s, temperature=1.0, top_p=0.9), gen(28)).tokens.tolist()
    assert set(tokens) <= allowed
    assert len(set(tokens)) > 150


def test_top_p_always_keeps_top_token():
    logits = torch.randn(50, 100, generator=gen(13))
    b = make_batch(50, temperature=1.0, top_p=1e-6)
    assert torch.equal(sample(logits, b, gen(14)).tokens, logits.argmax(-1))


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_drops_unlikely_tokens(min_p):
    v, s, temp = 25, 8000, 1.3
    rng = np.random.default_rng(15)
    while True:
        row = rng.normal(0, 1.5, v)
        probs = softmax(row / temp)
        ratio = probs / probs.max()
        if np.min(np.abs(ratio - min_p)) > 1e-3:
            break
    allowed = {int(t) for t in np.flatnonzero(probs >= min_p * probs.max())}
    assert len(allowed) >= 2
    logits = torch.tensor(row, dtype=torch.float32).repeat(s, 1)
    tokens = sample(logits, make_batch(s, temperature=temp, min_p=min_p), gen(16)).tokens.numpy()
    assert set(tokens.tolist()) <= allowed
    target = np.where(probs >= min_p * probs.max(), probs, 0.0)
    ok, stat, crit = chi2_ok(tokens, target / target.sum())
    assert ok, (stat, crit)


# ----------------------------------------------------------------------------- distribution


@pytest.mark.parametrize("temp", [1.0, 0.5, 2.0])
def test_sampling_distribution_matches_softmax(temp):
    s = 30000
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    tokens = sample(row.repeat(s, 1), make_batch(s, temperature=temp), gen(17)).tokens.numpy()
    ok, stat, crit = chi2_ok(tokens, softmax(row.double().numpy() / temp))
    assert ok, (stat, crit)


def test_wrong_distribution_is_detected():
    """The chi-square check has teeth: softmax at T=1 is rejected against T=0.8."""
    s = 30000
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    tokens = sample(row.repeat(s, 1), make_batch(s, temperature=1.0), gen(17)).tokens.numpy()
    assert not chi2_ok(tokens, softmax(row.double().numpy() / 0.8))[0]


# ----------------------------------------------------------------------------- seeds


def _target_row() -> torch.Tensor:
    return torch.randn(1000, generator=gen(18)) * 0.5  # flat: the draw is unpredictable


def test_seeded_row_independent_of_batch_and_position():
    row = _target_row()
    knobs = {"temperature": 0.9, "top_p": 0.95, "top_k": 500, "min_p": 0.01,
             "has_seed": True, "seeds": 1234, "seed_steps": 7}
    alone = sample(row[None], make_batch(1, **knobs), gen(0)).tokens.item()

    rng = np.random.default_rng(19)
    for trial in range(12):
        s = int(rng.integers(2, 20))
        pos = int(rng.integers(0, s))
        logits = torch.randn(s, 1000, generator=gen(100 + trial)) * 3
        logits[pos] = row
        cols = {name: np.full(s, d, dtype=t) for name, (d, t) in _DEFAULTS.items()}
        cols["temperature"] = rng.choice([0.0, 0.5, 1.0, 2.0], s).astype(np.float32)
        cols["top_p"] = rng.choice([1.0, 0.5], s).astype(np.float32)
        cols["top_k"] = rng.choice([-1, 5], s)
        cols["has_seed"] = rng.random(s) < 0.5
        cols["seeds"] = rng.integers(0, 10_000, s)
        cols["seed_steps"] = rng.integers(0, 50, s)
        for name, val in knobs.items():
            cols[name][pos] = val
        b = make_batch(s, **cols)
        out = sample(logits, b, gen(trial)).tokens  # different global generator every time
        assert out[pos].item() == alone, (trial, s, pos)


def test_seeded_row_reproducible_with_penalties_and_neighbours():
    row = _target_row()
    b1 = make_batch(1, temperature=1.0, has_seed=True, seeds=5, seed_steps=3,
                    repetition_penalty=1.2, prompt=[[1, 2, 3]], output=[[4]])
    b3 = make_batch(3, temperature=[1.0, 1.0, 0.0], has_seed=[False, True, False], seeds=[0, 5, 0],
                    seed_steps=[0, 3, 0], repetition_penalty=[1.0, 1.2, 1.0], frequency_penalty=[0.5, 0, 0],
                    prompt=[[], [1, 2, 3], []], output=[[9, 9], [4], []])
    a = sample(row[None], b1, gen(1)).tokens.item()
    logits = torch.stack([torch.randn(1000), row, torch.randn(1000)])
    assert sample(logits, b3, gen(2)).tokens[1].item() == a


def test_seed_and_step_both_change_the_draw():
    row = _target_row()
    s = 64
    logits = row.repeat(s, 1)
    by_seed = sample(logits, make_batch(s, has_seed=True, seeds=np.arange(s), seed_steps=0)).tokens
    by_step = sample(logits, make_batch(s, has_seed=True, seeds=42, seed_steps=np.arange(s))).tokens
    same = sample(logits, make_batch(s, has_seed=True, seeds=42, seed_steps=9)).tokens
    assert len(set(by_seed.tolist())) > 50  # 64 draws over ~1000 near-uniform tokens
    assert len(set(by_step.tolist())) > 50
    assert len(set(same.tolist())) == 1  # identical (seed, step, row) -> identical token


def test_seeded_draws_follow_softmax():
    s = 6000
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    b = make_batch(s, has_seed=True, seeds=np.arange(s) * 7919, seed_steps=np.arange(s) % 13)
    tokens = sample(row.repeat(s, 1), b).tokens.numpy()
    ok, stat, crit = chi2_ok(tokens, softmax(row.double().numpy()))
    assert ok, (stat, crit)


def test_step_seed_is_stable_and_mixes():
    assert step_seed(0, 0) == step_seed(0, 0)
    vals = {step_seed(seed, step) for seed in range(-20, 20) for step in range(20)}
    assert len(vals) == 800
    assert all(0 <= x < 2**63 for x in vals)
    assert 0 <= step_seed(2**64 - 1, 5) < 2**63


def test_unseeded_rows_follow_global_generator():
    logits = _target_row().repeat(16, 1)
    b = make_batch(16)
    assert torch.equal(sample(logits, b, gen(3)).tokens, sample(logits, b, gen(3)).tokens)
    assert not torch.equal(sample(logits, b, gen(3)).tokens, sample(logits, b, gen(4)).tokens)


# ----------------------------------------------------------------------------- penalties


def naive_penalties(logits: np.ndarray, b: SamplingBatch) -> np.ndarray:
    """Per-row Python reference for steps 2-3 (float32 like the sampler)."""
    out = logits.astype(np.float32).copy()
    v = out.shape[1]
    for i in range(out.shape[0]):
        prompt = [int(t) for t in b.prompt_ids[b.prompt_offsets[i]:b.prompt_offsets[i + 1]] if 0 <= t < v]
        output = [int(t) for t in b.output_ids[b.output_offsets[i]:b.output_offsets[i + 1]] if 0 <= t < v]
        rep = np.float32(b.repetition_penalty[i])
        if rep != 1:
            for t in set(prompt) | set(output):
                out[i, t] = out[i, t] / rep if out[i, t] > 0 else out[i, t] * rep
        f, p = np.float32(b.frequency_penalty[i]), np.float32(b.presence_penalty[i])
        for t, c in Counter(output).items():
            out[i, t] -= f * np.float32(c) + p
    return out


@st.composite
def penalty_cases(draw):
    s = draw(st.integers(1, 6))
    v = draw(st.integers(2, 30))
    ids = st.lists(st.integers(-2, v + 2), max_size=12)
    prompt = [draw(ids) for _ in range(s)]
    output = [draw(ids) for _ in range(s)]
    pen = st.sampled_from([1.0, 1.0, 0.5, 1.3, 2.0, 0.9])
    fp = st.sampled_from([0.0, 0.0, 0.5, -0.7, 2.0, -2.0])
    rep = [draw(pen) for _ in range(s)]
    freq = [draw(fp) for _ in range(s)]
    pres = [draw(fp) for _ in range(s)]
    seed = draw(st.integers(0, 2**31))
    logits = np.random.default_rng(seed).normal(0, 2, (s, v)).astype(np.float32)
    logits[np.random.default_rng(seed + 1).random((s, v)) < 0.1] = 0.0  # exercise logit == 0
    b = make_batch(s, prompt=prompt, output=output, repetition_penalty=rep,
                   frequency_penalty=freq, presence_penalty=pres)
    return logits, b


@settings(max_examples=80, deadline=None)
@given(penalty_cases())
def test_apply_penalties_matches_naive_reference(case):
    logits, b = case
    got = apply_penalties(torch.from_numpy(logits), b).numpy()
    np.testing.assert_allclose(got, naive_penalties(logits, b), rtol=1e-6, atol=1e-6)


def test_apply_penalties_exact_values():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0],
                           [2.0, -2.0, 1.0, 0.5, 3.0]])
    b = make_batch(2, repetition_penalty=[2.0, 1.0], frequency_penalty=[0.0, 0.25],
                   presence_penalty=[0.0, 0.5], prompt=[[0, 1], []], output=[[2], [3, 3, 3, 1]])
    got = apply_penalties(logits, b)
    assert got.dtype == torch.float32
    expected = torch.tensor([[1.0, -4.0, 0.5, 0.5, 3.0],
                             [2.0, -2.0 - 0.25 - 0.5, 1.0, 0.5 - 0.75 - 0.5, 3.0]])
    assert torch.equal(got, expected)
    assert torch.equal(logits[0], torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0]))  # input untouched


def _greedy(logits: list[list[float]], **kw) -> list[int]:
    x = torch.tensor(logits)
    return sample(x, make_batch(x.shape[0], temperature=0.0, **kw)).tokens.tolist()


def test_penalties_flip_greedy_choices():
    # Repetition, positive logit: 2.0 / 1.5 = 1.33 < 1.5; from the prompt and from the output.
    assert _greedy([[2.0, 1.5, 0.0]]) == [0]
    assert _greedy([[2.0, 1.5, 0.0]], repetition_penalty=1.5, prompt=[[0]], output=[[]]) == [1]
    assert _greedy([[2.0, 1.5, 0.0]], repetition_penalty=1.5, prompt=[[]], output=[[0]]) == [1]
    assert _greedy([[2.0, 1.5, 0.0]], repetition_penalty=1.2, prompt=[[0]], output=[[]]) == [0]
    # Repetition, negative logit is multiplied: -1.0 * 1.5 = -1.5 < -1.2 (dividing would keep 0).
    assert _greedy([[-1.0, -1.2, -5.0]], repetition_penalty=1.5, prompt=[[0]], output=[[]]) == [1]
    # Frequency scales with the count: 1.0 - 3 * 0.2 = 0.4 < 0.5, but 1.0 - 3 * 0.1 = 0.7.
    assert _greedy([[1.0, 0.5, 0.0]], frequency_penalty=0.2, output=[[0, 0, 0]]) == [1]
    assert _greedy([[1.0, 0.5, 0.0]], frequency_penalty=0.1, output=[[0, 0, 0]]) == [0]
    # Presence does not: 1.0 - 0.6 = 0.4 flips, 1.0 - 0.4 = 0.6 does not, however many repeats.
    assert _greedy([[1.0, 0.5, 0.0]], presence_penalty=0.6, output=[[0, 0, 0]]) == [1]
    assert _greedy([[1.0, 0.5, 0.0]], presence_penalty=0.4, output=[[0, 0, 0]]) == [0]
    # Frequency / presence ignore the prompt.
    assert _greedy([[1.0, 0.5, 0.0]], frequency_penalty=2.0, presence_penalty=2.0,
                   prompt=[[0]], output=[[]]) == [0]
    # Negative frequency penalty encourages repeats: 0.5 + 0.6 = 1.1 > 1.0.
    assert _greedy([[0.5, 1.0, 0.0]], frequency_penalty=-0.6, output=[[0]]) == [0]
    # Penalties stay in their row.
    assert _greedy([[2.0, 1.5], [2.0, 1.5]], repetition_penalty=[3.0, 1.0], prompt=[[0], [0]],
                   output=[[0], [0]]) == [1, 0]


def test_suppress_applies_before_penalties_and_sampling_rows_see_penalties():
    # A sampling row with top_k=1 must take the penalised argmax.
    x = torch.tensor([[2.0, 1.5, 0.0, -1.0]] * 4)
    b = make_batch(4, temperature=1.0, top_k=1, repetition_penalty=[1.0, 2.0, 1.0, 1.0],
                   prompt=[[], [0], [], []], output=[[], [], [], []], suppress=[[], [], [0, 1], []])
    assert sample(x, b, gen(0)).tokens.tolist() == [0, 1, 2, 0]


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_at_chosen_token():
    s, v = 24, 200
    logits = torch.randn(s, v, generator=gen(20)) * 2
    rng = np.random.default_rng(21)
    b = make_batch(s, temperature=rng.choice([0.0, 0.7, 1.5], s), top_k=rng.choice([-1, 10], s),
                   top_p=rng.choice([1.0, 0.8], s), repetition_penalty=1.5, frequency_penalty=0.3,
                   prompt=[list(rng.integers(0, v, 5)) for _ in range(s)],
                   output=[list(rng.integers(0, v, 5)) for _ in range(s)],
                   suppress=[[int(logits[i].argmax())] for i in range(s)],
                   num_logprobs=rng.choice([-1, 0, 3, 5], s), has_seed=True, seeds=np.arange(s))
    out = sample(logits, b, gen(22))
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (s,)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.tokens[:, None]).squeeze(1),
                               rtol=0, atol=1e-5)
    # Not the penalised/temperature distribution: the suppressed argmax has the best raw logprob.
    assert bool((out.logprobs < ref.max(-1).values).all())
    k = int(b.num_logprobs.max())
    assert out.top_ids.shape == (s, k) and out.top_logprobs.shape == (s, k)
    assert out.top_ids.dtype == torch.int64 and out.top_logprobs.dtype == torch.float32
    true_vals, true_ids = torch.topk(ref, k, dim=-1)
    assert torch.equal(out.top_ids, true_ids)
    torch.testing.assert_close(out.top_logprobs, true_vals, rtol=0, atol=1e-5)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())


def test_logprobs_of_a_row_do_not_depend_on_the_rows_beside_it():
    # A request verifying speculative guesses samples several rows at once; each row's
    # log-probabilities must be bitwise those it gets alone.
    # (torch's batched logsumexp differs in the last bit for about 5% of such rows: 120 rows.)
    g = gen(30)
    for _ in range(30):
        logits = torch.randn(4, 49152, generator=g) * 3
        together = sample(logits, make_batch(4, temperature=0.0, num_logprobs=3), gen(31))
        for i in range(4):
            alone = sample(logits[i:i + 1].clone(), make_batch(1, temperature=0.0, num_logprobs=3), gen(31))
            assert torch.equal(alone.logprobs[0], together.logprobs[i])
            assert torch.equal(alone.top_logprobs[0], together.top_logprobs[i])
            assert torch.equal(alone.top_ids[0], together.top_ids[i])


@pytest.mark.parametrize("nums,k", [([-1, -1], 0), ([0, -1], 0), ([2, 0], 2), ([50, 1], 10)])
def test_top_logprobs_width(nums, k):
    logits = torch.randn(2, 10, generator=gen(23)).to(torch.bfloat16)
    out = sample(logits, make_batch(2, temperature=0.0, num_logprobs=nums))
    assert out.top_ids.shape == (2, k) and out.top_logprobs.shape == (2, k)
    ref = torch.log_softmax(logits.float(), -1)
    if max(nums) < 0:  # nobody asked: not computed (NaN), the tokens are still the argmax
        assert out.logprobs.isnan().all() and torch.equal(out.tokens, logits.float().argmax(-1))
    else:
        torch.testing.assert_close(out.logprobs, ref.gather(1, out.tokens[:, None]).squeeze(1), rtol=0, atol=1e-5)
    if k:
        torch.testing.assert_close(out.top_logprobs, torch.topk(ref, k, -1).values, rtol=0, atol=1e-5)


def test_to_numpy_and_empty_batch():
    out = sample(torch.randn(3, 7, generator=gen(24)), make_batch(3, temperature=0.0, num_logprobs=2))
    assert isinstance(out, SampleOutput)
    tokens, lps, ids, tlps = out.to_numpy()
    assert tokens.dtype == np.int64 and lps.dtype == np.float32
    assert ids.dtype == np.int64 and ids.shape == (3, 2) and tlps.dtype == np.float32
    empty = sample(torch.zeros(0, 7), make_batch(0)).to_numpy()
    assert [a.shape for a in empty] == [(0,), (0,), (0, 0), (0, 0)]


def test_mismatched_batch_is_rejected():
    with pytest.raises(ValueError):
        sample(torch.randn(3, 7), make_batch(2))


# ----------------------------------------------------------------------------- ties and grammar masks
def test_tied_top_logprobs_list_the_greedy_token_first() -> None:
    """Tied logits (common in bf16): the top list orders ties by id, as argmax breaks them, so a
    greedy row's token is its own first top entry (TGI clients check exactly that)."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = torch.from_numpy(rng.integers(0, 4, size=(6, 300)).astype(np.float32))  # many exact ties
        out = sample(x, make_batch(6, temperature=0.0, num_logprobs=5))
        tokens, _, top_ids, top_lp = out.to_numpy()
        assert np.array_equal(top_ids[:, 0], tokens)
        assert np.all(np.diff(top_lp, axis=1) <= 0)
        for r in range(6):
            for a, b in zip(range(4), range(1, 5), strict=True):
                if top_lp[r, a] == top_lp[r, b]:
                    assert top_ids[r, a] < top_ids[r, b]


def _bits(allowed: list[set[int]], v: int) -> np.ndarray:
    words = np.zeros((len(allowed), (v + 31) // 32), dtype=np.uint32)
    for i, ok in enumerate(allowed):
        for t in ok:
            words[i, t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_mask_restricts_only_its_rows_and_leaves_logprobs_raw(temperature: float) -> None:
    v = 100
    x = torch.randn(4, v, generator=gen(1))
    ok = [{3, 64, 99}, {31, 32}]  # bits in the first, a middle and the last word
    b = make_batch(4, temperature=temperature, num_logprobs=2, seeds=7, has_seed=True)
    b.allowed_rows, b.allowed = np.array([1, 3]), _bits(ok, v)
    free = make_batch(4, temperature=temperature, num_logprobs=2, seeds=7, has_seed=True)
    for step in range(30):
        b.seed_steps[:] = free.seed_steps[:] = step
        out, ref = sample(x, b), sample(x, free)
        t = out.tokens.numpy()
        assert t[1] in ok[0] and t[3] in ok[1]
        assert t[0] == ref.tokens[0] and t[2] == ref.tokens[2]  # other rows: as if no grammar ran
        # reported logprobs are the model's (raw), not renormalised over the allowed tokens
        want = torch.log_softmax(x, -1).gather(1, out.tokens[:, None]).squeeze(1)
        assert torch.allclose(out.logprobs, want, atol=1e-6)
    if temperature == 0.0:
        assert t[1] == max(ok[0], key=lambda i: float(x[1, i]))


def test_top_logprobs_survive_nan_and_minus_inf_logits() -> None:
    """A row with NaN (a broken model step) must not crash the whole batch's sampling; rows with many
    -inf (masked) entries still list their finite tokens first."""
    x = torch.randn(3, 50, generator=gen(3))
    x[1, 5] = float("nan")
    x[2, :] = float("-inf")
    x[2, 7] = 0.0
    _, _, top_ids, top_lp = sample(x, make_batch(3, temperature=0.0, num_logprobs=4)).to_numpy()
    assert top_ids.shape == (3, 4) and top_ids[2, 0] == 7 and np.isinf(top_lp[2, 1:]).all()
