"""Routing policies: pick one replica for a request from the replicas' loads (pure decisions).

A policy sees ``loads`` (replica -> requests it is running or queueing, as the gateway counts them;
only healthy candidates are passed) and, for ``prefix-cache``, the request's prefix block hashes. It
returns a ``Route``: the replica plus why, which the proxy reports in ``x-lockgate-route``.

``prefix-cache`` is the cache-aware rule (after AIBrix; docs/design.md, Gateway):

1. if ``max(load) - min(load) > imbalance_abs_count`` the fleet is imbalanced: least-request
   (reason ``imbalance``);
2. else the replicas holding a prefix of the prompt, sorted by match fraction descending then load
   ascending; the first whose load is ``<= mean + std_dev_factor * stddev`` (over all candidates)
   wins (reason ``match``);
3. else least-request (reason ``no-match``, or ``overloaded`` when matches existed but all were
   too loaded).

The chosen replica is then recorded as holding the prompt's blocks. Ties in least-request are
broken at random (seeded), so equal replicas share cold traffic.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lockgate.gateway.prefix_index import PrefixIndex

POLICIES = ("prefix-cache", "round-robin", "random", "least-request", "power-of-two")


@dataclass(frozen=True)
class Route:
    replica: str
    policy: str
    reason: str
    matched_blocks: int = 0
    total_blocks: int = 0

    def header(self) -> str:
        text = f"policy={self.policy}; reason={self.reason}"
        if self.policy == "prefix-cache":
            text += f"; matched_blocks={self.matched_blocks}; total_blocks={self.total_blocks}"
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


class Router:
    """One routing policy with its state (round-robin cursor, rng, prefix index)."""

    def __init__(self, policy: str, *, block_number: int = 200_000, imbalance_abs_count: int = 16,
                 std_dev_factor: float = 2.0, seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.index = PrefixIndex(block_number)
        self.imbalance_abs_count = imbalance_abs_count
        self.std_dev_factor = std_dev_factor
        self.rng = random.Random(seed)
        self._next = 0

    def choose(self, loads: Mapping[str, int], hashes: Sequence[bytes] = ()) -> Route:
        """Pick a replica among ``loads``' keys (non-empty) and, for prefix-cache, record the blocks there."""
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
        else:
            matched = self.index.match(hashes, names)
            route = prefix_cache_route(loads, matched, len(hashes), imbalance_abs_count=self.imbalance_abs_count,
                                       std_dev_factor=self.std_dev_factor, rng=self.rng)
            self.index.record(hashes, route.replica)
        return route

    def forget(self, replica: str) -> None:
        self.index.forget(replica)
