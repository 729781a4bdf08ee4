"""SlotLedger: who holds which KV slot. The one place that joins requests, the slot allocator and
the radix prefix cache (docs/design.md, habit 3).

Owns the allocator, the tree (None with ``--disable-prefix-cache``) and every operation that moves a
slot between them and a request:

KV is cached per adapter (``Request.adapter`` is the tree namespace): a request never reuses KV
computed under other weights.

* ``match`` a waiting request's longest cached prefix and lock it (``unlock`` if it is not admitted);
* ``alloc`` slots for a step (evicting unlocked cache nodes, LRU, when the pool runs short) and
  ``free`` what a step gave back;
* ``cache`` a request's computed KV into the tree (keeping its lock on the whole path, or letting go);
  without ``cache_generated`` only the KV its prefill computed (``prefill_len`` tokens): the KV of
  tokens it generated came from decode steps, whose matmul forms go by the batch's row count, and a
  later prompt that contains them must get what computing them as prompt rows gives (issue 19);
* ``release`` everything a request holds when it leaves the running set;
* ``drop_tail`` the last positions a request computed (speculative guesses the model did not take).

Ownership of a running request ``r``: ``r.slots[:r.tree_len]`` belong to the tree and are locked
through ``r.tree_node``; ``r.slots[r.tree_len:r.num_computed + r.pending]`` are its own. Waiting
requests hold nothing. ``check`` verifies the accounting::

    allocator.num_free + tree.total_size + sum(r.num_private for r in running) == capacity
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from lockgate.kvcache.allocator import OutOfSlots, SlotAllocator
from lockgate.kvcache.radix import RadixCache, RadixNode
from lockgate.scheduler.request import Request

I64 = np.int64
_NO_SLOTS = np.zeros(0, I64)


class SlotLedger:
    def __init__(self, capacity: int, prefix_cache: bool, cache_generated: bool = True) -> None:
        self.capacity = capacity
        self.cache_generated = cache_generated
        self.allocator = SlotAllocator(capacity)
        self.tree: RadixCache | None = RadixCache() if prefix_cache else None

    # ---- figures -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def protected(self) -> int:
        """Cached slots locked by running requests (never evicted while locked)."""
        return self.tree.protected_size if self.tree is not None else 0

    @property
    def evictable(self) -> int:
        """Cached slots no request locks: reclaimable on demand."""
        return self.tree.evictable_size if self.tree is not None else 0

    # ---- the prefix cache ----------------------------------------------------------------
    def match(self, r: Request) -> tuple[int, RadixNode | None, np.ndarray]:
        """Longest cached prefix of what ``r`` must prefill, leaving at least one token to compute
        (its logits give the next token). Locks the match; (0, None, []) if none."""
        if self.tree is None or r.prefill_len < 2:
            return 0, None, _NO_SLOTS
        m = self.tree.match_prefix(r.token_at(0, r.prefill_len - 1), ns=r.adapter)
        if m.length == 0:
            return 0, None, _NO_SLOTS
        self.tree.lock(m.node)
        return m.length, m.node, m.slots

    def unlock(self, node: RadixNode) -> None:
        assert self.tree is not None
        self.tree.unlock(node)

    def cache(self, r: Request, keep_lock: bool) -> int:
        """Insert ``r``'s computed KV into the tree (its prefill's only, without ``cache_generated``)
        and return how many leading tokens the tree now covers for it. Its slots the tree already
        had (another request cached the same tokens) are freed and replaced by the tree's. With
        ``keep_lock`` the request keeps using (and locking) the whole cached path; otherwise it lets
        go of the tree entirely (its slots past the returned count are still its own)."""
        tree = self.tree
        assert tree is not None
        n = r.num_computed if self.cache_generated else min(r.num_computed, r.prefill_len)
        if n > r.tree_len:
            toks = r.token_at(0, n)
            mine = r.slots[:n].copy()
            had = tree.insert(toks, mine, ns=r.adapter)
            if had > r.tree_len:
                self.allocator.free(mine[r.tree_len:had])
            if keep_lock:
                m = tree.match_prefix(toks, ns=r.adapter)
                assert m.length == n, f"inserted {n} tokens but matched {m.length}"
                r.slots[:n] = m.slots
                tree.lock(m.node)
                if r.tree_node is not None:
                    tree.unlock(r.tree_node)
                r.tree_node, r.tree_len = m.node, n
        covered = max(n, r.tree_len)
        if not keep_lock and r.tree_node is not None:
            tree.unlock(r.tree_node)
            r.tree_node, r.tree_len = None, 0
        return covered

    # ---- slots for a step and back -------------------------------------------------------
    def alloc(self, n: int) -> np.ndarray:
        """``n`` free slots, evicting unlocked cache nodes (LRU) if the pool is short."""
        if self.allocator.num_free < n and self.tree is not None:
            freed = self.tree.evict(n - self.allocator.num_free)
            if freed.size:
                self.allocator.free(freed)
        if self.allocator.num_free < n:
            raise OutOfSlots(f"need {n} KV slots, {self.allocator.num_free} free and nothing evictable")
        return self.allocator.alloc(n)

    def free(self, runs: Iterable[np.ndarray]) -> None:
        for run in runs:
            self.allocator.free(run)

    def drop_tail(self, r: Request, n: int) -> None:
        """The last ``n`` computed positions of ``r`` (its own, never in the tree) go back to the pool."""
        if n:
            assert r.num_computed - n >= r.tree_len
            self.allocator.free(r.slots[r.num_computed - n:r.num_computed].copy())
            r.num_computed -= n

    def release(self, r: Request) -> None:
        """``r`` leaves the running set: its KV goes to the tree (or back to the pool). Slots
        allocated for a step in flight (not computed yet) go straight back."""
        if r.pending:
            self.allocator.free(r.slots[r.num_computed:r.num_computed + r.pending].copy())
            r.pending = 0
        if self.tree is not None:
            covered = self.cache(r, keep_lock=False)
            if covered < r.num_computed:  # generated tokens' KV the tree does not take
                self.allocator.free(r.slots[covered:r.num_computed].copy())
        elif r.num_computed:
            self.allocator.free(r.held_slots())
        r.num_computed, r.tree_len, r.tree_node = 0, 0, None

    def drop_cache(self) -> int:
        """Evict every cached slot no request locks (a step that failed may have left KV in the
        tree that was never computed: overlap scheduling commits a step before it runs); how many."""
        if self.tree is None:
            return 0
        freed = self.tree.evict(self.tree.evictable_size)
        if freed.size:
            self.allocator.free(freed)
        return int(freed.size)

    # ---- checks (tests run them after every step) -------------------------------------------
    def check(self, running: Iterable[Request], waiting: Iterable[Request]) -> None:
        self.allocator.check_invariants()
        cached = 0
        if self.tree is not None:
            self.tree.check_invariants()
            cached = self.tree.total_size
        running = list(running)
        private = sum(r.num_private for r in running)
        assert self.allocator.num_free + cached + private == self.capacity, (
            f"slot accounting broken: free {self.allocator.num_free} + cached {cached} + in use {private} "
            f"!= capacity {self.capacity}")
        for r in running:
            assert 0 <= r.tree_len <= r.num_computed
            assert (r.tree_node is None) == (r.tree_len == 0) or self.tree is None
            if r.tree_node is not None:
                assert r.tree_node.lock_ref > 0
        for r in waiting:
            assert r.num_computed == 0 and r.tree_node is None, f"waiting request {r.rid} holds KV"
