"""Radix prefix cache: token-id sequences -> KV-pool slots, token-granular.

Owns a radix tree whose edges carry a run of token ids (``key``) and the slots that hold
those tokens' KV (``value``, aligned: ``value[i]`` holds the KV of ``key[i]``). The path
from the root to a node spells a cached prefix; its concatenated values are that
prefix's slots. The tree knows token ids and slots only, never requests: the scheduler
decides what to insert, what to lock while a request runs, and gives evicted slots back
to the allocator.

Operations (n = tokens in the call, d = nodes on the path, N = nodes in the tree):

* ``match_prefix`` walks the path comparing each edge with one numpy comparison, O(n + d).
  If the match ends inside an edge the edge is *split*, so the returned node ends exactly
  at the matched length and can be locked. Touches ``last_access`` on the path.
* ``peek_prefix`` is the same walk read-only: the matched length, no split, no touch (the
  engine's queue forecast asks it about waiting prompts without changing the LRU order).
* ``insert`` walks the same way and hangs the unmatched tail under the last node as one
  new leaf; it splits only where the sequence diverges inside an edge. It returns how
  many leading tokens were cached already: the tree keeps its own slots for those, and
  the caller's duplicates are the caller's to free.
* ``lock`` / ``unlock`` add / remove one reference on a node and every ancestor, O(d).
* ``evict`` pops least-recently-used unlocked leaves from a lazy heap; a parent becomes
  a candidate once its last child is gone. O(k log H) for k evicted nodes, H heap size.

Splitting keeps node identity for the *tail*: the existing node object keeps the end of
the edge (and its children and own locks) and a new node takes the head. So a node that
someone holds (and maybe locked) still ends at the same depth after any split. Nodes are
never merged. An evicted node is detached (``parent is None``); locking it raises.

Invariants (``check_invariants`` verifies them):

* no non-root node has an empty edge; ``key`` and ``value`` are int64 of equal length;
  a node is filed in its parent's ``children`` under ``int(key[0])``;
* ``lock_ref == own_locks + sum(child.lock_ref)``: a node's reference count is the locks
  taken on it directly plus those taken below it, so ``lock_ref >= 0`` everywhere and a
  parent's count is never below a child's. ``lock_ref > 0`` means never evicted;
* ``evictable_size`` / ``protected_size`` are the tokens in nodes with ``lock_ref == 0``
  / ``> 0``; both are kept incrementally and must agree with a walk;
* no slot appears twice in the tree;
* ``last_access`` never increases going down a path (a touch covers the whole path), so
  evicting the LRU *leaf* never strands a more recently used descendant;
* every unlocked leaf has a live heap entry ``(last_access, id, node)``.

Heap entries go stale when a node is touched, locked, gets children or is evicted; they
are checked when popped and the heap is rebuilt when it grows past twice the node count.

Namespaces: KV computed under one set of weights must never serve another (a LoRA adapter
changes every layer's K/V). ``match_prefix`` and ``insert`` take a namespace ``ns`` (0: the base
model; the scheduler gives each loaded adapter its own number): each namespace is a separate tree
under its own root (``self.root`` is namespace 0's), sharing the pool, the LRU clock, the heap
and the sizes. A root is any node without a parent that is filed in ``_roots``.

Callers: the scheduler (match / insert / lock / unlock / evict, through one bookkeeping
function that states which slots are cached, locked and free) and the waiting-queue
policies (``match_prefix`` for longest-prefix ordering).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

I64 = np.int64

_EMPTY = np.zeros(0, dtype=I64)
_node_ids = itertools.count()


class RadixNode:
    """One edge of the tree and the node it leads to."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "own_locks", "last_access", "id")

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: RadixNode | None,
                 last_access: float = 0.0) -> None:
        self.key: np.ndarray = key  # i64 [n] token ids on the edge from parent to here
        self.value: np.ndarray = value  # i64 [n] slots; value[i] holds the KV of key[i]
        self.children: dict[int, RadixNode] = {}  # keyed by the child's first token id
        self.parent: RadixNode | None = parent  # None for the root and for evicted nodes
        self.lock_ref: int = 0  # own_locks + sum of children's lock_ref; > 0: never evicted
        self.own_locks: int = 0  # lock() calls on exactly this node not yet unlocked
        self.last_access: float = last_access  # tick of the cache's LRU clock
        self.id: int = next(_node_ids)  # heap tie-break, creation order

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def size(self) -> int:
        """Tokens (and slots) on this node's edge."""
        return int(self.key.shape[0])

    def ancestry(self) -> Iterator[RadixNode]:
        """This node, then each ancestor up to (not including) the root: the nodes a lock on it holds."""
        node: RadixNode | None = self
        while node is not None and node.parent is not None:
            yield node
            node = node.parent

    def __repr__(self) -> str:
        return (f"RadixNode(id={self.id}, key={_preview(self.key)}, lock_ref={self.lock_ref}, "
                f"last_access={self.last_access}, children={len(self.children)})")


