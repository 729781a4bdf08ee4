"""N-gram speculation: the proposer, and the scheduler verifying guesses on the sim runner.

The sim runner's token is a function of a row's last input token and position only, so a
request's output is fixed whatever the batching; ``CycleRunner`` below makes that function
repeat itself (with a twist every few positions), so that guesses from the request's history
are often right and sometimes wrong, the two cases speculation must handle. The real model's
side (same tokens and log-probabilities with and without speculation) is in
``test_offline_model.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import run_all

from lockgate.config import EngineConfig
from lockgate.engine.core import EngineCore
from lockgate.plan import ForwardPlan, ForwardResult
from lockgate.runner.sim_runner import SimRunner
from lockgate.sampling import SamplingParams
from lockgate.scheduler.ngram import NgramIndex

# ---- the proposer ------------------------------------------------------------------------


def naive_propose(toks: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest suffix (max_n .. min_n) with an earlier occurrence; what followed the latest one."""
    for n in range(max_n, min_n - 1, -1):
        if len(toks) <= n:
            continue
        suffix = toks[-n:]
        for s in range(len(toks) - n - 1, -1, -1):
            if toks[s:s + n] == suffix:
                return toks[s + n:s + n + k]
    return []


@settings(max_examples=200, deadline=None)
@given(toks=st.lists(st.integers(0, 4), max_size=60), cuts=st.lists(st.integers(0, 60), max_size=5),
       k=st.integers(0, 5), ns=st.tuples(st.integers(1, 4), st.integers(0, 3)))
def test_ngram_index_equals_naive_search(toks: list[int], cuts: list[int], k: int, ns: tuple[int, int]) -> None:
    min_n, max_n = ns[0], ns[0] + ns[1]
    idx = NgramIndex(min_n, max_n)
    start = 0
    for c in sorted(set(cuts)) + [len(toks)]:  # extended in pieces, as decode steps add tokens
        idx.extend(toks[start:max(c, start)])
        start = max(c, start)
        assert idx.propose(k) == naive_propose(toks[:start], k, min_n, max_n)


def test_ngram_index_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(3, 2)
    with pytest.raises(ValueError):
        NgramIndex(0, 2)


# ---- the scheduler -----------------------------------------------------------------------


class CycleRunner(SimRunner):
    """Next token: a fixed successor of the last token (a cycle through 3..9), except at
    positions divisible by ``twist``, where it jumps elsewhere; a token the row suppresses
    (min_tokens) becomes 10, as a sampler would take the next best. Records every plan."""

    twist = 7

    def __init__(self, *a, **kw):  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.plans: list[ForwardPlan] = []

    def next_tokens(self, last_ids: np.ndarray, last_pos: np.ndarray) -> np.ndarray:  # type: ignore[override]
        nxt = (last_ids - 3 + 1) % 7 + 3
        return np.where(last_pos % self.twist == 0, (last_ids * 5 + last_pos) % 11 + 3, nxt).astype(np.int64)

    def execute(self, plan: ForwardPlan) -> ForwardResult:
        self.plans.append(plan)
        res = super().execute(plan)
        sb = plan.sampling
        for i in range(sb.size):
            if res.tokens[i] in sb.suppress_ids[sb.suppress_offsets[i]:sb.suppress_offsets[i + 1]]:
                res.tokens[i] = 10
        return res


def cycle_engine(capacity: int = 10_000, runner: type[CycleRunner] | None = None, **sched) -> EngineCore:  # type: ignore[no-untyped-def]
    cfg = EngineConfig.build(model="sim", max_total_tokens=capacity, sim_step_ms=0.0, sim_token_ms=0.0, **sched)
    return EngineCore(cfg, runner=(runner or CycleRunner)(cfg.model, cfg.cache), check_invariants=True)


def drain(eng: EngineCore) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Every request's output ids and finish reason once the engine has no work left."""
    outs = run_all(eng)
    return outs, eng.reasons  # type: ignore[attr-defined]


def greedy(max_tokens: int, **kw) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def decode_rows_beyond_requests(plan: ForwardPlan) -> int:
    """Guess rows in a plan: one-token rows beyond one per distinct context start."""
    ones = plan.query_lens == 1
    firsts = plan.kv_slots[plan.kv_offsets[:-1]][ones]  # a request's rows share their first slot
    return int(ones.sum()) - len(set(firsts.tolist()))


