"""RadixCache: edge splits, insert's already-cached count, locks vs. eviction, LRU order,
sizes, error paths, speed on long prompts, and a stateful comparison against a naive
model (a dict from every cached prefix to the slot of its last token)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lockgate.kvcache.radix import RadixCache, RadixNode


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def path_of(tree: RadixCache, node: RadixNode) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, slots) spelled by the path from the root to ``node``."""
    keys, vals = [], []
    x: RadixNode | None = node
    while x is not None and x is not tree.root:
        keys.append(x.key)
        vals.append(x.value)
        x = x.parent
    assert x is tree.root, "node is detached from the tree"
    if not keys:
        return arr(), arr()
    return np.concatenate(keys[::-1]), np.concatenate(vals[::-1])


def walk(tree: RadixCache) -> list[RadixNode]:
    out, stack = [], list(tree.root.children.values())
    while stack:
        x = stack.pop()
        out.append(x)
        stack.extend(x.children.values())
    return out


def test_empty_insert_and_match() -> None:
    t = RadixCache()
    assert t.insert([], []) == 0
    assert t.insert(arr(), arr()) == 0
    m = t.match_prefix([])
    assert m.length == 0 and m.node is t.root and m.slots.shape == (0,) and m.slots.dtype == np.int64
    t.insert(arr(1, 2), arr(5, 6))
    m = t.match_prefix(arr(9))
    assert m.length == 0 and m.node is t.root
    assert t.total_size == 2
    t.check_invariants()


def test_match_splits_edge_and_keeps_values_aligned() -> None:
    t = RadixCache()
    assert t.insert(arr(1, 2, 3, 4), arr(10, 11, 12, 13)) == 0
    leaf = t.match_prefix(arr(1, 2, 3, 4)).node
    m = t.match_prefix(arr(1, 2, 9))
    assert m.length == 2
    np.testing.assert_array_equal(m.slots, [10, 11])
    np.testing.assert_array_equal(m.node.key, [1, 2])
    np.testing.assert_array_equal(m.node.value, [10, 11])
    assert list(t.root.children) == [1] and t.root.children[1] is m.node
    # the existing node object keeps the tail, so a holder's reference still ends at depth 4
    assert m.node.children == {3: leaf} and leaf.parent is m.node
    np.testing.assert_array_equal(leaf.key, [3, 4])
    np.testing.assert_array_equal(leaf.value, [12, 13])
    assert t.total_size == 4 and t.num_nodes == 2
    full = t.match_prefix([1, 2, 3, 4, 5])
    assert full.length == 4 and full.node is leaf
    np.testing.assert_array_equal(full.slots, [10, 11, 12, 13])
    t.check_invariants()


def test_insert_returns_already_cached_count() -> None:
    t = RadixCache()
    assert t.insert(arr(1, 2, 3), arr(10, 11, 12)) == 0
    # diverges inside the edge after 2 tokens: split, the tree keeps 10, 11
    assert t.insert(arr(1, 2, 5, 6), arr(20, 21, 22, 23)) == 2
    np.testing.assert_array_equal(t.match_prefix(arr(1, 2, 5, 6)).slots, [10, 11, 22, 23])
    np.testing.assert_array_equal(t.match_prefix(arr(1, 2, 3)).slots, [10, 11, 12])
    assert sorted(t.all_slots().tolist()) == [10, 11, 12, 22, 23]
    # fully cached, ending inside an edge: nothing new, no split needed
    nodes = t.num_nodes
    assert t.insert(arr(1), arr(30)) == 1
    assert t.num_nodes == nodes
    # fully cached along whole edges, then extended
    assert t.insert(arr(1, 2, 3), arr(40, 41, 42)) == 3
    assert t.insert(arr(1, 2, 3, 7, 8), arr(50, 51, 52, 53, 54)) == 3
    np.testing.assert_array_equal(t.match_prefix(arr(1, 2, 3, 7, 8)).slots, [10, 11, 12, 53, 54])
    assert t.total_size == 7
    t.check_invariants()