@dataclass(eq=False)
class MatchResult:
    length: int  # tokens matched, 0..len(tokens)
    slots: np.ndarray  # i64 [length], the cached slots of tokens[:length]
    node: RadixNode  # deepest node covering the match, ending exactly at `length` (root if 0)


class RadixCache:
    """Prefix tree from token ids to KV slots with lock counts and LRU eviction."""

    def __init__(self) -> None:
        self.root = RadixNode(_EMPTY, _EMPTY, None)
        self._roots: dict[int, RadixNode] = {0: self.root}  # namespace -> its tree's root
        self._clock = 0  # LRU clock: one tick per match / insert
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0  # excluding the root
        self._heap: list[tuple[float, int, RadixNode]] = []  # (last_access, id, node), lazy
        self._heap_slack = 64  # rebuild the heap past 2 * num_nodes + slack entries (tests use 0)

    # -- sizes ------------------------------------------------------------------------

    @property
    def evictable_size(self) -> int:
        """Tokens in nodes with ``lock_ref == 0``."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Tokens in nodes with ``lock_ref > 0``."""
        return self._protected

    @property
    def total_size(self) -> int:
        return self._evictable + self._protected

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, not counting the root."""
        return self._num_nodes

    # -- match / insert ---------------------------------------------------------------

    def _root_of(self, ns: int) -> RadixNode:
        root = self._roots.get(ns)
        if root is None:
            root = self._roots[ns] = RadixNode(_EMPTY, _EMPTY, None)
        return root

    def match_prefix(self, tokens: np.ndarray | Sequence[int], ns: int = 0) -> MatchResult:
        """Longest cached prefix of ``tokens`` in namespace ``ns``; splits the last edge if the
        match ends inside it."""
        toks = _as_i64(tokens, "tokens")  # i64 [n]
        n = toks.shape[0]
        now = self._tick()
        node = self._root_of(ns)
        node.last_access = now
        parts: list[np.ndarray] = []
        pos = 0
        while pos < n:
            child = node.children.get(int(toks[pos]))
            if child is None:
                break
            k = _common_len(child.key, toks[pos:])
            if k < child.key.shape[0]:
                child = self._split(child, k)
            child.last_access = now
            parts.append(child.value)
            node = child
            pos += k
        self._touched(node)
        slots = np.concatenate(parts) if parts else _EMPTY.copy()  # i64 [pos]
        return MatchResult(length=pos, slots=slots, node=node)

    def peek_prefix(self, tokens: np.ndarray | Sequence[int], ns: int = 0) -> int:
        """Length of the longest cached prefix of ``tokens`` in namespace ``ns``, changing nothing."""
        toks = _as_i64(tokens, "tokens")
        n = toks.shape[0]
        node = self._roots.get(ns)
        pos = 0
        while node is not None and pos < n:
            child = node.children.get(int(toks[pos]))
            if child is None:
                break
            k = _common_len(child.key, toks[pos:])
            pos += k
            if k < child.key.shape[0]:
                break
            node = child
        return pos

    def insert(self, tokens: np.ndarray | Sequence[int], slots: np.ndarray | Sequence[int], ns: int = 0) -> int:
        """Cache ``tokens -> slots`` in namespace ``ns``; returns how many leading tokens were cached already.

        For those the tree keeps its own slots and ``slots[:returned]`` stay the caller's
        (duplicates to free). The tree takes ownership of ``slots[returned:]``.
        """
        toks = _as_i64(tokens, "tokens")  # i64 [n]
        vals = _as_i64(slots, "slots")  # i64 [n]
        n = toks.shape[0]
        if vals.shape[0] != n:
            raise ValueError(f"insert: {n} tokens but {vals.shape[0]} slots")
        if n == 0:
            return 0
        now = self._tick()
        node = self._root_of(ns)
        node.last_access = now
        pos = 0
        while pos < n:
            child = node.children.get(int(toks[pos]))
            if child is None:
                leaf = RadixNode(toks[pos:].copy(), vals[pos:].copy(), node, now)
                node.children[int(toks[pos])] = leaf
                self._num_nodes += 1
                self._evictable += n - pos
                self._touched(leaf)
                return pos
            k = _common_len(child.key, toks[pos:])
            if k < child.key.shape[0] and pos + k < n:
                child = self._split(child, k)  # diverges inside the edge
            child.last_access = now
            node = child
            pos += k
        self._touched(node)
        return n  # everything was cached already (possibly ending inside an edge)

    # -- locks ------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """Take one reference on ``node`` and its ancestors (not the root; root is a no-op)."""
        path = self._path(node)
        for x in path:
            if x.lock_ref == 0:
                size = x.key.shape[0]
                self._evictable -= size
                self._protected += size
            x.lock_ref += 1
        if path:
            node.own_locks += 1

    def unlock(self, node: RadixNode) -> None:
        """Drop one reference taken by ``lock(node)``; raises (changing nothing) if there is none."""
        path = self._path(node)
        if not path:
            return
        if node.own_locks <= 0:
            raise ValueError(f"unlock without a matching lock on {node!r}")
        node.own_locks -= 1
        for x in path:
            x.lock_ref -= 1
            if x.lock_ref == 0:
                size = x.key.shape[0]
                self._protected -= size
                self._evictable += size
                if not x.children:
                    self._push(x)

    # -- eviction ---------------------------------------------------------------------

    def evict(self, num_tokens: int) -> np.ndarray:
        """Remove LRU unlocked leaves until ``>= num_tokens`` slots are freed or none are left.

        Whole nodes go, so it may free more than asked. Returns the freed slots (i64) for
        the caller to give back to the allocator.
        """
        freed: list[np.ndarray] = []
        count = 0
        heap = self._heap  # _push compacts it in place, so this alias stays valid
        while count < num_tokens and heap:
            t, _, node = heapq.heappop(heap)
            parent = node.parent
            if parent is None or node.children or node.lock_ref or node.last_access != t:
                continue  # stale entry
            del parent.children[int(node.key[0])]
            node.parent = None
            self._num_nodes -= 1
            size = node.key.shape[0]
            self._evictable -= size
            count += size
            freed.append(node.value)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        return np.concatenate(freed) if freed else _EMPTY.copy()

    # -- inspection -------------------------------------------------------------------

    def all_slots(self) -> np.ndarray:
        """Every slot the tree holds (i64, depth-first order)."""
        vals = [x.value for x in self._walk()]
        return np.concatenate(vals) if vals else _EMPTY.copy()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the tree's state is inconsistent."""
        for root in self._roots.values():
            if root.parent is not None or root.key.shape != (0,) or root.value.shape != (0,):
                raise AssertionError("root must have no parent and an empty edge")
            if root.lock_ref != 0 or root.own_locks != 0:
                raise AssertionError(f"root has lock_ref {root.lock_ref} / own_locks {root.own_locks}")
        evictable = protected = nodes = 0
        live = {(t, i) for t, i, x in self._heap if x.parent is not None}
        for x in self._walk():
            nodes += 1
            p = x.parent
            if p is None:
                raise AssertionError(f"{x!r} is reachable but detached")
            if x.key.dtype != I64 or x.value.dtype != I64 or x.key.ndim != 1:
                raise AssertionError(f"{x!r}: key/value must be 1-D int64")
            if x.key.shape != x.value.shape:
                raise AssertionError(f"{x!r}: {x.key.shape[0]} tokens but {x.value.shape[0]} slots")
            if x.key.shape[0] == 0:
                raise AssertionError(f"{x!r}: empty edge")
            if p.children.get(int(x.key[0])) is not x:
                raise AssertionError(f"{x!r} is not filed under its first token in its parent")
            below = sum(c.lock_ref for c in x.children.values())
            if x.own_locks < 0 or x.lock_ref != x.own_locks + below:
                raise AssertionError(f"{x!r}: lock_ref {x.lock_ref} != own_locks {x.own_locks} "
                                     f"+ children's {below}")
            if p.parent is not None and p.last_access < x.last_access:
                raise AssertionError(f"{x!r} was used more recently than its parent")
            if x.lock_ref:
                protected += x.key.shape[0]
            else:
                evictable += x.key.shape[0]
                if not x.children and (x.last_access, x.id) not in live:
                    raise AssertionError(f"unlocked leaf {x!r} has no heap entry")
        if (evictable, protected) != (self._evictable, self._protected):
            raise AssertionError(f"sizes (evictable, protected) = ({self._evictable}, {self._protected}) "
                                 f"but a walk counts ({evictable}, {protected})")
        if nodes != self._num_nodes:
            raise AssertionError(f"num_nodes {self._num_nodes} but a walk counts {nodes}")
        slots = self.all_slots()
        if np.unique(slots).shape[0] != slots.shape[0]:
            raise AssertionError("a slot appears more than once in the tree")

    def pretty(self, max_tokens: int = 8) -> str:
        """Indented dump: one line per node with its tokens, slots, lock_ref and last_access."""
        lines = [f"root (total={self.total_size}, evictable={self.evictable_size}, "
                 f"protected={self.protected_size}, nodes={self._num_nodes})"]
        stack = [(c, 1) for root in self._roots.values() for c in reversed(list(root.children.values()))]
        while stack:
            x, depth = stack.pop()
            lines.append(f"{'  ' * depth}{_preview(x.key, max_tokens)} -> {_preview(x.value, max_tokens)}"
                         f"  lock={x.lock_ref} t={x.last_access:g}")
            stack.extend((c, depth + 1) for c in reversed(list(x.children.values())))
        return "\n".join(lines)

    # -- internals --------------------------------------------------------------------

    def _tick(self) -> float:
        self._clock += 1
        return float(self._clock)

    def _split(self, child: RadixNode, k: int) -> RadixNode:
        """Split ``child``'s edge after ``k`` tokens (0 < k < len); returns the new head node.

        The head takes ``key[:k]``; ``child`` keeps the tail, its children and its own
        locks. The head's lock_ref equals the child's (every lock below the head goes
        through the child), so the sizes do not change.
        """
        parent = child.parent
        assert parent is not None and 0 < k < child.key.shape[0]
        head = RadixNode(child.key[:k].copy(), child.value[:k].copy(), parent, child.last_access)
        head.lock_ref = child.lock_ref
        head.children[int(child.key[k])] = child
        parent.children[int(child.key[0])] = head
        child.key = child.key[k:].copy()
        child.value = child.value[k:].copy()
        child.parent = head
        self._num_nodes += 1
        return head

    def _path(self, node: RadixNode) -> list[RadixNode]:
        """``node`` and its ancestors below its root; raises if ``node`` is not in this tree."""
        path = []
        x = node
        while x.parent is not None:
            path.append(x)
            x = x.parent
        if not any(x is root for root in self._roots.values()):
            raise ValueError(f"{node!r} is not in the tree (evicted)")
        return path

    def _touched(self, node: RadixNode) -> None:
        """``node``'s last_access changed: give it a fresh heap entry if it can be evicted."""
        if node.parent is not None and not node.children and node.lock_ref == 0:
            self._push(node)

    def _push(self, node: RadixNode) -> None:
        heap = self._heap
        heapq.heappush(heap, (node.last_access, node.id, node))
        if len(heap) > 2 * self._num_nodes + self._heap_slack:
            live = {}
            for t, i, x in heap:
                if x.parent is not None and not x.children and not x.lock_ref and x.last_access == t:
                    live[i] = (t, i, x)
            heap[:] = live.values()  # in place: evict() may be iterating over this list
            heapq.heapify(heap)

    def _walk(self) -> Iterator[RadixNode]:
        """Every non-root node, depth-first, parents before children."""
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            x = stack.pop()
            yield x
            stack.extend(x.children.values())


def _as_i64(a: np.ndarray | Sequence[int], what: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return _EMPTY
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    return arr.astype(I64, copy=False)


def _common_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two i64 arrays (one vectorised comparison)."""
    m = min(a.shape[0], b.shape[0])
    if m <= 1:
        return m if m == 0 or a[0] == b[0] else 0
    eq = a[:m] == b[:m]  # bool [m]
    i = int(eq.argmin())  # first mismatch, or 0 if all equal
    return m if eq[i] else i


def _preview(a: np.ndarray, max_tokens: int = 8) -> str:
    if a.shape[0] <= max_tokens:
        return str(a.tolist())
    head = " ".join(str(v) for v in a[:max_tokens].tolist())
    return f"[{head} … +{a.shape[0] - max_tokens}]"
