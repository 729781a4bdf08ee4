"""Waiting-queue policies (``--schedule-policy``): in which order waiting requests are admitted.

Owns one decision: given the waiting queue, the prefix tree, the step counter and the
clock, return the same requests in the order the scheduler should try to admit them. Pure
functions over the queue (numpy and ints, never torch): the input is left as it is and a
new list is returned. The scheduler calls ``policy.order(waiting, tree, step, now)`` once
per step, before admission, keeps the result as its queue and admits from the head,
stopping at the first request that does not fit (head-of-line blocking, so the order is
also a priority: nothing behind a blocked request jumps it).

Arrival order is ``(arrival_time, position in the queue)``, not the position alone:
the scheduler keeps each step's order as its queue, so after one ``lpm`` step the queue is
no longer in arrival order, yet ties, ``fcfs`` and the fallbacks below must still mean
"who came first". Requests re-queued after a retraction keep their ``arrival_time``, so
they rank as the old requests they are.

The policies
------------
* ``fcfs``: arrival order. Fair and predictable; the default.
* ``lpm``, longest prefix match first: by how many tokens of each request are already in
  the radix tree, descending, ties by arrival. A request whose prefix is cached needs only
  its suffix prefilled and keeps that prefix hot (reused before LRU eviction takes it), so
  serving well-matched requests first raises the hit rate and throughput. Matching walks
  the tree once per waiting request, so with more than ``LPM_MAX_QUEUE`` (128) requests to
  order the policy falls back to fcfs for that step, as SGLang does: a queue that long
  means the server is saturated, and the matching cost would sit on every step's critical
  path for little gain.
* ``dfs-weight``: each waiting request is attached to the deepest tree node it matches;
  a node's weight is the number of waiting requests attached inside its subtree. The tree
  is walked depth first from the root, children in descending weight (ties by the child's
  first token, for determinism), and every node emits its own requests (arrival order)
  after its children's subtrees, as SGLang's ``_get_dfs_priority`` does. Requests sharing
  a prefix are thus served together (the shared KV is reused while it is hot rather than
  evicted between them), the most popular prefix first; within a subtree deeper matches
  come first, and requests matching nothing (attached to the root) come last.
* ``lof``, longest output first: by ``params.max_tokens - num_output`` (tokens the
  request may still generate) descending, ties by arrival. Long generations start early
  instead of becoming the lone tail of a batch everyone else has left.
* ``random``: a shuffle from a ``numpy.random.Generator`` seeded at construction;
  reproducible for a given seed and sequence of calls. A baseline for benchmarks.

Tenants (``--fairness vtc``): the ranking above is then interleaved by tenant, the least-served
tenant's next request first (``fairness.TenantShare.interleave``), so every policy orders
*within* a tenant and the virtual token counters choose *between* tenants. Overdue requests
still go before every other request; among them too the least-served tenant goes first (oldest
first within a tenant), so a tenant that floods the queue past the bound cannot turn the bound
into first-come-first-served for everyone.

Matching uses the tokens the scheduler itself matches at admission (``match_tokens``: what
the request must prefill, minus its last token, which is always computed for its logits;
prompt + output for a request resuming after retraction), so ``lpm`` ranks by the reuse
the request will actually get. ``lpm`` and ``dfs-weight`` need the tree; with
``tree=None`` (prefix cache disabled) they are fcfs. Each request is matched at most once
per call (computed up front, never inside a sort key). ``match_prefix`` may split edges
and touches access times; ``dfs-weight`` reads node parents only after every request has
been matched, and a split keeps the matched node ending where it did, so splits are
harmless.

The queue-delay bound (no starvation)
-------------------------------------
The cache-aware and length-based policies can starve a request forever: under ``lpm`` or
``dfs-weight`` a cache-cold prompt loses to every newly arriving well-matched one, under
``lof`` a short request loses to every long one. ``QueueDelayBound``
(``--max-queue-delay``) caps that whatever the policy: a request is *overdue* when

* ``step - req.enqueue_step > max_steps``, or
* ``now - req.arrival_time > max_seconds``,

and overdue requests go first, oldest first (arrival order), followed by the rest in
policy order (with ``--fairness vtc``: within each tenant's turn, so the bound holds per tenant
and the tenants' shares stay fair under overload). ``req.enqueue_step`` is the scheduler step at which the scheduler queued
the request (set on submit and again when a retracted request is re-queued); it is read
with ``getattr(req, "enqueue_step", None)``, and a request without it is overdue by
seconds only. A request queued at step ``s`` is therefore ahead of every non-overdue
request from step ``s + max_steps + 1`` on, behind only older overdue ones, so its wait
is bounded by the bound plus the time those take to fit (admission never reorders).
``QueueDelayBound(None, None)`` disables it; ``QueueDelayBound(*cfg.queue_delay_bound)``
builds it from ``SchedulerConfig``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lockgate.scheduler.fairness import TenantShare
from lockgate.scheduler.request import Request

POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")

LPM_MAX_QUEUE = 128  # lpm orders by fcfs when more requests than this are waiting (matching cost)


# ---- the prefix tree, as the policies see it ------------------------------------------
# Structural types: ``lockgate.kvcache.radix.RadixCache`` satisfies them, and so does any
# stand-in with the same few members (tests use a tiny trie).
class PrefixNode(Protocol):
    @property
    def children(self) -> Mapping[int, PrefixNode]: ...  # keyed by the child edge's first token

    @property
    def parent(self) -> PrefixNode | None: ...  # None at the root


class PrefixMatch(Protocol):
    @property
    def length(self) -> int: ...  # tokens of the longest cached prefix

    @property
    def node(self) -> PrefixNode: ...  # the node that ends exactly at the match (root if none)


class PrefixTree(Protocol):
    def match_prefix(self, tokens: np.ndarray, /, ns: int = 0) -> PrefixMatch: ...


# ---- the bound and the policy interface -----------------------------------------------
@dataclass(frozen=True)
class QueueDelayBound:
    """A request waiting more than ``max_steps`` scheduler steps or ``max_seconds`` seconds
    is served next, whatever the policy (oldest first). ``None`` disables that half."""

    max_steps: int | None = None
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0 or None, got {self.max_steps}")
        if self.max_seconds is not None and not self.max_seconds >= 0:
            raise ValueError(f"max_seconds must be >= 0 or None, got {self.max_seconds}")

    def overdue(self, req: Request, step: int, now: float) -> bool:
        if self.max_steps is not None:
            enq = getattr(req, "enqueue_step", None)  # set by the scheduler when it queues req
            if enq is not None and step - enq > self.max_steps:
                return True
        return self.max_seconds is not None and now - req.arrival_time > self.max_seconds


class WaitingPolicy(Protocol):
    name: str

    def order(self, waiting: Sequence[Request], tree: PrefixTree | None, step: int,
              now: float) -> list[Request]: ...


Ranker = Callable[[list[Request], PrefixTree | None], list[Request]]


class BoundedPolicy:
    """A ranking under a ``QueueDelayBound``: overdue requests first (arrival order), then
    the rest as ``rank`` orders them (``rank`` gets them in arrival order). With ``fair`` the
    tenants are interleaved (the least-served tenant's next request first: fairness.py) and the
    bound orders each tenant's own requests: a tenant flooding the queue has its requests go
    overdue first, and they must not take the turns of a tenant that sends few."""

    def __init__(self, name: str, rank: Ranker, bound: QueueDelayBound, fair: TenantShare | None = None) -> None:
        self.name = name
        self.bound = bound
        self._rank = rank
        self.fair = fair

    def order(self, waiting: Sequence[Request], tree: PrefixTree | None, step: int,
              now: float) -> list[Request]:
        overdue: list[Request] = []
        rest: list[Request] = []
        for r in arrival_order(waiting):
            (overdue if self.bound.overdue(r, step, now) else rest).append(r)
        ranked = self._rank(rest, tree)
        if self.fair is None:
            return overdue + ranked
        return self.fair.interleave(overdue + ranked)

    def __repr__(self) -> str:
        return f"BoundedPolicy({self.name!r}, {self.bound})"


def make_policy(name: str, bound: QueueDelayBound, seed: int = 0, fair: TenantShare | None = None) -> WaitingPolicy:
    """The policy called ``name`` (one of ``POLICIES``) under ``bound``; ``seed`` seeds ``random``;
    ``fair``: tenants' counters to interleave the ranking by (``--fairness vtc``)."""
    if name == "random":
        return BoundedPolicy(name, _random_ranker(seed), bound, fair)
    rank = _RANKERS.get(name)
    if rank is None:
        raise ValueError(f"unknown schedule policy {name!r}; choose one of {', '.join(POLICIES)}")
    return BoundedPolicy(name, rank, bound, fair)


# ---- rankings (over the requests that are not overdue, given in arrival order) --------
def arrival_order(reqs: Sequence[Request]) -> list[Request]:
    """By ``arrival_time``; the sort is stable, so equal times keep their queue order."""
    return sorted(reqs, key=lambda r: r.arrival_time)


def match_tokens(r: Request) -> np.ndarray:
    """The tokens the scheduler matches against the cache at admission: what ``r`` must
    prefill minus the last token (computed in any case, for its logits)."""
    return r.token_at(0, r.prefill_len - 1)


def _by_key_desc(reqs: list[Request], keys: list[int]) -> list[Request]:
    """``reqs`` by ``keys`` descending; the sort is stable, so ties keep arrival order."""
    idx = sorted(range(len(reqs)), key=lambda i: -keys[i])
    return [reqs[i] for i in idx]


def rank_fcfs(reqs: list[Request], tree: PrefixTree | None) -> list[Request]:
    return list(reqs)


def rank_lpm(reqs: list[Request], tree: PrefixTree | None) -> list[Request]:
    if tree is None or len(reqs) > LPM_MAX_QUEUE:
        return list(reqs)
    lengths = [int(tree.match_prefix(match_tokens(r), ns=r.adapter).length) for r in reqs]  # one match per request
    return _by_key_desc(reqs, lengths)


def rank_dfs_weight(reqs: list[Request], tree: PrefixTree | None) -> list[Request]:
    if tree is None or not reqs:
        return list(reqs)
    # Match every request first (a match may split nodes), then read the final structure.
    attached: dict[int, list[Request]] = {}  # id(node) -> requests whose match ends there
    ends: list[PrefixNode] = []
    for r in reqs:
        node = tree.match_prefix(match_tokens(r), ns=r.adapter).node
        bucket = attached.get(id(node))
        if bucket is None:
            attached[id(node)] = bucket = []
            ends.append(node)
        bucket.append(r)
    # The nodes on some match's root path (stop climbing at a node already seen); one root per
    # namespace (adapter) the requests use.
    on_path: set[int] = set()
    roots: list[PrefixNode] = []
    for node in ends:
        cur: PrefixNode | None = node
        while cur is not None and id(cur) not in on_path:
            on_path.add(id(cur))
            if cur.parent is None:
                roots.append(cur)
            cur = cur.parent
    assert roots, "a match node has no root ancestor"

    def kids(n: PrefixNode) -> list[tuple[int, PrefixNode]]:
        return [(tok, c) for tok, c in n.children.items() if id(c) in on_path]

    # Post-order over the on-path subtree: a node's emitted sequence is its children's
    # sequences (heaviest first, ties by first token) followed by its own requests; the
    # weight of a subtree is the length of its sequence. Iterative: no recursion limit.
    seq: dict[int, list[Request]] = {}
    stack: list[tuple[PrefixNode, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for _, c in kids(node))
            continue
        subs = sorted(((tok, seq.pop(id(c))) for tok, c in kids(node)), key=lambda ts: (-len(ts[1]), ts[0]))
        out = [r for _, s in subs for r in s]
        out.extend(attached.get(id(node), ()))
        seq[id(node)] = out
    ordered = [r for s in sorted((seq[id(root)] for root in roots), key=len, reverse=True) for r in s]
    assert len(ordered) == len(reqs), "a match node is not filed under its parent's children"
    return ordered


def rank_lof(reqs: list[Request], tree: PrefixTree | None) -> list[Request]:
    return _by_key_desc(reqs, [r.params.max_tokens - r.num_output for r in reqs])


def _random_ranker(seed: int) -> Ranker:
    rng = np.random.default_rng(seed)

    def rank_random(reqs: list[Request], tree: PrefixTree | None) -> list[Request]:
        return [reqs[i] for i in rng.permutation(len(reqs)).tolist()]

    return rank_random


_RANKERS: dict[str, Ranker] = {"fcfs": rank_fcfs, "lpm": rank_lpm, "dfs-weight": rank_dfs_weight, "lof": rank_lof}
