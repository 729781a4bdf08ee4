"""Fair share between tenants in the scheduler (``--fairness vtc``), on the sim runner.

The virtual token counter (lockgate/scheduler/fairness.py): a heavy tenant cannot take a light
one's share while both are backlogged, weights divide the share, the queue policy still orders
within a tenant, overdue requests go first (the tenants by their counters), and the service difference between two
backlogged tenants stays within the bound derived in fairness.py, whatever the arrivals.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lockgate.config import EngineConfig
from lockgate.engine.core import EngineCore
from lockgate.runner.sim_runner import SimRunner
from lockgate.sampling import SamplingParams
from lockgate.scheduler.fairness import TenantShare
from lockgate.scheduler.request import Request


def make_engine(capacity: int = 4000, **sched) -> EngineCore:  # type: ignore[no-untyped-def]
    sched.setdefault("max_queue_delay", "1000000")
    cfg = EngineConfig.build(model="sim", max_total_tokens=capacity, sim_step_ms=0.0, sim_token_ms=0.0, **sched)
    return EngineCore(cfg, runner=SimRunner(cfg.model, cfg.cache), check_invariants=True)


def prompt(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(3, 30000, n)  # random tokens: no shared prefixes between requests


def served(eng: EngineCore) -> dict[str, int]:
    """Output tokens per tenant while both tenants of a 10:1 load are backlogged."""
    rng = np.random.default_rng(0)
    for i in range(110):
        tenant = "light" if i % 11 == 0 else "heavy"
        eng.add_request(prompt(rng, 32), SamplingParams(max_tokens=32, ignore_eos=True), tenant=tenant)
    out = {"heavy": 0, "light": 0}
    tenant_of = {r.rid: r.tenant for r in eng.scheduler.waiting}
    while len(eng.scheduler.share.waiting) == 2:
        for ev in eng.step():
            out[tenant_of[ev.rid]] += len(ev.new_token_ids)
    return out


def test_a_heavy_tenant_does_not_take_a_light_ones_share():
    fair = served(make_engine(max_running_requests=8, fairness="vtc"))
    share = fair["light"] / (fair["light"] + fair["heavy"])
    assert 0.4 <= share <= 0.6, fair
    fcfs = served(make_engine(max_running_requests=8, fairness="none"))
    assert fcfs["light"] / (fcfs["light"] + fcfs["heavy"]) < 0.2, fcfs  # arrival order: ~1 in 11


def test_weights_divide_the_share():
    got = served(make_engine(max_running_requests=8, fairness="vtc", tenant_weight=("heavy=3",)))
    share = got["heavy"] / (got["light"] + got["heavy"])
    assert 0.65 <= share <= 0.85, got  # 3 : 1


def test_the_policy_orders_within_a_tenant():
    share = TenantShare()
    reqs = [Request(f"r{i}", np.arange(10), SamplingParams(max_tokens=4), tenant=t)
            for i, t in enumerate("aabba")]
    for r in reqs:
        share.joined(r.tenant)
    ranked = [reqs[4], reqs[0], reqs[3], reqs[1], reqs[2]]  # as a policy might rank them
    order = [r.rid for r in share.interleave(ranked)]
    assert order == ["r4", "r3", "r0", "r2", "r1"]  # a's in the policy's order, alternating with b's
    share.generated("a", 100)
    assert [r.rid for r in share.interleave(ranked)][:2] == ["r3", "r2"]  # b is behind: both of b's first


def test_lifting_banks_no_credit_for_idle_time():
    share = TenantShare()
    share.joined("busy")
    share.generated("busy", 500)
    share.joined("new")  # joins a backlog whose least counter is 1000
    assert share.counter("new") == share.counter("busy") == 1000
    share.left("new")
    share.left("busy")
    share.generated("busy", 50)
    share.joined("new")  # nobody backlogged: lifted to the last one to leave
    assert share.counter("new") == 1000
    share.generated("new", 20)
    share.joined("busy")  # its own counter (1100) is above the reference (1040): kept
    assert share.counter("busy") == 1100


def test_the_queue_delay_bound_orders_a_tenants_own_requests_not_the_tenants():
    """Within a tenant an overdue request goes first whatever the policy (``lof`` would keep a short
    request behind every longer one forever); across tenants the counters decide, so a tenant whose
    flood went overdue does not take the turn of one that sends few."""
    eng = make_engine(max_running_requests=1, fairness="vtc", max_queue_delay="5", schedule_policy="lof")
    rng = np.random.default_rng(1)

    def add(tenant: str, max_tokens: int = 4) -> Request:
        return eng.add_request(prompt(rng, 8), SamplingParams(max_tokens=max_tokens, ignore_eos=True), tenant=tenant)

    first = add("a", 40)
    eng.step()
    short = add("a", 2)  # lof ranks it behind every longer request of its tenant
    while eng.scheduler.num_steps < 36:
        eng.step()
    longer = add("a", 30)  # ranked first by lof, but not overdue when `first` finishes
    while not first.finished:
        eng.step()
    eng.step()
    assert short.admit_time is not None and longer.admit_time is None
    # a flood gone overdue does not go before a less-served tenant's fresh request
    eng = make_engine(max_running_requests=1, fairness="vtc", max_queue_delay="5")
    first = add("heavy", 40)
    eng.step()
    heavy = [add("heavy") for _ in range(5)]
    while eng.scheduler.num_steps < 36:
        eng.step()
    light = add("light")  # fresh: not overdue, but its tenant has had no service
    while not first.finished:
        eng.step()
    eng.step()
    assert light.admit_time is not None and heavy[0].admit_time is None
    while not light.finished:
        eng.step()
    eng.step()
    assert heavy[0].admit_time is not None  # then the heavy tenant's oldest, overdue request


@settings(max_examples=30, deadline=None)
@given(
    arrivals=st.lists(st.tuples(st.integers(0, 60), st.sampled_from("fg"), st.integers(1, 64), st.integers(1, 24)),
                      min_size=2, max_size=60),
    weight_g=st.sampled_from([1.0, 2.0, 0.5]),
    max_running=st.integers(1, 8),
    budget=st.sampled_from([16, 64, 1024]),
    policy=st.sampled_from(["fcfs", "lpm", "lof", "random"]),
)
def test_backlogged_tenants_service_difference_is_bounded(arrivals, weight_g, max_running, budget, policy):
    """The bound of fairness.py: while tenants f and g are both backlogged, their counters differ by
    at most D = max_u (wp * L + wq * U) / w_u (L: the longest prompt, U = max_running * the largest
    max_tokens: the most output running requests can still generate), so over any interval in which
    both stay backlogged their weighted service, counted here from the requests themselves (a prompt
    when admitted, each token generated), differs by at most 2 * D."""
    eng = make_engine(capacity=600, max_running_requests=max_running, max_prefill_tokens=budget, fairness="vtc",
                      schedule_policy=policy, tenant_weight=(f"g={weight_g}",))
    weights = {"f": 1.0, "g": weight_g}
    wp, wq = 1.0, 2.0
    L = max(p for _, _, p, _ in arrivals)
    U = max_running * max(m for _, _, _, m in arrivals)
    D = max((wp * L + wq * U) / w for w in weights.values())
    rng = np.random.default_rng(0)
    reqs: list[Request] = []
    share = eng.scheduler.share
    interval: list[float] = []  # S_f - S_g at each step of the current interval in which both are backlogged
    for step in range(10_000):
        for at, tenant, p, m in arrivals:
            if at == step:
                reqs.append(eng.add_request(prompt(rng, p), SamplingParams(max_tokens=m, ignore_eos=True),
                                            tenant=tenant))
        if not eng.has_work and step > 60:
            break
        eng.step()
        if len(share.waiting) == 2:
            assert abs(share.counter("f") - share.counter("g")) <= D
            s = {"f": 0.0, "g": 0.0}
            for r in reqs:
                s[r.tenant] += ((wp * r.num_prompt if r.admit_time is not None else 0.0)
                                + wq * r.num_output) / weights[r.tenant]
            interval.append(s["f"] - s["g"])
            assert max(interval) - min(interval) <= 2 * D
        else:
            interval = []
    assert not eng.has_work