def test_speculation_gives_the_same_tokens_in_fewer_steps() -> None:
    prompts = [[3, 4, 5, 6, 7, 8, 9, 3, 4], [5, 5, 6], [9, 3, 4, 5, 6, 7, 8, 9, 3, 4, 5, 6]]
    results = {}
    for k in (0, 2):
        eng = cycle_engine(speculative_tokens=k, speculative_max_rows=9)  # three requests, two guesses each
        rids = [eng.add_request(p, greedy(40)).rid for p in prompts]
        outs, reasons = drain(eng)
        results[k] = ([outs[r] for r in rids], [reasons[r] for r in rids], eng.num_steps, eng.scheduler)
    (off, off_reasons, off_steps, _), (on, on_reasons, on_steps, sched) = results[0], results[2]
    assert on == off and all(len(o) == 40 for o in on)
    assert on_reasons == off_reasons == ["length"] * 3
    assert sched.speculator.num_draft_tokens > 0 and 0 < sched.speculator.num_accepted_tokens < sched.speculator.num_draft_tokens  # twists reject some
    assert on_steps < off_steps
    assert sched.ledger.allocator.num_free + sched.ledger.tree.total_size == sched.capacity and sched.ledger.protected == 0
    assert sched.stats().accepted_tokens == sched.speculator.num_accepted_tokens


def test_guess_rows_stay_within_the_row_budget() -> None:
    # min_acceptance 1: only the free rows (speculative_max_rows) take guesses
    eng = cycle_engine(speculative_tokens=4, speculative_max_rows=3, speculative_min_acceptance=1.0)
    for p in ([3, 4, 5, 6, 7, 8, 9, 3], [6, 7, 8, 9, 3, 4, 5, 6]):
        eng.add_request(p, greedy(30))
    drain(eng)
    plans = eng.runner.plans  # type: ignore[attr-defined]
    assert all(int((p.query_lens == 1).sum()) <= 3 for p in plans if decode_rows_beyond_requests(p))
    assert any(decode_rows_beyond_requests(p) for p in plans)
    # A lone request may use the whole budget: newest token + 2 guesses.
    solo = cycle_engine(speculative_tokens=4, speculative_max_rows=3, speculative_min_acceptance=1.0)
    solo.add_request([3, 4, 5, 6, 7, 8, 9, 3], greedy(30))
    drain(solo)
    assert max(decode_rows_beyond_requests(p) for p in solo.runner.plans) == 2  # type: ignore[attr-defined]


PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 3], [6, 7, 8, 9, 3, 4, 5, 6], [4, 5, 6, 7, 8, 9, 3, 4, 5], [9, 3, 4, 5, 6, 7, 8, 9],
           [5, 6, 7, 8, 9, 3, 4, 5, 6, 7], [7, 8, 9, 3, 4, 5, 6, 7]]


class RandomRunner(CycleRunner):
    """Next token: from a fixed random table of 3..9 by (position, last token): the history's
    n-grams recur (seven tokens) but what follows them seldom does."""

    table = np.random.default_rng(7).integers(3, 10, 4096)

    def next_tokens(self, last_ids: np.ndarray, last_pos: np.ndarray) -> np.ndarray:  # type: ignore[override]
        return self.table[(last_pos * 31 + last_ids) % 4096].astype(np.int64)


def run_six(twist: int, **sched) -> tuple[list[list[int]], EngineCore, list[int]]:  # type: ignore[no-untyped-def]
    """Six greedy requests at once (more rows than the 3 free ones); outputs, engine and each step's
    guess rows."""
    eng = cycle_engine(runner=RandomRunner if twist == 0 else None,  # twist 0: no cycle at all
                       **{"speculative_tokens": 2, "speculative_max_rows": 3, **sched})
    eng.runner.twist = twist  # type: ignore[attr-defined]
    reqs = [eng.add_request(p, greedy(60)) for p in PROMPTS]
    outs, _ = drain(eng)
    eng.requests = reqs  # type: ignore[attr-defined]
    return [outs[r.rid] for r in reqs], eng, [decode_rows_beyond_requests(p) for p in eng.runner.plans]  # type: ignore[attr-defined]


