"""Scheduler on the sim runner: continuous batching, chunked prefill, admission, abort.

The sim runner is the real ForwardPlan consumer used by ``--model sim`` (it validates every
plan); a subclass below also ends requests early with EOS at random, to stress admission
with requests that finish before max_tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockgate.config import EngineConfig
from lockgate.engine.core import EngineCore
from lockgate.plan import ForwardPlan, ForwardResult
from lockgate.runner.sim_runner import SIM_EOS, SimRunner
from lockgate.sampling import SamplingParams
from lockgate.scheduler.scheduler import RequestRejected


class EarlyEosRunner(SimRunner):
    """Sim runner whose rows emit EOS with probability p (seeded), to end requests early."""

    def __init__(self, *a, p: float = 0.05, seed: int = 0, **kw):  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.rng = np.random.default_rng(seed)
        self.p = p
        self.plans: list[ForwardPlan] = []

    def execute(self, plan: ForwardPlan) -> ForwardResult:
        self.plans.append(plan)
        res = super().execute(plan)
        res.tokens = np.where(self.rng.random(res.tokens.shape) < self.p, SIM_EOS, res.tokens)
        return res


def make_engine(capacity: int, p_eos: float = 0.0, seed: int = 0, **sched) -> EngineCore:  # type: ignore[no-untyped-def]
    cfg = EngineConfig.build(model="sim", max_total_tokens=capacity, sim_step_ms=0.0, sim_token_ms=0.0, **sched)
    return EngineCore(cfg, runner=EarlyEosRunner(cfg.model, cfg.cache, p=p_eos, seed=seed), check_invariants=True)


def run_all(eng: EngineCore, max_steps: int = 100_000) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for _ in range(max_steps):
        if not eng.has_work:
            break
        for ev in eng.step():
            outs.setdefault(ev.rid, []).extend(ev.new_token_ids)
            if ev.finish_reason is not None:
                reasons[ev.rid] = ev.finish_reason.value
    assert not eng.has_work, "engine did not drain"
    eng.reasons = reasons  # type: ignore[attr-defined]
    return outs


@settings(max_examples=40, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 400)), min_size=1, max_size=40),
    capacity=st.integers(700, 3000),
    budget=st.integers(1, 512),
    max_running=st.integers(1, 64),
    p_eos=st.sampled_from([0.0, 0.02, 0.2]),
    seed=st.integers(0, 1000),
)
def test_adversarial_mix_never_runs_out_of_slots(reqs, capacity, budget, max_running, p_eos, seed):
    """Decode never fails to get a slot: alloc never raises and accounting holds after every step."""
    eng = make_engine(capacity, p_eos=p_eos, seed=seed, max_prefill_tokens=budget, max_running_requests=max_running)
    rids = {}
    for prompt_len, max_tokens in reqs:
        if prompt_len + max_tokens > capacity:
            continue
        r = eng.add_request(np.arange(prompt_len) % 1000 + 3, SamplingParams(max_tokens=max_tokens))
        rids[r.rid] = (prompt_len, max_tokens)
    outs = run_all(eng)  # check_invariants=True asserts free + held == capacity after each step
    assert set(outs) == set(rids)
    for rid, (_, max_tokens) in rids.items():
        n = len(outs[rid])
        assert 1 <= n <= max_tokens
        if eng.reasons[rid] == "length":  # type: ignore[attr-defined]
            assert n == max_tokens
        else:
            assert outs[rid][-1] == SIM_EOS
    sched = eng.scheduler
    cached = sched.ledger.tree.total_size if sched.ledger.tree is not None else 0
    assert sched.ledger.allocator.num_free + cached == capacity  # finished KV is free or in the prefix cache
    assert sched.ledger.protected == 0  # nothing is locked once every request is gone
    # Peak admission is exact for the worst case: the pool is never over-committed, and each
    # step's running set fit by construction.
    for plan in eng.runner.plans:  # type: ignore[attr-defined]
        assert int(plan.query_lens[plan.query_lens > 1].sum()) <= budget or plan.query_lens.max() <= budget


def test_chunked_prefill_shares_steps_with_decodes():
    eng = make_engine(10_000, max_prefill_tokens=64)
    short = eng.add_request([5, 6, 7], SamplingParams(max_tokens=50))
    eng.step()  # short prefills and samples its first token
    long = eng.add_request(np.arange(300) + 3, SamplingParams(max_tokens=4))
    plans_before = len(eng.runner.plans)  # type: ignore[attr-defined]
    for _ in range(5):
        eng.step()
    plans = eng.runner.plans[plans_before:]  # type: ignore[attr-defined]
    # 300 prompt tokens in 64-token chunks: 5 chunks (64*4 + 44), each beside short's decode.
    chunk_sizes = [int(p.query_lens[1]) for p in plans]
    assert chunk_sizes == [64, 64, 64, 64, 44]
    assert all(int(p.query_lens[0]) == 1 for p in plans)
    # Only the last chunk samples for the long request.
    assert [len(p.sample_rows) for p in plans] == [1, 1, 1, 1, 2]
    assert long.num_output == 1 and short.num_output == 6
    outs = run_all(eng)
    assert len(outs[long.rid]) == 3


def test_prefill_first_new_request_runs_next_step():
    eng = make_engine(10_000, max_prefill_tokens=256)
    a = eng.add_request([5] * 10, SamplingParams(max_tokens=100))
    for _ in range(3):
        eng.step()
    b = eng.add_request([7] * 20, SamplingParams(max_tokens=5))
    eng.step()
    assert b.num_output == 1 and b.first_token_time is not None
    assert a.num_output == 4


def _burst(stall: float) -> tuple[EngineCore, object, list[object]]:
    """One request decoding, then a burst of 6 prompts of 64 tokens against a 128-token budget."""
    eng = make_engine(10_000, max_prefill_tokens=128, max_decode_stall=stall, speculative_tokens=0)
    a = eng.add_request([5] * 10, SamplingParams(max_tokens=100))
    eng.step()
    burst = [eng.add_request(np.arange(64) + 100 * i + 3, SamplingParams(max_tokens=4)) for i in range(6)]
    return eng, a, burst


def test_a_burst_of_prompts_goes_before_decode_rows_within_the_stall_bound():
    eng, a, burst = _burst(stall=1000.0)
    for _ in range(2):  # 2 prompts per step; 4 of the 6 still wait after the first, 2 after the second
        eng.step()
        plan = eng.runner.plans[-1]  # type: ignore[attr-defined]
        assert int(plan.query_lens.min()) == 64, "a decode row ran while prompts waited"
    assert a.num_output == 1 and sum(r.num_output for r in burst) == 4
    eng.step()  # the last two prompts: nobody waits any more, so the decode row rides along again
    assert int(eng.runner.plans[-1].query_lens.min()) == 1 and a.num_output == 2  # type: ignore[attr-defined]
    assert [r.num_output for r in burst] == [2, 2, 2, 2, 1, 1]


def test_a_decode_row_stalled_for_the_bound_runs_in_the_burst():
    eng, a, burst = _burst(stall=1000.0)
    eng.step()
    assert a.num_output == 1
    a.last_token_time -= 1000.0  # its newest token is now as old as the bound
    eng.step()
    assert a.num_output == 2, "a request stalled for max_decode_stall got no row"
    assert eng.scheduler.waiting, "the burst was over: this did not test the bound"


def test_no_decode_stall_when_the_bound_is_zero():
    eng, a, _ = _burst(stall=0.0)
    for _ in range(3):
        eng.step()
        assert int(eng.runner.plans[-1].query_lens.min()) == 1  # type: ignore[attr-defined]
    assert a.num_output == 4


def test_outputs_independent_of_batching():
    solo = make_engine(10_000)
    r = solo.add_request([11, 12, 13, 14], SamplingParams(max_tokens=20))
    ref = run_all(solo)[r.rid]
    eng = make_engine(400, max_prefill_tokens=7, max_running_requests=3)
    rids = [eng.add_request(np.arange(n) + 20, SamplingParams(max_tokens=30)).rid for n in (50, 9, 33)]
    target = eng.add_request([11, 12, 13, 14], SamplingParams(max_tokens=20))
    rids.append(eng.add_request([3] * 60, SamplingParams(max_tokens=8)).rid)
    outs = run_all(eng)
    assert outs[target.rid] == ref


def test_admission_waits_until_it_fits():
    eng = make_engine(100)
    a = eng.add_request([3] * 40, SamplingParams(max_tokens=40))
    b = eng.add_request([3] * 30, SamplingParams(max_tokens=30))
    eng.step()
    # 40+40 = 80 resident+left, adding b (60) would exceed 100: b waits.
    assert [r.rid for r in eng.scheduler.running] == [a.rid]
    assert list(eng.scheduler.waiting) == [b]
    outs = run_all(eng)
    assert a.num_output == 40 and len(outs[b.rid]) == 30


def test_rejections_are_clear():
    eng = make_engine(100)
    with pytest.raises(RequestRejected, match="KV cache capacity of 100"):
        eng.add_request([3] * 90, SamplingParams(max_tokens=20))
    with pytest.raises(RequestRejected, match="empty"):
        eng.add_request([], SamplingParams(max_tokens=2))
    with pytest.raises(RequestRejected, match=r"\[0, 32000\)"):
        eng.add_request([40000], SamplingParams(max_tokens=2))
    small_ctx = EngineCore(EngineConfig.build(model="sim", max_total_tokens=1000, max_model_len=50))
    with pytest.raises(RequestRejected, match="context length of 50"):
        small_ctx.add_request([3] * 40, SamplingParams(max_tokens=20))
    assert not eng.has_work


def test_abort_returns_slots_at_once():
    eng = make_engine(1000)
    a = eng.add_request([3] * 100, SamplingParams(max_tokens=200))
    b = eng.add_request([4] * 50, SamplingParams(max_tokens=200))
    c = eng.add_request([4] * 700, SamplingParams(max_tokens=200))  # waits: peak 850 + 3*200 > 1000
    for _ in range(3):
        eng.step()
    used = lambda: eng.scheduler.stats().slots_used  # noqa: E731 - held by running requests
    assert used() == 100 + 50 + 2 * 2
    eng.abort(a.rid)
    eng.abort(c.rid)
    assert used() == 50 + 2  # a's KV went to the prefix cache, unlocked (evictable), not in use
    assert [r.rid for r in eng.scheduler.running] == [b.rid] and not eng.scheduler.waiting
    eng.scheduler.check_invariants()
    eng.abort(b.rid)
    assert used() == 0 and not eng.has_work
    assert eng.scheduler.ledger.allocator.num_free + eng.scheduler.ledger.evictable == 1000
    assert eng.abort("nope") is None


def test_stats_report_headroom():
    eng = make_engine(1000)
    eng.add_request([3] * 100, SamplingParams(max_tokens=100))
    eng.step()
    s = eng.scheduler.stats()
    assert (s.running, s.waiting, s.capacity) == (1, 0, 1000)
    assert s.slots_used == 100 and s.headroom == 1000 - 200


def test_requests_waiting_for_a_prefix_in_flight_do_not_stall_decodes():
    """A group sharing a long prompt prefix: the siblings wait for the first to put the prefix in
    the cache, not for prefill budget, so the decoding request keeps its row."""
    eng = make_engine(10_000, max_prefill_tokens=128, max_decode_stall=1000.0, speculative_tokens=0)
    a = eng.add_request([5] * 10, SamplingParams(max_tokens=100))
    eng.step()
    prefix = list(np.arange(200) + 3)
    group = [eng.add_request(prefix + [900 + i] * 8, SamplingParams(max_tokens=4)) for i in range(4)]
    for _ in range(2):  # the first of the group prefills its 208 tokens in two chunks
        eng.step()
        assert int(eng.runner.plans[-1].query_lens.min()) == 1  # type: ignore[attr-defined]
    assert a.num_output == 3 and group[0].num_output == 1 and eng.scheduler.waiting