def test_insert_copies_caller_arrays() -> None:
    t = RadixCache()
    toks, slots = arr(1, 2, 3), arr(10, 11, 12)
    t.insert(toks, slots)
    toks[:] = 0
    slots[:] = 0
    np.testing.assert_array_equal(t.match_prefix(arr(1, 2, 3)).slots, [10, 11, 12])


def test_bad_inputs() -> None:
    t = RadixCache()
    with pytest.raises(ValueError, match="3 tokens but 2 slots"):
        t.insert(arr(1, 2, 3), arr(1, 2))
    with pytest.raises(ValueError):
        t.insert(np.array([1.0, 2.0]), arr(1, 2))
    with pytest.raises(ValueError):
        t.match_prefix(np.zeros((2, 2), dtype=np.int64))
    assert t.total_size == 0
    t.check_invariants()


def test_sizes_follow_lock_and_unlock() -> None:
    t = RadixCache()
    t.insert(arr(1, 2, 3, 4), arr(0, 1, 2, 3))
    t.insert(arr(1, 2, 7), arr(4, 5, 6))  # tree: [1 2] -> {[3 4], [7]}
    assert (t.evictable_size, t.protected_size, t.total_size) == (5, 0, 5)
    a = t.match_prefix(arr(1, 2, 3, 4)).node
    b = t.match_prefix(arr(1, 2, 7)).node
    t.lock(a)
    assert (t.evictable_size, t.protected_size) == (1, 4)
    t.lock(b)
    assert (t.evictable_size, t.protected_size) == (0, 5)
    assert a.parent is not None and a.parent.lock_ref == 2
    t.lock(a)  # a second holder
    t.unlock(a)
    assert (t.evictable_size, t.protected_size) == (0, 5)
    t.unlock(a)
    assert (t.evictable_size, t.protected_size) == (2, 3)
    t.unlock(b)
    assert (t.evictable_size, t.protected_size) == (5, 0)
    t.check_invariants()
    t.lock(t.root)  # the root is never locked: a match of length 0 can be locked harmlessly
    t.unlock(t.root)
    assert t.root.lock_ref == 0


def test_unlock_without_lock_raises_and_changes_nothing() -> None:
    t = RadixCache()
    t.insert(arr(1, 2, 3), arr(0, 1, 2))
    leaf = t.match_prefix(arr(1, 2, 3)).node
    with pytest.raises(ValueError):
        t.unlock(leaf)
    t.lock(leaf)
    head = t.match_prefix(arr(1)).node  # split: head [1] is an ancestor, locked through the leaf
    assert head.lock_ref == 1
    with pytest.raises(ValueError):
        t.unlock(head)  # never locked directly: refusing keeps parent >= child
    assert (head.lock_ref, leaf.lock_ref, t.protected_size) == (1, 1, 3)
    t.check_invariants()
    t.unlock(leaf)
    with pytest.raises(ValueError):
        t.unlock(leaf)
    assert t.evictable_size == 3
    t.check_invariants()


def test_locked_paths_survive_evict_all() -> None:
    t = RadixCache()
    t.insert(arr(1, 2, 3, 4), arr(0, 1, 2, 3))
    t.insert(arr(1, 2, 5), arr(4, 5, 6))
    t.insert(arr(9, 9), arr(7, 8))
    keep = t.match_prefix(arr(1, 2, 3))  # splits [3 4]
    t.lock(keep.node)
    out = t.evict(10**9)
    assert sorted(out.tolist()) == [3, 6, 7, 8]
    assert out.dtype == np.int64
    assert (t.evictable_size, t.protected_size) == (0, 3)
    m = t.match_prefix(arr(1, 2, 3, 4))
    assert m.length == 3 and m.node is keep.node
    np.testing.assert_array_equal(m.slots, [0, 1, 2])
    assert t.evict(5).size == 0
    t.check_invariants()
    t.unlock(keep.node)
    assert sorted(t.evict(1).tolist()) == [2]  # the leaf [3]; its parent only if more is asked
    assert sorted(t.evict(1).tolist()) == [0, 1]  # the parent became a leaf
    assert t.total_size == 0 and t.num_nodes == 0
    t.check_invariants()


