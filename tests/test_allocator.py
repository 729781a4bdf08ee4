"""SlotAllocator: contiguous-first allocation, scattered fallback, error paths that change
nothing, and a stateful comparison against a plain Python set model."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lockgate.kvcache import OutOfSlots, SlotAllocator


def snapshot(a: SlotAllocator) -> tuple[int, np.ndarray]:
    return a.num_free, a.is_free(np.arange(a.capacity))


def is_run(slots: np.ndarray) -> bool:
    return slots.size == 0 or bool(np.array_equal(slots, np.arange(slots[0], slots[0] + slots.size)))


def test_fresh_pool_allocates_contiguous_runs() -> None:
    a = SlotAllocator(100)
    s = a.alloc(10)
    assert s.dtype == np.int64
    np.testing.assert_array_equal(s, np.arange(10))
    np.testing.assert_array_equal(a.alloc(5), np.arange(10, 15))
    assert (a.num_free, a.num_used) == (85, 15)
    assert not a.is_free(s).any()
    a.check_invariants()


def test_alloc_zero_and_negative() -> None:
    a = SlotAllocator(4)
    z = a.alloc(0)
    assert z.shape == (0,) and z.dtype == np.int64
    assert a.num_free == 4
    with pytest.raises(ValueError):
        a.alloc(-1)
    a.free(np.zeros(0, dtype=np.int64))  # no-op
    assert a.num_free == 4


def test_fragmented_pool_falls_back_to_lowest_scattered_slots() -> None:
    a = SlotAllocator(20)
    a.alloc(20)
    a.free(np.arange(0, 20, 2))  # every even slot free: no run longer than 1
    s = a.alloc(3)
    np.testing.assert_array_equal(s, [0, 2, 4])
    assert not a.is_free(s).any()
    assert a.num_free == 7
    a.check_invariants()


def test_prefers_a_run_over_scattered_and_picks_best_fit() -> None:
    a = SlotAllocator(30)
    a.alloc(30)
    a.free(np.array([29]))
    a.free(np.arange(0, 8))  # run of 8
    a.free(np.arange(10, 13))  # run of 3
    a.free(np.arange(16, 26))  # run of 10
    s = a.alloc(3)
    np.testing.assert_array_equal(s, [10, 11, 12])  # the tightest run; long runs stay intact
    s = a.alloc(10)
    np.testing.assert_array_equal(s, np.arange(16, 26))
    s = a.alloc(5)
    assert is_run(s) and s[0] >= 0 and s[-1] < 8
    s = a.alloc(3)  # exactly what is left of the run of 8
    assert is_run(s) and s[-1] < 8
    assert a.num_free == 1 and a.is_free(np.array([29]))[0]
    a.check_invariants()


def test_out_of_slots_reports_and_changes_nothing() -> None:
    a = SlotAllocator(16)
    a.alloc(10)
    before = snapshot(a)
    with pytest.raises(OutOfSlots, match=r"requested 7 .* 6 .*free"):
        a.alloc(7)
    after = snapshot(a)
    assert before[0] == after[0]
    np.testing.assert_array_equal(before[1], after[1])
    assert a.alloc(6).size == 6
    with pytest.raises(OutOfSlots):
        a.alloc(1)
    a.check_invariants()


def test_bad_free_raises_and_changes_nothing() -> None:
    a = SlotAllocator(16)
    s = a.alloc(8)
    a.free(s[:2])
    before = snapshot(a)
    cases = [
        s[:2],  # double free
        np.array([s[5], s[0]]),  # one held, one already free
        np.array([s[4], s[5], s[4]]),  # duplicate in one call
        np.array([s[4], 16]),  # out of range
        np.array([-1]),
        np.array([0.0, 1.0]),  # not integers
    ]
    for bad in cases:
        with pytest.raises(ValueError):
            a.free(bad)
        after = snapshot(a)
        assert after[0] == before[0]
        np.testing.assert_array_equal(after[1], before[1])
        a.check_invariants()
    a.free(s[2:])
    assert a.num_free == 16


def test_check_invariants_catches_corruption() -> None:
    a = SlotAllocator(8)
    a.alloc(3)
    a.check_invariants()
    a._num_free += 1  # simulate a bookkeeping bug
    with pytest.raises(AssertionError, match="num_free"):
        a.check_invariants()


def test_is_free_range_checked() -> None:
    a = SlotAllocator(4)
    with pytest.raises(ValueError):
        a.is_free(np.array([4]))


def test_fast_enough_for_a_large_pool() -> None:
    # 100k slots, a mix of decode-sized and prompt-sized allocations with frees in between
    # (fragmenting the pool), thousands of calls: must stay well under a second or two.
    a = SlotAllocator(100_000)
    rng = np.random.default_rng(0)
    held: list[np.ndarray] = []
    t0 = time.perf_counter()
    for i in range(3000):
        n = int(rng.integers(1, 32)) if i % 10 else int(rng.integers(100, 2000))
        if n > a.num_free:
            while held:
                a.free(held.pop(int(rng.integers(len(held)))))
                if a.num_free >= n:
                    break
        held.append(a.alloc(n))
        if rng.random() < 0.4:
            a.free(held.pop(int(rng.integers(len(held)))))
    elapsed = time.perf_counter() - t0
    a.check_invariants()
    assert elapsed < 3.0, f"3000 alloc/free rounds took {elapsed:.2f}s"


class AllocatorMachine(RuleBasedStateMachine):
    """Allocator vs. a set-of-free-slots model; every holding is a list of owned slots."""

    @initialize(capacity=st.integers(1, 48))
    def setup(self, capacity: int) -> None:
        self.alloc = SlotAllocator(capacity)
        self.free_set: set[int] = set(range(capacity))
        self.holdings: list[np.ndarray] = []

    def _longest_run(self) -> int:
        best = cur = 0
        for s in range(self.alloc.capacity):
            cur = cur + 1 if s in self.free_set else 0
            best = max(best, cur)
        return best

    @rule(n=st.integers(0, 50))
    def alloc_n(self, n: int) -> None:
        if n > len(self.free_set):
            with pytest.raises(OutOfSlots):
                self.alloc.alloc(n)
            return
        longest = self._longest_run()
        lowest = sorted(self.free_set)[:n]
        s = self.alloc.alloc(n)
        assert s.dtype == np.int64 and s.shape == (n,)
        got = set(s.tolist())
        assert len(got) == n, "duplicate slots returned"
        assert got <= self.free_set, "returned a slot that is held"
        if longest >= n:
            assert is_run(s), f"a run of {longest} existed but got scattered {s}"
        else:
            assert s.tolist() == lowest
        self.free_set -= got
        if n:
            self.holdings.append(s)

    @precondition(lambda self: self.holdings)
    @rule(i=st.integers(0, 10**6), split=st.floats(0, 1))
    def free_some(self, i: int, split: float) -> None:
        h = self.holdings.pop(i % len(self.holdings))
        k = int(round(split * h.size))
        part, rest = h[:k], h[k:]
        self.alloc.free(part)
        self.free_set |= set(part.tolist())
        if rest.size:
            self.holdings.append(rest)

    @precondition(lambda self: self.free_set)
    @rule(i=st.integers(0, 10**6), j=st.integers(0, 10**6))
    def double_free_rejected(self, i: int, j: int) -> None:
        freed = sorted(self.free_set)[i % len(self.free_set)]
        bad = [freed]
        if self.holdings:
            h = self.holdings[j % len(self.holdings)]
            bad = [int(h[0]), freed]
        with pytest.raises(ValueError):
            self.alloc.free(np.array(bad))

    @precondition(lambda self: self.holdings)
    @rule(i=st.integers(0, 10**6))
    def duplicate_free_rejected(self, i: int) -> None:
        h = self.holdings[i % len(self.holdings)]
        with pytest.raises(ValueError):
            self.alloc.free(np.concatenate([h, h[:1]]))

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "alloc"):
            return
        a = self.alloc
        a.check_invariants()
        assert a.num_free + a.num_used == a.capacity
        assert a.num_free == len(self.free_set)
        expect = np.zeros(a.capacity, dtype=bool)
        expect[list(self.free_set)] = True
        np.testing.assert_array_equal(a.is_free(np.arange(a.capacity)), expect)


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