def test_guesses_beyond_the_free_rows_go_where_they_are_taken() -> None:
    want, _, _ = run_six(10**9, speculative_tokens=0)
    # A request that repeats itself: its hit rate climbs, and it guesses with five others running.
    outs, eng, guess_rows = run_six(10**9, speculative_min_acceptance=0.4)
    assert outs == want
    assert max(guess_rows) > 3  # more guess rows than the free rows allow
    spec = eng.scheduler.speculator
    assert spec.num_accepted_tokens > 0.9 * spec.num_draft_tokens
    assert eng.num_steps < 0.6 * 60
    # min_acceptance 1: six requests leave no free row, so nothing is guessed
    outs, eng, guess_rows = run_six(10**9, speculative_min_acceptance=1.0)
    assert outs == want and max(guess_rows) == 0
    # One whose continuations seldom repeat: its first guesses miss, its hit rate falls below
    # min_acceptance and it stops feeding guesses (the misses are scored unfed)
    outs, eng, guess_rows = run_six(0, speculative_min_acceptance=0.4)
    want_twisted, _, _ = run_six(0, speculative_tokens=0)
    assert outs == want_twisted
    steps = len(guess_rows)
    assert sum(guess_rows[steps // 2:]) == 0, guess_rows
    assert all(r.guess_hit_rate < 0.4 for r in eng.requests)  # type: ignore[attr-defined]


def test_no_guesses_beyond_the_free_rows_while_a_request_waits() -> None:
    eng = cycle_engine(speculative_tokens=2, speculative_max_rows=3, max_running_requests=4)
    eng.runner.twist = 10**9  # type: ignore[attr-defined]
    for p in PROMPTS:
        eng.add_request(p, greedy(40))
    waited, free = [], []
    while eng.has_work:
        waiting = bool(eng.scheduler.waiting)
        eng.step()
        (waited if waiting else free).append(decode_rows_beyond_requests(eng.runner.plans[-1]))  # type: ignore[attr-defined]
    assert waited and max(waited) == 0  # four decoding + guesses would pass the 3 free rows
    assert max(free) > 0


def test_stop_token_among_accepted_guesses_ends_the_output_there() -> None:
    # Without the twist the cycle 3..9 repeats forever: every guess is right, and the stop
    # token 8 comes in the middle of a step's accepted run more often than not.
    for k in (0, 2, 3):
        eng = cycle_engine(speculative_tokens=k, speculative_max_rows=4)
        eng.runner.twist = 10**9  # type: ignore[attr-defined]
        reqs = [eng.add_request([3, 4, 5, 6, 7, 8, 9] * 2 + [start], greedy(50, stop_token_ids=(8,), min_tokens=m))
                for start in (3, 4, 5) for m in (0, 9)]
        outs, reasons = drain(eng)
        for r in reqs:
            out = outs[r.rid]
            assert reasons[r.rid] == "stop" and out[-1] == 8
            assert 8 not in out[max(r.params.min_tokens - 1, 0):-1]  # ends at the first stop token it may stop at
            assert r.output_ids == out and len(out) >= r.params.min_tokens
        assert eng.scheduler.ledger.allocator.num_free + eng.scheduler.ledger.tree.total_size == eng.scheduler.capacity


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 17])
def test_max_tokens_exact_with_guesses(max_tokens: int) -> None:
    eng = cycle_engine(speculative_tokens=3, speculative_max_rows=4)
    eng.runner.twist = 10**9  # type: ignore[attr-defined]
    r = eng.add_request([3, 4, 5, 6, 7, 8, 9, 3], greedy(max_tokens))
    outs, reasons = drain(eng)
    assert len(outs[r.rid]) == max_tokens and reasons[r.rid] == "length"
    # never a guess past the last token: rows of a step never exceed what is left
    for p in eng.runner.plans:  # type: ignore[attr-defined]
        assert int(p.seq_lens.max()) <= 8 + max_tokens - 1


def test_only_greedy_requests_without_penalties_speculate() -> None:
    for params in (SamplingParams(max_tokens=30, temperature=0.8, seed=1),
                   greedy(30, repetition_penalty=1.2), greedy(30, frequency_penalty=0.5)):
        eng = cycle_engine()
        eng.add_request([3, 4, 5, 6, 7, 8, 9, 3, 4], params)
        drain(eng)
        assert eng.scheduler.speculator.num_draft_tokens == 0, params


