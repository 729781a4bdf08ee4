"""Waiting-queue policies: each policy's order on a hand-built queue and prefix tree, the
lpm queue-length fallback, seeded random, and the queue-delay bound that stops a cache-cold
request from starving behind a stream of well-matched ones."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pytest

from lockgate.sampling import SamplingParams
from lockgate.scheduler.policy import (
    LPM_MAX_QUEUE,
    POLICIES,
    QueueDelayBound,
    make_policy,
)
from lockgate.scheduler.request import Request

NO_BOUND = QueueDelayBound(None, None)


# ---- a stand-in prefix tree: an uncompressed trie (one token per edge) -----------------
@dataclass(eq=False)
class Node:
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)


@dataclass
class Match:
    length: int
    node: Node


class Trie:
    """Just what the policies use: ``match_prefix(tokens) -> (.length, .node)``, nodes with
    ``children`` keyed by first token and ``parent``. Counts matches to check caching."""

    def __init__(self, seqs: Iterable[list[int]] = ()) -> None:
        self.root = Node()
        self.matches = 0
        for s in seqs:
            self.insert(s)

    def insert(self, tokens: list[int]) -> None:
        node = self.root
        for t in tokens:
            node = node.children.setdefault(t, Node(parent=node))

    def match_prefix(self, tokens: np.ndarray, ns: int = 0) -> Match:
        assert ns == 0, "one namespace: these requests use no adapter"
        self.matches += 1
        node, n = self.root, 0
        for t in np.asarray(tokens).tolist():
            nxt = node.children.get(t)
            if nxt is None:
                break
            node, n = nxt, n + 1
        return Match(n, node)


def req(rid: str, prompt: list[int], max_tokens: int = 16, *, arrival: float = 0.0,
        enqueue_step: int = 0, num_output: int = 0) -> Request:
    r = Request(rid, prompt_ids=np.array(prompt), params=SamplingParams(max_tokens=max_tokens))
    r.arrival_time = arrival
    r.enqueue_step = enqueue_step
    r.output_ids = list(range(num_output))
    return r


def rids(reqs: list[Request]) -> list[str]:
    return [r.rid for r in reqs]


# Cached: [1,2,3,4], [1,2,7], [5,6]. Waiting (arrival order) and their deepest match (the
# last prompt token is never matched: the scheduler always computes it):
#   r0 [5,6,9] -> [5,6] (2)      r1 [1,2,3,4,8] -> [1,2,3,4] (4)   r2 [9,9] -> root (0)
#   r3 [1,2,7,1] -> [1,2,7] (3)  r4 [1,2,3,4,5] -> [1,2,3,4] (4)   r5 [1,2,0] -> [1,2] (2)
#   r6 [5,6,7] -> [5,6] (2)
CACHED = [[1, 2, 3, 4], [1, 2, 7], [5, 6]]
PROMPTS = [[5, 6, 9], [1, 2, 3, 4, 8], [9, 9], [1, 2, 7, 1], [1, 2, 3, 4, 5], [1, 2, 0], [5, 6, 7]]


def queue() -> list[Request]:
    return [req(f"r{i}", p, arrival=float(i)) for i, p in enumerate(PROMPTS)]


def order(name: str, waiting: list[Request], tree: Trie | None, bound: QueueDelayBound = NO_BOUND,
          step: int = 0, now: float = 0.0) -> list[str]:
    return rids(make_policy(name, bound).order(waiting, tree, step, now))


# ---- each policy on the hand-built queue -----------------------------------------------
def test_fcfs_is_arrival_order() -> None:
    assert order("fcfs", queue(), Trie(CACHED)) == ["r0", "r1", "r2", "r3", "r4", "r5", "r6"]


def test_lpm_longest_match_first_ties_by_arrival() -> None:
    # lengths r0 2, r1 4, r2 0, r3 3, r4 4, r5 2, r6 2
    assert order("lpm", queue(), Trie(CACHED)) == ["r1", "r4", "r3", "r0", "r5", "r6", "r2"]


def test_lpm_prefers_the_longer_match() -> None:
    tree = Trie([[1, 2, 3, 4, 5, 6]])
    short, long_ = req("short", [1, 2, 9]), req("long", [1, 2, 3, 4, 5, 9])
    assert order("lpm", [short, long_], tree) == ["long", "short"]
    assert order("fcfs", [short, long_], tree) == ["short", "long"]


def test_dfs_weight_groups_subtrees_heaviest_first() -> None:
    # Subtree under 1 holds r1 r3 r4 r5 (weight 4), under 5 holds r0 r6 (2), root holds r2.
    # Inside [1,2]: child 3 (r1 r4, weight 2) before child 7 (r3, weight 1), then [1,2]'s own r5.
    got = order("dfs-weight", queue(), Trie(CACHED))
    assert got == ["r1", "r4", "r3", "r5", "r0", "r6", "r2"]
    # Unlike lpm (r0 with match 2 before r5 with match 2), r5 stays with its subtree.
    assert got != order("lpm", queue(), Trie(CACHED))


def test_dfs_weight_heavier_subtree_wins_over_deeper_match_and_arrival() -> None:
    tree = Trie([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9]])
    deep = req("deep", [1, 2, 3, 4, 5, 6, 7, 8, 0])  # one request, match length 8
    popular = [req(f"p{i}", [9, 9, i + 20]) for i in range(3)]  # three requests, match length 2
    got = order("dfs-weight", [deep, *popular], tree)
    assert got == ["p0", "p1", "p2", "deep"]
    assert order("lpm", [deep, *popular], tree) == ["deep", "p0", "p1", "p2"]


def test_dfs_weight_ties_by_first_token() -> None:
    tree = Trie([[8, 1], [3, 1]])
    waiting = [req("a8", [8, 1, 0]), req("a3", [3, 1, 0]), req("b8", [8, 1, 5]), req("b3", [3, 1, 5])]
    assert order("dfs-weight", waiting, tree) == ["a3", "b3", "a8", "b8"]


def test_dfs_weight_interleaved_arrivals_come_out_grouped() -> None:
    tree = Trie([[1, 1], [2, 2]])
    waiting = [req(f"{'ab'[i % 2]}{i}", [1 + i % 2, 1 + i % 2, 50 + i]) for i in range(6)]
    got = order("dfs-weight", waiting, tree)
    assert got == ["a0", "a2", "a4", "b1", "b3", "b5"]  # equal weights: first token 1 before 2


def test_arrival_order_comes_from_arrival_time_not_queue_position() -> None:
    # The scheduler keeps each step's order as its queue: after an lpm step the queue is
    # out of arrival order, and fcfs / ties / the lpm fallback must still follow arrival.
    shuffled = [queue()[i] for i in (4, 0, 6, 2, 1, 5, 3)]
    assert order("fcfs", shuffled, Trie(CACHED)) == rids(queue())
    assert order("lpm", shuffled, Trie(CACHED)) == ["r1", "r4", "r3", "r0", "r5", "r6", "r2"]
    assert order("dfs-weight", shuffled, None) == rids(queue())
    same_time = [req("b", [1]), req("a", [1])]  # equal arrival_time: queue position decides
    assert order("fcfs", same_time, None) == ["b", "a"]


def test_match_leaves_the_last_token_and_includes_output_on_resume() -> None:
    tree = Trie([[1, 2, 3, 4, 5, 6]])
    full = req("full", [1, 2, 3, 4])  # all cached, but the last token is always computed: 3
    longer = req("longer", [1, 2, 3, 4, 5, 0])  # 5
    assert order("lpm", [full, longer], tree) == ["longer", "full"]
    resumed = req("resumed", [1, 2])  # retracted after generating [3, 4, 5, 6, 7]: matches 6
    resumed.output_ids = [3, 4, 5, 6, 7]
    resumed.prefill_len = resumed.num_tokens  # as the scheduler sets it on retraction
    assert order("lpm", [full, longer, resumed], tree) == ["resumed", "longer", "full"]


def test_lof_longest_remaining_output_first() -> None:
    waiting = [
        req("a", [1], max_tokens=10),
        req("b", [1], max_tokens=50, num_output=45),  # 5 left
        req("c", [1], max_tokens=30),
        req("d", [1], max_tokens=40, num_output=30),  # 10 left, ties with a: arrival order
    ]
    assert order("lof", waiting, None) == ["c", "a", "d", "b"]


def test_cache_aware_policies_without_tree_are_fcfs() -> None:
    for name in ("lpm", "dfs-weight"):
        assert order(name, queue(), None) == rids(queue())


def test_lpm_falls_back_to_fcfs_on_a_long_queue() -> None:
    tree = Trie([[1, 2, 3]])

    def waiting(n: int) -> list[Request]:  # later arrivals match better
        return [req(f"r{i}", [1, 2, 3] if i % 2 else [7]) for i in range(n)]

    at_limit = order("lpm", waiting(LPM_MAX_QUEUE), tree)
    assert at_limit[0] == "r1" and at_limit != rids(waiting(LPM_MAX_QUEUE))
    assert order("lpm", waiting(LPM_MAX_QUEUE + 1), tree) == rids(waiting(LPM_MAX_QUEUE + 1))


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_each_request_matched_once_per_call(name: str) -> None:
    tree = Trie(CACHED)
    make_policy(name, NO_BOUND).order(queue(), tree, 0, 0.0)
    assert tree.matches == len(PROMPTS)


@pytest.mark.parametrize("name", POLICIES)
def test_order_is_a_permutation_and_leaves_input_alone(name: str) -> None:
    waiting = queue()
    before = list(waiting)
    got = make_policy(name, NO_BOUND).order(waiting, Trie(CACHED), 0, 0.0)
    assert waiting == before
    assert sorted(map(id, got)) == sorted(map(id, waiting))
    assert make_policy(name, NO_BOUND).order([], Trie(CACHED), 0, 0.0) == []


def test_random_is_reproducible_by_seed_and_a_permutation() -> None:
    waiting = [req(f"r{i}", [i]) for i in range(20)]
    a, b, c = (make_policy("random", NO_BOUND, seed=s) for s in (7, 7, 8))
    seq_a = [rids(a.order(waiting, None, k, 0.0)) for k in range(3)]
    seq_b = [rids(b.order(waiting, None, k, 0.0)) for k in range(3)]
    seq_c = [rids(c.order(waiting, None, k, 0.0)) for k in range(3)]
    assert seq_a == seq_b  # same seed, same sequence of calls -> same orders
    assert seq_a != seq_c
    assert all(sorted(o) == sorted(rids(waiting)) for o in seq_a)
    assert seq_a[0] != rids(waiting) and seq_a[0] != seq_a[1]


def test_unknown_policy_and_bad_bound_rejected() -> None:
    with pytest.raises(ValueError, match="unknown schedule policy"):
        make_policy("sjf", NO_BOUND)
    with pytest.raises(ValueError, match="max_steps"):
        QueueDelayBound(-1, None)
    with pytest.raises(ValueError, match="max_seconds"):
        QueueDelayBound(None, -0.5)


# ---- the queue-delay bound ---------------------------------------------------------------
def test_overdue_requests_go_first_oldest_first_then_policy_order() -> None:
    waiting = queue()
    for i, r in enumerate(waiting):
        r.enqueue_step = i
    # step 10, max_steps 7: r0 (waited 10), r1 (9) and r2 (8) are overdue.
    got = order("lpm", waiting, Trie(CACHED), QueueDelayBound(7, None), step=10)
    assert got == ["r0", "r1", "r2", "r4", "r3", "r5", "r6"]
    # Exactly at the bound is not overdue: step 7 - enqueue 0 = 7 is not > 7.
    assert order("lpm", waiting, Trie(CACHED), QueueDelayBound(7, None), step=7)[0] == "r1"


def test_seconds_bound_uses_arrival_time() -> None:
    waiting = queue()  # arrival_time = i
    got = order("lof", waiting, None, QueueDelayBound(None, 4.5), now=6.0)  # r0 (6 s), r1 (5 s) overdue
    assert got[:2] == ["r0", "r1"]
    assert order("lpm", waiting, Trie(CACHED), QueueDelayBound(None, 4.5), now=6.0)[:3] == ["r0", "r1", "r4"]


def test_steps_count_from_enqueue_step_seconds_from_arrival_time() -> None:
    # A request re-queued at step 95 after a retraction, first arrived at t = 0.
    back = req("back", [9, 9], arrival=0.0, enqueue_step=95)
    warm = req("warm", [1, 2, 3, 4], arrival=50.0, enqueue_step=50)
    tree = Trie([[1, 2, 3]])
    assert order("lpm", [back, warm], tree) == ["warm", "back"]
    assert order("lpm", [back, warm], tree, QueueDelayBound(10, None), step=100) == ["warm", "back"]
    assert order("lpm", [back, warm], tree, QueueDelayBound(4, None), step=100) == ["back", "warm"]
    assert order("lpm", [back, warm], tree, QueueDelayBound(None, 60.0), now=70.0) == ["back", "warm"]
    assert order("lpm", [back, warm], tree, QueueDelayBound(None, 80.0), now=70.0) == ["warm", "back"]


def test_request_without_enqueue_step_is_overdue_by_seconds_only() -> None:
    @dataclass(eq=False)
    class Bare:  # request-like, no enqueue_step
        rid: str
        arrival_time: float

    bound = QueueDelayBound(0, None)
    assert not bound.overdue(Bare("x", 0.0), step=1000, now=1000.0)  # type: ignore[arg-type]
    assert QueueDelayBound(0, 5.0).overdue(Bare("x", 0.0), step=0, now=6.0)  # type: ignore[arg-type]


def simulate(name: str, bound: QueueDelayBound, steps: int) -> int | None:
    """A stream of prefix-sharing requests: each step one new request arrives that matches
    the cache well, and one request is admitted. A cache-cold request waits from step 0.
    Returns the step at which the cold request is admitted (None if never)."""
    prefix = list(range(1, 17))
    tree = Trie([prefix])
    policy = make_policy(name, bound)
    cold = req("cold", [900, 901], arrival=0.0, enqueue_step=0)
    waiting = [cold, req("w-init", prefix + [1000], arrival=0.0, enqueue_step=0)]
    for step in range(steps):
        waiting.append(req(f"w{step}", prefix + [2000 + step], arrival=float(step), enqueue_step=step))
        head = policy.order(waiting, tree, step, float(step))[0]  # the one that fits this step
        waiting.remove(head)
        if head is cold:
            return step
    return None


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_cold_request_starves_without_the_bound(name: str) -> None:
    assert simulate(name, NO_BOUND, 500) is None


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
@pytest.mark.parametrize("k", [0, 3, 25])
def test_step_bound_admits_the_cold_request_within_k_plus_one_steps(name: str, k: int) -> None:
    admitted = simulate(name, QueueDelayBound(k, None), 500)
    assert admitted is not None and admitted <= k + 1
    assert admitted == k + 1  # and not before: until then the policy's own order holds


def test_seconds_bound_admits_the_cold_request() -> None:
    assert simulate("lpm", QueueDelayBound(None, 10.0), 500) == 11  # now = step seconds


# ---- against the real radix tree (compressed edges, splits while matching) -------------
def radix_tree(seqs: list[list[int]]):  # type: ignore[no-untyped-def]
    from lockgate.kvcache.radix import RadixCache

    tree = RadixCache()
    nxt = 0
    for s in seqs:
        tree.insert(np.array(s), np.arange(nxt, nxt + len(s)))
        nxt += len(s)
    return tree


def test_real_radix_tree_gives_the_same_orders() -> None:
    assert order("lpm", queue(), radix_tree(CACHED)) == ["r1", "r4", "r3", "r0", "r5", "r6", "r2"]
    assert order("dfs-weight", queue(), radix_tree(CACHED)) == ["r1", "r4", "r3", "r5", "r0", "r6", "r2"]


def test_dfs_weight_survives_a_split_made_by_a_later_match() -> None:
    tree = radix_tree([[1, 2, 3, 4, 5, 6]])  # one edge
    b = req("b", [1, 2, 3, 9, 0])  # matches 3 tokens: splits the edge into [1,2,3] + [4,5,6]
    a = req("a", [1, 2, 3, 4, 5, 6, 0])
    c = req("c", [1, 2, 3, 4, 5, 6, 1])
    cold = req("cold", [8, 8])
    # a is matched (to the whole edge) before c and b split it; the subtree [1,2,3] holds all
    # three, its child [4,5,6] (a, c) comes before its own request b; cold last.
    assert order("dfs-weight", [cold, a, b, c], tree) == ["a", "c", "b", "cold"]
    tree.check_invariants()
    assert order("dfs-weight", [cold, b, a, c], radix_tree([[1, 2, 3, 4, 5, 6]])) == ["a", "c", "b", "cold"]


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_starvation_bound_with_the_real_radix_tree(name: str) -> None:
    prefix = list(range(1, 17))
    tree = radix_tree([prefix])
    policy = make_policy(name, QueueDelayBound(5, None))
    cold = req("cold", [900, 901])
    waiting = [cold]
    for step in range(1, 50):
        waiting.append(req(f"w{step}", prefix + [2000 + step], arrival=float(step), enqueue_step=step))
        head = policy.order(waiting, tree, step, float(step))[0]
        waiting.remove(head)
        if head is cold:
            break
    assert head is cold and step == 6