def test_evict_lru_order() -> None:
    t = RadixCache()
    t.insert(arr(1, 1), arr(0, 1))  # A
    t.insert(arr(2, 2), arr(2, 3))  # B
    t.insert(arr(3, 3), arr(4, 5))  # C
    t.match_prefix(arr(1, 1, 7))  # touch A: order is now B, C, A
    np.testing.assert_array_equal(t.evict(1), [2, 3])
    assert t.insert(arr(3, 3, 4), arr(40, 41, 6)) == 2  # touches C's path and adds a child under it
    np.testing.assert_array_equal(t.evict(2), [0, 1])  # A is older than C's path
    np.testing.assert_array_equal(t.evict(1), [6])  # children go before their parents
    np.testing.assert_array_equal(t.evict(1), [4, 5])
    assert t.evict(1).size == 0
    t.check_invariants()


def test_evict_frees_at_least_what_is_asked() -> None:
    t = RadixCache()
    for i in range(10):
        t.insert(arr(i, 100, 101), arr(3 * i, 3 * i + 1, 3 * i + 2))
    out = t.evict(7)
    assert out.size == 9  # whole leaves of 3: the third one crosses 7
    np.testing.assert_array_equal(out, np.arange(9))  # LRU: the first three inserted
    assert t.evict(0).size == 0 and t.evict(-5).size == 0
    assert t.total_size == 21
    t.check_invariants()


def test_unlock_makes_a_leaf_evictable_again() -> None:
    t = RadixCache()
    t.insert(arr(1, 2), arr(0, 1))
    n = t.match_prefix(arr(1, 2)).node
    t.lock(n)
    assert t.evict(100).size == 0
    t.unlock(n)
    np.testing.assert_array_equal(t.evict(100), [0, 1])
    t.check_invariants()


def test_heap_stays_bounded_and_compaction_mid_evict_is_safe() -> None:
    t = RadixCache()
    t._heap_slack = 0
    for i in range(50):
        t.insert(arr(i, 1, 2), arr(3 * i, 3 * i + 1, 3 * i + 2))
        t.match_prefix(arr(i, 1))  # splits: every leaf gets a parent
    for _ in range(20):
        for i in range(50):
            t.match_prefix(arr(i, 1, 2))  # each touch of an unlocked leaf pushes an entry
    assert len(t._heap) <= 2 * t.num_nodes + 1
    out = t.evict(10**9)  # parents are pushed (and the heap compacted) while evicting
    assert sorted(out.tolist()) == list(range(150))
    assert t.total_size == 0
    t.check_invariants()


def test_evicted_node_cannot_be_locked() -> None:
    t = RadixCache()
    t.insert(arr(1, 2), arr(0, 1))
    n = t.match_prefix(arr(1, 2)).node
    t.evict(2)
    with pytest.raises(ValueError, match="not in the tree"):
        t.lock(n)
    assert t.protected_size == 0
    t.check_invariants()


def test_evicting_everything_keeps_only_locked_paths() -> None:
    t = RadixCache()
    t.insert(arr(1, 2, 3), arr(0, 1, 2))
    t.insert(arr(1, 5), arr(7, 3))
    n = t.match_prefix(arr(1, 5)).node
    t.lock(n)
    assert sorted(t.evict(t.total_size).tolist()) == [1, 2]  # [2, 3] under 1 goes; 1 -> 5 is locked
    assert t.total_size == 2 and t.match_prefix(arr(1, 5)).length == 2
    t.unlock(n)
    assert sorted(t.evict(t.total_size).tolist()) == [0, 3]
    assert (t.total_size, t.num_nodes, t.all_slots().size) == (0, 0, 0)
    assert t.match_prefix(arr(1, 2)).length == 0
    t.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    t = RadixCache()
    t.insert(arr(1, 2, 3), arr(0, 1, 2))
    t.insert(arr(1, 2, 4), arr(3, 4, 5))
    t.check_invariants()
    leaf = t.match_prefix(arr(1, 2, 3)).node
    leaf.lock_ref += 1
    with pytest.raises(AssertionError, match="lock_ref"):
        t.check_invariants()
    leaf.lock_ref -= 1
    leaf.value = leaf.value.copy()
    leaf.value[0] = 0  # slot 0 already holds token 1
    with pytest.raises(AssertionError, match="more than once"):
        t.check_invariants()
    leaf.value[0] = 2
    leaf.value = np.concatenate([leaf.value, [9]])
    with pytest.raises(AssertionError, match="tokens but"):
        t.check_invariants()


