"""The work a scheduler holds and has not done yet, counted for the queue forecast (engine/forecast.py).

Owns one function, ``measure``: given the waiting queue, the running set and the prefix cache, it
counts

* ``prefill_tokens``: prompt tokens still to compute, over the waiting requests and the running ones
  still prefilling. A request's span to compute starts after what it computed already (running) or
  after the longest prefix the cache holds for it now (waiting; ``RadixCache.peek_prefix``, which
  changes nothing). Spans that several queued requests share (a burst on one system prompt, before any
  of it is cached) are counted once: the scheduler computes them once (in-flight sharing) and the
  others reuse them. Sharing is found by chained hashes of ``BLOCK``-token pieces (a piece's hash
  covers the whole prefix up to its end, and the adapter, so equal hashes mean equal prefixes);
* ``decode_tokens``: tokens the requests may still generate (``max_tokens`` minus their output so far;
  EOS may end them sooner, so this is an upper bound), with the longest such run, and the shortest
  among running requests that are decoding (when the queue is blocked on KV or on
  ``--max-running-requests``, the first to finish frees room).

Invariants: nothing here changes the queue, the running set or the tree (no split, no LRU touch, no
lock). Cost: O(prompt tokens / BLOCK) hash steps per request examined; past ``limit`` requests the
rest are extrapolated from the mean of those examined, so a deep queue costs a bounded time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lockgate.kvcache.radix import RadixCache
from lockgate.scheduler.request import Request

BLOCK = 64  # tokens per hashed piece when finding spans queued requests share


@dataclass(frozen=True)
class Backlog:
    prefill_tokens: int = 0  # prompt tokens to compute: waiting + prefilling, shared spans and cached prefixes once
    decode_tokens: int = 0  # tokens the requests may still generate (running + waiting)
    longest_decode: int = 0  # the most any one request may still generate
    shortest_running_decode: int = 0  # the fewest a running, decoding request may still generate (0: none decoding)
    decoding: int = 0  # running requests past their prefill
    waiting: int = 0


def measure(waiting: Iterable[Request], running: Iterable[Request], tree: RadixCache | None,
            limit: int = 256) -> Backlog:
    """The backlog of a scheduler's queue and running set (see the module docstring)."""
    pieces: dict[int, int] = {}  # piece hash -> tokens of it still to compute (max over the requests holding it)
    decode_tokens = longest = decoding = n_waiting = examined = extra = 0
    shortest: int | None = None
    to_prefill: list[tuple[Request, bool]] = []
    for r in running:
        left = max(0, r.left)
        decode_tokens += left
        longest = max(longest, left)
        if r.is_prefilling:
            to_prefill.append((r, False))
        else:
            decoding += 1
            shortest = left if shortest is None else min(shortest, left)
    for r in waiting:
        n_waiting += 1
        left = max(0, r.left)
        decode_tokens += left
        longest = max(longest, left)
        to_prefill.append((r, True))
    prefill = 0
    for r, is_waiting in to_prefill:
        if examined >= limit:
            extra += 1
            continue
        examined += 1
        prefill += _add_spans(r, is_waiting, tree, pieces)
    if extra:
        prefill += round(extra * prefill / examined)
    return Backlog(prefill_tokens=prefill, decode_tokens=decode_tokens, longest_decode=longest,
                   shortest_running_decode=shortest or 0, decoding=decoding, waiting=n_waiting)


def _add_spans(r: Request, is_waiting: bool, tree: RadixCache | None, pieces: dict[int, int]) -> int:
    """Record ``r``'s pieces still to compute; returns the tokens this added to the backlog."""
    end = r.prefill_len
    start = r.num_computed
    if end <= start:
        return 0
    tokens = r.token_at(0, end)
    if is_waiting and tree is not None and end > 1:
        start = max(start, min(tree.peek_prefix(tokens[:end - 1], ns=r.adapter), end - 1))
    added = 0
    h = hash(("adapter", r.adapter))
    for lo in range(0, end, BLOCK):
        hi = min(lo + BLOCK, end)
        h = hash((h, tokens[lo:hi].tobytes()))
        if hi <= start:
            continue
        todo = hi - max(lo, start)
        had = pieces.get(h, 0)
        if had < todo:
            pieces[h] = todo
            added += todo - had
    return added
