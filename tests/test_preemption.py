"""Retraction under ``--admission ratio`` on the sim runner: the victim is the running request
cheapest to recompute (fewest tokens no other running request holds), ties to the tenant furthest
over its share, then the last admitted; ``--retract-victim last`` keeps the last-admitted rule.
Whatever is retracted, every request still gets all its tokens and no KV slot leaks (the engine
checks the ledger after every step); the counters reach the Prometheus series."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockgate.config import EngineConfig
from lockgate.engine.core import EngineCore
from lockgate.runner.sim_runner import SimRunner
from lockgate.sampling import SamplingParams


def make_engine(rule: str, capacity: int) -> EngineCore:
    cfg = EngineConfig.build(model="sim", max_total_tokens=capacity, sim_step_ms=0.0, sim_token_ms=0.0,
                             admission="ratio", init_new_token_ratio=0.05, min_new_token_ratio=0.05,
                             retract_victim=rule, speculative_tokens=0, max_queue_delay="1000000")
    return EngineCore(cfg, runner=SimRunner(cfg.model, cfg.cache), check_invariants=True)


def drive(eng: EngineCore, reqs: list[tuple[list[int], int, str]]) -> tuple[dict[str, int], list[tuple]]:
    """Run ``reqs`` (prompt, max_tokens, tenant) to the end; output tokens per request and, for
    every retraction, (each running request's (exclusive tokens, tenant counter), the index chosen)."""
    sched = eng.scheduler
    choices: list[tuple] = []
    real = sched._victim

    def watched() -> int:
        seen = [(sched.exclusive_tokens(r), sched.share.counter(r.tenant)) for r in sched.running]
        i = real()
        choices.append((seen, i))
        return i

    sched._victim = watched  # type: ignore[method-assign]
    want = {}
    for prompt, n, tenant in reqs:
        req = eng.add_request(np.array(prompt), SamplingParams(max_tokens=n, ignore_eos=True), tenant=tenant)
        want[req.rid] = n
    got = dict.fromkeys(want, 0)
    for _ in range(20_000):
        if not eng.has_work:
            break
        for ev in eng.step():
            got[ev.rid] += len(ev.new_token_ids)
    assert got == want  # every request got all its tokens, retracted or not
    assert sched.ledger.num_free + sched.ledger.evictable == sched.capacity  # nothing held at the end
    return got, choices


workload = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 120), st.integers(1, 120), st.sampled_from("ab")),
                    min_size=4, max_size=24)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(workload)
def test_the_victim_is_the_cheapest_to_recompute(spec) -> None:
    rng = np.random.default_rng(len(spec))
    prefixes = [rng.integers(3, 30000, 64).tolist() for _ in range(4)]  # shared prefixes: some KV is shared
    reqs = [(prefixes[p] + rng.integers(3, 30000, s).tolist(), n, t) for p, s, n, t in spec]
    _, choices = drive(make_engine("cost", capacity=900), reqs)
    for seen, i in choices:
        useful = [(cost, -counter, -j) for j, (cost, counter) in enumerate(seen) if cost > 0]
        if useful:
            assert (seen[i][0], -seen[i][1], -i) == min(useful), (seen, i)


def test_last_rule_retracts_the_last_admitted_and_both_rules_retract_here() -> None:
    rng = np.random.default_rng(1)
    reqs = [(rng.integers(3, 30000, int(rng.integers(16, 200))).tolist(), int(rng.integers(30, 150)), "a")
            for _ in range(24)]
    _, last = drive(make_engine("last", capacity=1200), reqs)
    assert last and all(i == len(seen) - 1 for seen, i in last)
    _, cost = drive(make_engine("cost", capacity=1200), reqs)
    assert cost  # the workload does force retraction


def test_retractions_and_recomputed_tokens_reach_the_metrics() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from lockgate.ipc.messages import EngineStats
    from lockgate.server.metrics import Metrics

    m = Metrics("m")

    def value(name: str) -> float:
        return next(s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples
                    if s.name == name)

    assert value("lockgate:num_preemptions_total") == 0 and value("lockgate:recomputed_prompt_tokens_total") == 0
    base = dict(running=1, waiting=0, slots_used=0, slots_free=10, slots_evictable=0, capacity=10, headroom=10,
                num_steps=1)
    m.update_stats(EngineStats(**base, retractions=2, recomputed_tokens=40))
    m.update_stats(EngineStats(**base, retractions=3, recomputed_tokens=55))
    assert value("lockgate:num_preemptions_total") == 3 and value("lockgate:recomputed_prompt_tokens_total") == 55