def test_min_tokens_suppression_applies_to_each_guess_row() -> None:
    # Stop token 8 is suppressed (becomes 10) while a row's output would be shorter than
    # min_tokens: guess rows must see their own output position, so the result is the one
    # of one token per step. (What the benchmark client sends: ignore_eos with min_tokens.)
    for m in range(15, 25):  # every alignment of the min_tokens boundary with a step's guess rows
        outs = {}
        for k in (0, 2):
            eng = cycle_engine(speculative_tokens=k)
            eng.runner.twist = 10**9  # type: ignore[attr-defined]
            r = eng.add_request([3, 4, 5, 6, 7, 8, 9, 3, 4], greedy(60, min_tokens=m, stop_token_ids=(8,)))
            got, reasons = drain(eng)
            outs[k] = (got[r.rid], reasons[r.rid], r.num_accepted)
        (off, off_reason, _), (on, on_reason, accepted) = outs[0], outs[2]
        assert on == off and on_reason == off_reason == "stop", m
        assert 8 not in off[:m] and 10 in off[:m] and off[-1] == 8, m
        assert accepted > 0


def test_no_guesses_while_the_pool_could_run_out() -> None:
    # A: 10 + 100 tokens at most, B: 5 + 10. Peak admission lets both run in 120 slots (B
    # leaves before A grows), but both at full size (125) would not fit: no guesses until B is gone.
    eng = cycle_engine(capacity=120)
    eng.runner.twist = 10**9  # type: ignore[attr-defined]
    a = eng.add_request([3, 4, 5, 6, 7, 8, 9, 3, 4, 5], greedy(100))
    b = eng.add_request([6, 7, 8, 9, 3], greedy(10))
    while b.finish_reason is None:
        eng.step()
        assert a.num_drafted == 0 and b.num_drafted == 0
    drain(eng)
    assert a.num_drafted > 0 and a.num_output == 100


def test_abort_between_steps_returns_guess_slots() -> None:
    eng = cycle_engine()
    eng.runner.twist = 10**9  # type: ignore[attr-defined]
    r = eng.add_request([3, 4, 5, 6, 7, 8, 9, 3], greedy(60))
    other = eng.add_request([4, 5, 6], SamplingParams(max_tokens=60, temperature=0.5, seed=3))
    for _ in range(6):
        eng.step()
    assert r.num_accepted > 0
    eng.abort(r.rid)
    eng.scheduler.check_invariants()
    drain(eng)
    sched = eng.scheduler
    assert other.num_output == 60
    assert sched.ledger.allocator.num_free + sched.ledger.tree.total_size == sched.capacity and sched.ledger.protected == 0


@settings(max_examples=30, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 200), st.booleans()), min_size=1, max_size=24),
       capacity=st.integers(400, 2000), budget=st.integers(1, 256), max_running=st.integers(1, 16),
       k=st.integers(1, 4), rows=st.integers(1, 6), admission=st.sampled_from(["peak", "reserve", "ratio"]))
def test_adversarial_mix_with_guesses_never_runs_out(reqs, capacity, budget, max_running, k, rows, admission):
    """Guesses under pool pressure: check_invariants after every step (slot accounting and,
    for peak/reserve, the estimate within capacity); no alloc fails; every output is what the
    runner's function gives, at full length; nothing is left locked or leaked."""
    eng = cycle_engine(capacity=capacity, max_prefill_tokens=budget, max_running_requests=max_running,
                       speculative_tokens=k, speculative_max_rows=rows, admission=admission)
    rng = np.random.default_rng(len(reqs))
    want = {}
    for prompt_len, max_tokens, greedy_req in reqs:
        if prompt_len + max_tokens > capacity:
            continue
        prompt = (rng.integers(0, 7, prompt_len) + 3).tolist()
        params = greedy(max_tokens) if greedy_req else SamplingParams(max_tokens=max_tokens, temperature=0.7)
        r = eng.add_request(prompt, params)
        want[r.rid] = (prompt, max_tokens)
    outs, reasons = drain(eng)
    for rid, (prompt, max_tokens) in want.items():
        seq = list(prompt)
        for _ in range(max_tokens):  # the runner's function, one token at a time
            seq.append(int(eng.runner.next_tokens(np.array([seq[-1]]), np.array([len(seq) - 1]))[0]))  # type: ignore[attr-defined]
        assert outs[rid] == seq[len(prompt):] and reasons[rid] == "length"
    sched = eng.scheduler
    assert sched.ledger.allocator.num_free + sched.ledger.tree.total_size == capacity and sched.ledger.protected == 0
