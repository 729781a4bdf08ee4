"""Routing policies: pick one replica for a request from the replicas' loads (pure decisions).

A policy sees ``loads`` (replica -> requests it is running or queueing, as the gateway counts them;
only healthy candidates are passed) and, for ``prefix-cache`` and ``forecast``, the request's prefix
block hashes; ``forecast`` also sees each replica's ``ReplicaForecast`` (its queue ETA and prefill
rate, as the gateway estimates them now). It returns a ``Route``: the replica plus why, which the
proxy reports in ``x-lockgate-route``.

``prefix-cache`` is the cache-aware rule (after AIBrix; docs/design.md, Gateway):

1. if ``max(load) - min(load) > imbalance_abs_count`` the fleet is imbalanced: least-request
   (reason ``imbalance``);
2. else the replicas holding a prefix of the prompt, sorted by match fraction descending then load
   ascending; the first whose load is ``<= mean + std_dev_factor * stddev`` (over all candidates)
   wins (reason ``match``);
3. else least-request (reason ``no-match``, or ``overloaded`` when matches existed but all were
   too loaded).

``forecast`` keeps both guards and replaces the match ordering by an estimate of time:

1. imbalanced: least-request (reason ``imbalance``), as above;
2. the candidates are the replicas whose load is ``<= mean + std_dev_factor * stddev``; each is
   scored ``eta + u / rate + d * step + work_weight * (u - u_min) / rate``, where ``eta`` is its
   queue ETA, ``u`` the prompt tokens it would have to prefill (the prompt's tokens minus its matched
   blocks' tokens), ``u_min`` the least ``u`` among the candidates, ``rate`` its prefill tokens/s,
   ``step`` its decode step time (both as it measured them; the candidates' median when it has not
   reported one, ``DEFAULT_PREFILL_TOKENS_PER_S`` and 0 when none has) and ``d`` the tokens the
   request may generate, up to ``DECODE_HORIZON`` (``DEFAULT_OUTPUT_TOKENS`` when it does not say).
   The first two terms are the request's estimated time to first token there; the third its decode
   there (a replica decoding a big batch takes longer per token: what its open requests cost the
   newcomer, which its queue ETA does not show); the last is the prefill the choice adds to the
   fleet beyond the best cached option, which every request queued after it there waits for too
   (without it, a replica that is a few tokens' prefill quicker wins every tie, and each group's
   prefix ends up computed and cached on every replica).
3. scores within ``TIE_FRACTION`` of the least, plus ``TIE_S``, plus the least own-prefill time among
   the candidates are ties, broken by the longest match, then (among cold ties: no tied replica holds
   any of the prompt) by the fewest prefixes homed there recently, then the lowest load, then at random
   (seeded). The forecast is a noisy estimate, as fresh as the last poll (two equal replicas measure
   rates a few percent apart; a burst moves a queue by whole prefills between polls; the burst about
   to arrive at the other replica is not in it), and a request that leaves its prefix's replica takes
   its session with it (the next turn matches best where this one went), so a small gain now is paid
   for in imbalance later: differences below that margin are not acted on. So a cold request (no
   replica holds its prefix; the placement that decides where the requests sharing it will go) is
   balanced unless some replica's queue is clearly longer, and a cached request leaves its
   replica only when the time saved elsewhere is clear (measured: with 10% + 10 ms, multi-turn
   conversations moved on sub-second queue differences and lost 15% of prefix-cache's throughput on
   the sim fleet of docs/performance.md, "What features cost").

Prefixes homed (``Router.homed``): each cold request the forecast places starts a prefix there that
the requests sharing it (a group's, a conversation's later turns) will follow, so the load it brings
is not in the open-request count when it is placed. The router counts, per replica, the cold
placements it made, decayed with a half-life of ``HOMED_HALF_LIFE`` seconds, and balances cold traffic
on that count first: new groups and conversations alternate instead of following the momentary
request counts (measured: least-request placement split 8 groups 5 / 3 over 2 replicas in about half
the runs, each such run 20% slower, on the same sim fleet).

Reasons: ``match`` (the winner holds the longest prefix any replica holds), ``forecast`` (a less
cached replica won on time), ``overloaded`` (the best-cached replicas were above the load limit),
``no-match`` (no replica holds a prefix).

Both record the chosen replica as holding the prompt's blocks. Ties in least-request are broken at
random (seeded), so equal replicas share cold traffic.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from lockgate.gateway.prefix_index import PrefixIndex

POLICIES = ("prefix-cache", "forecast", "round-robin", "random", "least-request", "power-of-two")
PREFIX_POLICIES = ("prefix-cache", "forecast")  # the policies that hash prompts and keep the prefix index
DEFAULT_PREFILL_TOKENS_PER_S = 1000.0  # when no candidate has reported a measured prefill rate yet
DEFAULT_OUTPUT_TOKENS = 64  # forecast: a request that does not say how many tokens it may generate
DECODE_HORIZON = 256  # forecast: decode tokens priced at most (later steps run in a batch unknown now)
HOMED_HALF_LIFE = 60.0  # forecast: seconds for a replica's count of recently homed prefixes to halve
TIE_FRACTION = 0.25  # forecast: scores within 25% of the least, plus 0.25 s, plus the least own prefill
TIE_S = 0.25  # among the candidates, are ties (broken by match length, then load)


@dataclass(frozen=True)
class ReplicaForecast:
    """What the gateway expects of one replica now (replicas.Replica.forecast)."""

    queue_eta_s: float = 0.0  # before a request sent now would start its prefill there
    prefill_tokens_per_s: float | None = None  # measured by the replica; None: not reported yet
    decode_step_s: float | None = None  # its recent decode step time; None: not reported yet


@dataclass(frozen=True)
class Route:
    replica: str
    policy: str
    reason: str
    matched_blocks: int = 0
    total_blocks: int = 0
    est_ttft_s: float | None = None  # forecast: the winner's queue ETA + its own uncached prefill
    est_prefill_s: float | None = None  # forecast: that uncached prefill alone (the work it adds there)

    def header(self) -> str:
        text = f"policy={self.policy}; reason={self.reason}"
        if self.policy in PREFIX_POLICIES:
            text += f"; matched_blocks={self.matched_blocks}; total_blocks={self.total_blocks}"
        if self.est_ttft_s is not None:
            text += f"; est_ttft_s={self.est_ttft_s:.3f}"
        return text


def least_loaded(loads: Mapping[str, int], rng: random.Random) -> str:
    low = min(loads.values())
    return rng.choice(sorted(r for r, n in loads.items() if n == low))


def is_imbalanced(loads: Mapping[str, int], abs_count: int) -> bool:
    return max(loads.values()) - min(loads.values()) > abs_count


def acceptable_load(loads: Mapping[str, int], std_dev_factor: float) -> float:
    """mean + factor * population stddev of the loads: a matching replica above this is a hotspot."""
    values = list(loads.values())
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return mean + std_dev_factor * std


def prefix_cache_route(loads: Mapping[str, int], matched: Mapping[str, int], total_blocks: int, *,
                       imbalance_abs_count: int, std_dev_factor: float, rng: random.Random) -> Route:
    """The prefix-cache decision for one request (see the module docstring); ``loads`` is non-empty."""
    def fallback(reason: str, blocks: int = 0) -> Route:
        return Route(least_loaded(loads, rng), "prefix-cache", reason, blocks, total_blocks)

    if is_imbalanced(loads, imbalance_abs_count):
        return fallback("imbalance")
    candidates = [r for r in matched if r in loads and matched[r] > 0]
    if not candidates:
        return fallback("no-match")
    limit = acceptable_load(loads, std_dev_factor)
    for r in sorted(candidates, key=lambda r: (-matched[r], loads[r], r)):
        if loads[r] <= limit:
            return Route(r, "prefix-cache", "match", matched[r], total_blocks)
    return fallback("overloaded")


def forecast_route(loads: Mapping[str, int], matched: Mapping[str, int], total_blocks: int, *,
                   forecasts: Mapping[str, ReplicaForecast], prompt_tokens: float, block_tokens: float,
                   imbalance_abs_count: int, std_dev_factor: float, work_weight: float,
                   rng: random.Random, output_tokens: int | None = None,
                   homed: Mapping[str, float] | None = None) -> Route:
    """The forecast decision for one request (see the module docstring); ``loads`` is non-empty.
    ``prompt_tokens``: the prompt's length in the replicas' tokens (estimated); ``block_tokens``:
    tokens per prefix block; ``output_tokens``: what it may generate (None: not said); ``homed``:
    prefixes recently homed per replica (decayed; missing: 0); a replica missing from ``forecasts``
    has an empty queue and no rates."""
    if is_imbalanced(loads, imbalance_abs_count):
        chosen = least_loaded(loads, rng)
        return Route(chosen, "forecast", "imbalance", matched.get(chosen, 0), total_blocks)
    limit = acceptable_load(loads, std_dev_factor)
    names = sorted(r for r in loads if loads[r] <= limit)  # never empty: the least loaded is <= mean
    known = [f.prefill_tokens_per_s for r in names if (f := forecasts.get(r)) and f.prefill_tokens_per_s]
    fallback_rate = statistics.median(known) if known else DEFAULT_PREFILL_TOKENS_PER_S
    steps = [f.decode_step_s for r in names if (f := forecasts.get(r)) and f.decode_step_s]
    fallback_step = statistics.median(steps) if steps else 0.0
    decode = min(DECODE_HORIZON, output_tokens if output_tokens is not None else DEFAULT_OUTPUT_TOKENS)
    uncached = {r: max(0.0, prompt_tokens - matched.get(r, 0) * block_tokens) for r in names}
    least = min(uncached.values())
    scores: dict[str, tuple[float, float, float]] = {}  # replica -> (score, ttft, own prefill seconds)
    for r in names:
        f = forecasts.get(r, ReplicaForecast())
        rate = f.prefill_tokens_per_s or fallback_rate
        prefill = uncached[r] / rate
        ttft = max(0.0, f.queue_eta_s) + prefill
        scores[r] = (ttft + decode * (f.decode_step_s or fallback_step) + work_weight * (uncached[r] - least) / rate,
                     ttft, prefill)
    limit_s = (min(v[0] for v in scores.values()) * (1 + TIE_FRACTION) + TIE_S
               + min(v[2] for v in scores.values()))
    tied = [r for r in names if scores[r][0] <= limit_s]
    cold = all(matched.get(r, 0) == 0 for r in tied)
    homed = homed or {}

    def order(r: str) -> tuple[float, float, int]:
        return (-matched.get(r, 0), round(homed.get(r, 0.0), 3) if cold else 0.0, loads[r])

    best = min(order(r) for r in tied)
    winner = rng.choice([r for r in tied if order(r) == best])
    top_all = max((matched.get(r, 0) for r in loads), default=0)
    top_ok = max(matched.get(r, 0) for r in names)
    got = matched.get(winner, 0)
    if top_all == 0:
        reason = "no-match"
    elif got == top_all:
        reason = "match"
    elif top_ok < top_all:
        reason = "overloaded"
    else:
        reason = "forecast"
    return Route(winner, "forecast", reason, got, total_blocks, est_ttft_s=scores[winner][1],
                 est_prefill_s=scores[winner][2])


class Router:
    """One routing policy with its state (round-robin cursor, rng, prefix index, and for ``forecast``
    the characters-per-token ratio of text keys, learned from the replicas' token counts)."""

    TEXT_TOKENS_PER_KEY = 0.25  # a text key's tokens per character until a replica's count is seen
    RATIO_WEIGHT = 0.1  # weight of the newest request in that moving average

    def __init__(self, policy: str, *, block_number: int = 200_000, imbalance_abs_count: int = 16,
                 std_dev_factor: float = 2.0, seed: int = 0, work_weight: float = 1.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.index = PrefixIndex(block_number)
        self.imbalance_abs_count = imbalance_abs_count
        self.std_dev_factor = std_dev_factor
        self.work_weight = work_weight
        self.rng = random.Random(seed)
        self._next = 0
        self.text_tokens_per_key: float | None = None  # learned: replica tokens per character of a text key
        self._homed: dict[str, tuple[float, float]] = {}  # forecast: replica -> (decayed count, as of when)

    def homed(self, now: float | None = None) -> dict[str, float]:
        """Prefixes the forecast homed on each replica recently (cold placements, decayed)."""
        now = time.monotonic() if now is None else now
        return {r: n * 0.5 ** (max(0.0, now - t) / HOMED_HALF_LIFE) for r, (n, t) in self._homed.items()}

    def _home(self, replica: str, now: float) -> None:
        n = self.homed(now).get(replica, 0.0)
        self._homed[replica] = (n + 1.0, now)

    def tokens_per_key(self, text: bool) -> float:
        """Replica tokens per routing-key element: 1 for token-id keys, learned (or a guess) for text."""
        if not text:
            return 1.0
        return self.text_tokens_per_key if self.text_tokens_per_key is not None else self.TEXT_TOKENS_PER_KEY

    def learn_tokens(self, key_len: int, prompt_tokens: int) -> None:
        """A replica counted ``prompt_tokens`` for a text key of ``key_len`` characters."""
        if key_len <= 0 or prompt_tokens <= 0:
            return
        sample = min(4.0, prompt_tokens / key_len)
        old = self.text_tokens_per_key
        self.text_tokens_per_key = sample if old is None else old + self.RATIO_WEIGHT * (sample - old)

    def choose(self, loads: Mapping[str, int], hashes: Sequence[bytes] = (), *,
               forecasts: Mapping[str, ReplicaForecast] | None = None, prompt_tokens: float = 0.0,
               block_tokens: float = 1.0, output_tokens: int | None = None) -> Route:
        """Pick a replica among ``loads``' keys (non-empty) and, for the prefix policies, record the
        blocks there. ``forecasts``, ``prompt_tokens``, ``block_tokens`` and ``output_tokens`` serve
        ``forecast``."""
        if not loads:
            raise ValueError("no replica to route to")
        names = sorted(loads)
        p = self.policy
        if p == "round-robin":
            route = Route(names[self._next % len(names)], p, "round-robin")
            self._next += 1
        elif p == "random":
            route = Route(self.rng.choice(names), p, "random")
        elif p == "least-request":
            route = Route(least_loaded(loads, self.rng), p, "least-request")
        elif p == "power-of-two":
            pair = self.rng.sample(names, min(2, len(names)))
            route = Route(min(pair, key=lambda r: (loads[r], r)), p, "power-of-two")
        elif p == "forecast":
            now = time.monotonic()
            matched = self.index.match(hashes, names)
            route = forecast_route(loads, matched, len(hashes), forecasts=forecasts or {},
                                   prompt_tokens=prompt_tokens, block_tokens=block_tokens,
                                   imbalance_abs_count=self.imbalance_abs_count, std_dev_factor=self.std_dev_factor,
                                   work_weight=self.work_weight, rng=self.rng, output_tokens=output_tokens,
                                   homed=self.homed(now))
            if hashes and route.matched_blocks == 0:  # a prefix starts here: what shares it will follow
                self._home(route.replica, now)
            self.index.record(hashes, route.replica)
        else:
            matched = self.index.match(hashes, names)
            route = prefix_cache_route(loads, matched, len(hashes), imbalance_abs_count=self.imbalance_abs_count,
                                       std_dev_factor=self.std_dev_factor, rng=self.rng)
            # a fallback may still land where a prefix is: report (and count as predicted) what is there
            route = replace(route, matched_blocks=matched.get(route.replica, 0))
            self.index.record(hashes, route.replica)
        return route

    def forget(self, replica: str) -> None:
        self.index.forget(replica)
        self._homed.pop(replica, None)