def test_pretty_mentions_tokens_and_locks() -> None:
    t = RadixCache()
    t.insert(np.arange(20), np.arange(100, 120))
    t.lock(t.match_prefix(np.arange(5)).node)
    s = t.pretty()
    assert "protected=5" in s and "lock=1" in s and "+7" in s  # 15-token tail shows 8 then +7
    assert len(s.splitlines()) == 3


def test_fast_on_long_prompts() -> None:
    # 400 requests of ~3000 tokens sharing a 2000-token system prompt (and some a longer
    # few-shot block), inserted and matched back, under memory pressure: must stay quick.
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, 2000)
    shots = rng.integers(0, 32000, 500)
    t = RadixCache()
    slot = 0
    t0 = time.perf_counter()
    for i in range(400):
        tail = rng.integers(0, 32000, 1000)
        prompt = np.concatenate([system, shots, tail] if i % 2 else [system, tail])
        m = t.match_prefix(prompt)
        assert m.length >= (2000 if i else 0)
        t.lock(m.node)
        slots = np.arange(slot, slot + prompt.size, dtype=np.int64)
        slot += prompt.size
        assert t.insert(prompt, slots) == m.length
        t.unlock(m.node)
        if t.total_size > 100_000:
            t.evict(20_000)
    elapsed = time.perf_counter() - t0
    t.check_invariants()
    assert elapsed < 2.0, f"400 long-prompt match/insert rounds took {elapsed:.2f}s"


# -- stateful comparison against a naive model ---------------------------------------------

Seq = tuple[int, ...]
tokens_st = st.lists(st.integers(0, 2), max_size=10)


