"""Peak-usage admission: the closed-form peak equals a step-by-step simulation, the
admission helpers agree with it, and a batch gated by it never runs out of real slots."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockgate.kvcache import OutOfSlots, SlotAllocator
from lockgate.scheduler.admission import peak_usage


def brute_peak(resident: list[int], left: list[int]) -> int:
    """Simulate t = 0, 1, 2, ...: request i holds resident_i + t while t <= left_i."""
    if not resident:
        return 0
    return max(
        sum(r + t for r, lft in zip(resident, left, strict=True) if t <= lft)
        for t in range(max(left) + 1)
    )


rows = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), max_size=12)


def split(batch: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    res = np.array([r for r, _ in batch], dtype=np.int64)
    lft = np.array([lft for _, lft in batch], dtype=np.int64)
    return res, lft


@given(rows)
def test_peak_matches_step_by_step_simulation(batch: list[tuple[int, int]]) -> None:
    res, lft = split(batch)
    assert peak_usage(res, lft) == brute_peak(res.tolist(), lft.tolist())


def test_peak_hand_example() -> None:
    # resident [5, 2], left [1, 3]: usage by step t = 7, 9, 4, 5 -> peak 9 at t = 1.
    assert peak_usage(np.array([5, 2]), np.array([1, 3])) == 9
    assert brute_peak([5, 2], [1, 3]) == 9


def test_peak_degenerate_cases() -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert peak_usage(empty, empty) == 0
    assert peak_usage(np.array([0, 0]), np.array([0, 0])) == 0
    assert peak_usage(np.array([3, 4]), np.array([0, 0])) == 7  # only the current usage
    assert peak_usage(np.array([0]), np.array([5])) == 5
    assert peak_usage(np.array([10, 1]), np.array([0, 2])) == 11  # t=0 dominates the finisher


def test_input_validation() -> None:
    with pytest.raises(ValueError):
        peak_usage(np.array([1, 2]), np.array([1]))
    with pytest.raises(ValueError):
        peak_usage(np.array([-1]), np.array([1]))


def admit_prefix(capacity: int, res: np.ndarray, lft: np.ndarray, c_res: np.ndarray, c_lft: np.ndarray) -> int:
    """How many candidates fit one after another (the scheduler's rule: stop at the first misfit)."""
    for k, (r, left) in enumerate(zip(c_res.tolist(), c_lft.tolist(), strict=True)):
        res, lft = np.append(res, r), np.append(lft, left)
        if peak_usage(res, lft) > capacity:
            return k
    return len(c_res)


@given(rows, rows)
def test_peak_never_decreases_when_requests_join(batch: list[tuple[int, int]], more: list[tuple[int, int]]) -> None:
    """Why stopping at the first candidate that does not fit loses nothing behind it in order."""
    res, lft = split(batch)
    before = peak_usage(res, lft)
    for r, left in more:
        res, lft = np.append(res, r), np.append(lft, left)
        after = peak_usage(res, lft)
        assert after >= before
        before = after


# ---------------------------------------------------------------------------------------
# A simulated engine: admission gates entry, the allocator hands out real slot indices.
# ---------------------------------------------------------------------------------------


@dataclass
class SimRequest:
    prompt: int
    max_tokens: int
    arrival: int
    generated: int = 0
    slots: list[np.ndarray] = field(default_factory=list)


Admit = Callable[[list[SimRequest], list[SimRequest], SlotAllocator], int]


def peak_admit(capacity: int) -> Admit:
    def admit(running: list[SimRequest], waiting: list[SimRequest], _: SlotAllocator) -> int:
        res = np.array([r.prompt + r.generated for r in running], dtype=np.int64)
        lft = np.array([r.max_tokens - r.generated for r in running], dtype=np.int64)
        c_res = np.array([r.prompt for r in waiting], dtype=np.int64)
        c_lft = np.array([r.max_tokens for r in waiting], dtype=np.int64)
        return admit_prefix(capacity, res, lft, c_res, c_lft)

    return admit


def naive_admit(running: list[SimRequest], waiting: list[SimRequest], pool: SlotAllocator) -> int:
    """Admits whatever fits in the free slots right now (ignores future growth)."""
    free, k = pool.num_free, 0
    for r in waiting:
        if r.prompt > free:
            break
        free -= r.prompt
        k += 1
    return k


def simulate(capacity: int, requests: list[SimRequest], admit: Admit, p_stop: float, seed: int) -> int:
    """Run the batch to completion; returns the highest slot usage seen."""
    rng = np.random.default_rng(seed)
    pool = SlotAllocator(capacity)
    pending = sorted(requests, key=lambda r: r.arrival)
    waiting: list[SimRequest] = []
    running: list[SimRequest] = []
    high = 0
    for step in range(100_000):
        if not (pending or waiting or running):
            return high
        while pending and pending[0].arrival <= step:
            waiting.append(pending.pop(0))
        # Admit a prefix of the FCFS queue; prompt slots are taken on admission.
        k = admit(running, waiting, pool)
        for r in waiting[:k]:
            r.slots.append(pool.alloc(r.prompt))
        running += waiting[:k]
        del waiting[:k]
        # One decode step: one new slot for every running request.
        new = pool.alloc(len(running))
        for r, s in zip(running, new, strict=True):
            r.slots.append(np.array([s]))
            r.generated += 1
        high = max(high, pool.num_used)
        # Finished (max_tokens reached) or stopped early (EOS, abort) requests leave.
        still: list[SimRequest] = []
        for r in running:
            if r.generated >= r.max_tokens or rng.random() < p_stop:
                pool.free(np.concatenate(r.slots))
                r.slots.clear()
            else:
                still.append(r)
        running = still
        assert pool.num_free + pool.num_used == capacity
        assert pool.num_used == sum(sum(s.size for s in r.slots) for r in running)
        pool.check_invariants()
    raise AssertionError("simulation did not terminate")


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, list[SimRequest]]:
    capacity = draw(st.integers(16, 400))
    n = draw(st.integers(1, 25))
    reqs = []
    for _ in range(n):
        kind = draw(st.sampled_from(["short", "long_prompt", "long_output", "huge"]))
        if kind == "short":
            prompt, out = draw(st.integers(1, 8)), draw(st.integers(1, 8))
        elif kind == "long_prompt":
            prompt, out = draw(st.integers(capacity // 4, capacity // 2)), draw(st.integers(1, 8))
        elif kind == "long_output":
            prompt, out = draw(st.integers(1, 8)), draw(st.integers(capacity // 4, capacity // 2))
        else:  # a request that alone nearly fills the pool
            total = draw(st.integers(capacity - 4, capacity))
            prompt = draw(st.integers(1, total - 1))
            out = total - prompt
        reqs.append(SimRequest(prompt=prompt, max_tokens=max(out, 1), arrival=draw(st.integers(0, 30))))
    return capacity, reqs


@settings(max_examples=150, deadline=None)
@given(workloads(), st.sampled_from([0.0, 0.0, 0.05, 0.3]), st.integers(0, 2**32 - 1))
def test_peak_admission_never_runs_out(workload: tuple[int, list[SimRequest]], p_stop: float, seed: int) -> None:
    capacity, reqs = workload
    high = simulate(capacity, reqs, peak_admit(capacity), p_stop, seed)  # alloc never raises
    assert high <= capacity


def test_bound_is_tight_a_single_request_may_fill_the_pool() -> None:
    high = simulate(10, [SimRequest(prompt=4, max_tokens=6, arrival=0)], peak_admit(10), 0.0, 0)
    assert high == 10


def test_simulation_detects_oom_under_naive_admission() -> None:
    # Two requests whose prompts fit now but whose outputs do not fit together: the naive
    # rule admits both and runs out mid-decode; peak admission serializes them.
    def make() -> list[SimRequest]:
        return [SimRequest(prompt=2, max_tokens=8, arrival=0) for _ in range(2)]

    with pytest.raises(OutOfSlots):
        simulate(10, make(), naive_admit, 0.0, 0)
    assert simulate(10, make(), peak_admit(10), 0.0, 0) == 10