class RadixMachine(RuleBasedStateMachine):
    """Tree vs. ``cached``: every cached prefix -> the slot of its last token (prefix-closed)."""

    @initialize(slack=st.sampled_from([0, 64]))
    def setup(self, slack: int) -> None:
        self.tree = RadixCache()
        self.tree._heap_slack = slack  # 0: the lazy heap is compacted often, also mid-evict
        self.cached: dict[Seq, int] = {}
        self.locks: list[tuple[RadixNode, Seq]] = []  # (locked node, the prefix it ends)
        self.inserted: list[Seq] = []
        self.next_slot = 0
        self.handed: set[int] = set()  # slots the tree was given (or offered, duplicates)
        self.returned: list[int] = []  # duplicates from insert, evicted

    # model helpers

    def longest(self, seq: Seq) -> int:
        n = 0
        while n < len(seq) and seq[: n + 1] in self.cached:
            n += 1
        return n

    def model_slots(self, seq: Seq) -> list[int]:
        return [self.cached[seq[: i + 1]] for i in range(len(seq))]

    def locked_prefixes(self) -> set[Seq]:
        return {tup[: i + 1] for _, tup in self.locks for i in range(len(tup))}

    def draw_seq(self, data: st.DataObject) -> Seq:
        if self.inserted and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(self.inserted))
            cut = data.draw(st.integers(0, len(base)))
            return base[:cut] + tuple(data.draw(st.lists(st.integers(0, 2), max_size=4)))
        return tuple(data.draw(tokens_st))

    # rules

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        seq = self.draw_seq(data)
        slots = np.arange(self.next_slot, self.next_slot + len(seq), dtype=np.int64)
        self.next_slot += len(seq)
        expect = self.longest(seq)
        got = self.tree.insert(np.array(seq, dtype=np.int64), slots)
        assert got == expect
        for i in range(got, len(seq)):
            self.cached[seq[: i + 1]] = int(slots[i])
        self.handed.update(slots.tolist())
        self.returned.extend(slots[:got].tolist())  # duplicates the caller frees
        self.inserted.append(seq)

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        seq = self.draw_seq(data)
        m = self.tree.match_prefix(list(seq))
        expect = self.longest(seq)
        assert m.length == expect
        assert m.slots.dtype == np.int64
        assert m.slots.tolist() == self.model_slots(seq[:expect])
        keys, vals = path_of(self.tree, m.node)  # the node ends exactly at the match
        assert tuple(keys.tolist()) == seq[:expect]
        np.testing.assert_array_equal(vals, m.slots)
        assert (m.node is self.tree.root) == (expect == 0)
        newest = max((x.last_access for x in walk(self.tree)), default=0.0)
        x: RadixNode | None = m.node
        while x is not None and x is not self.tree.root:  # the matched path is now the newest
            assert x.last_access == newest
            x = x.parent

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        seq = self.draw_seq(data)
        m = self.tree.match_prefix(seq)
        self.tree.lock(m.node)
        if m.length:
            self.locks.append((m.node, seq[: m.length]))
        else:
            self.tree.unlock(m.node)  # root: a no-op both ways

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 10**6))
    def unlock(self, i: int) -> None:
        node, _ = self.locks.pop(i % len(self.locks))
        self.tree.unlock(node)

    @rule(data=st.data())
    def unlock_unheld_raises(self, data: st.DataObject) -> None:
        m = self.tree.match_prefix(self.draw_seq(data))
        if m.length == 0 or any(n is m.node for n, _ in self.locks):
            return
        before = (self.tree.evictable_size, self.tree.protected_size, m.node.lock_ref)
        with pytest.raises(ValueError):
            self.tree.unlock(m.node)
        assert (self.tree.evictable_size, self.tree.protected_size, m.node.lock_ref) == before

    @rule(n=st.integers(-1, 25))
    def evict(self, n: int) -> None:
        evictable = self.tree.evictable_size
        locked = self.locked_prefixes()
        age = {int(s): x.last_access for x in walk(self.tree) for s in x.value}
        out = self.tree.evict(n)
        assert out.dtype == np.int64
        got = out.tolist()
        assert len(set(got)) == len(got)
        by_slot = {s: p for p, s in self.cached.items()}
        assert set(got) <= set(by_slot), "evicted a slot the tree did not hold"
        gone = {by_slot[s] for s in got}
        assert not gone & locked, "evicted a locked prefix"
        assert len(got) >= min(n, evictable)
        assert len(got) <= max(evictable, 0)
        if n <= 0:
            assert not got
        for p in gone:
            del self.cached[p]
        # only leaves go: what is left is still prefix-closed
        assert all(p[:-1] in self.cached for p in self.cached if len(p) > 1)
        self.returned.extend(got)
        # LRU: nodes leave oldest first, and nothing evictable that stays is older
        ages = [age[s] for s in got]
        assert ages == sorted(ages)
        stays = [x.last_access for x in walk(self.tree) if not x.children and not x.lock_ref]
        if ages and stays:
            assert max(ages) <= min(stays)
        for _, tup in self.locks:
            m = self.tree.match_prefix(tup)
            assert m.length == len(tup)
            assert m.slots.tolist() == self.model_slots(tup)

    @precondition(lambda self: not self.locks)
    @rule()
    def evict_all(self) -> None:
        out = self.tree.evict(self.tree.total_size)
        assert sorted(out.tolist()) == sorted(self.cached.values())
        self.returned.extend(out.tolist())
        self.cached.clear()

    # after every step

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tree"):
            return
        t = self.tree
        t.check_invariants()
        protected = len(self.locked_prefixes())
        assert (t.total_size, t.protected_size, t.evictable_size) == (
            len(self.cached), protected, len(self.cached) - protected)
        # slot accounting: handed - (duplicates + evicted) is exactly what the tree holds
        assert len(set(self.returned)) == len(self.returned), "a slot came back twice"
        assert set(self.returned) <= self.handed
        held = t.all_slots().tolist()
        assert len(held) == t.total_size == len(self.handed) - len(self.returned)
        assert set(held) == self.handed - set(self.returned) == set(self.cached.values())
        for node, tup in self.locks:  # splits keep a locked node ending where it did
            keys, _ = path_of(t, node)
            assert tuple(keys.tolist()) == tup
            assert node.lock_ref > 0


RadixMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=40, deadline=None)
TestRadixMachine = RadixMachine.TestCase
