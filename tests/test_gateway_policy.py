"""The gateway's pure parts: prefix block hashing and index, routing keys, the routing policies.

Loads and matches here are made up; the live behaviour (real replicas, real HTTP) is in
test_gateway.py.
"""

from __future__ import annotations

import argparse
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockgate.config import (
    EngineConfig,
    ServerConfig,
    ServerFlags,
    add_config_args,
    config_from_args,
    config_to_args,
    server_config_from_args,
)
from lockgate.gateway.keys import request_key
from lockgate.gateway.policy import Router, acceptable_load, prefix_cache_route
from lockgate.gateway.prefix_index import PrefixIndex, block_hashes
from lockgate.tokenizer.tokenizer import SimTokenizer


def route(loads, matched, total=4, abs_count=16, k=2.0, seed=0):
    return prefix_cache_route(loads, matched, total, imbalance_abs_count=abs_count, std_dev_factor=k,
                              rng=random.Random(seed))


# ---- hashing and the index ---------------------------------------------------------------
def test_block_hashes_chain_the_prefix() -> None:
    a = block_hashes("x" * 10 + "y" * 10 + "z" * 5, 10)
    b = block_hashes("x" * 10 + "Y" * 10 + "z" * 10, 10)
    assert len(a) == 2 and len(b) == 3  # only full blocks
    assert a[0] == b[0] and a[1] != b[1]
    # equal second blocks after different first blocks hash differently (the chain covers the prefix)
    assert block_hashes("a" * 10 + "q" * 10, 10)[1] != block_hashes("b" * 10 + "q" * 10, 10)[1]
    ids = block_hashes([1, 2, 3, 4, 5], 2)
    assert len(ids) == 2 and ids == block_hashes([1, 2, 3, 4, 9], 2)


def test_index_matches_leading_blocks_per_replica() -> None:
    idx = PrefixIndex(100)
    h = block_hashes("abcdefgh", 2)  # 4 blocks
    idx.record(h[:3], "r1")
    idx.record(h[:1], "r2")
    assert idx.match(h, ["r1", "r2", "r3"]) == {"r1": 3, "r2": 1}
    assert idx.match(h, ["r2"]) == {"r2": 1}  # only the candidates asked about
    other = block_hashes("zzcdefgh", 2)  # differs in block 0, so no later block can match
    assert idx.match(other, ["r1", "r2"]) == {}
    idx.forget("r1")
    assert idx.match(h, ["r1", "r2"]) == {"r2": 1}


def test_index_is_bounded_and_evicts_least_recently_used() -> None:
    idx = PrefixIndex(4)
    old = block_hashes("aabb", 2)
    idx.record(old, "r1")
    new = block_hashes("ccddee", 2)
    idx.match(old[:1], ["r1"])  # touch the first old block: it is now more recent than old[1]
    idx.record(new, "r2")
    assert len(idx) == 4
    assert idx.match(old, ["r1"]) == {"r1": 1}  # old[1] was evicted, old[0] survived
    assert idx.match(new, ["r2"]) == {"r2": 3}
    small = PrefixIndex(2)
    long = block_hashes("aabbcc", 2)
    small.record(long, "r1")  # too long for the index: its tail goes, its head stays matchable
    assert small.match(long, ["r1"]) == {"r1": 2}


# ---- routing keys ------------------------------------------------------------------------
def test_request_keys() -> None:
    assert request_key("/v1/completions", b'{"prompt": "hello"}', None) == "hello"
    assert request_key("/v1/completions", b'{"prompt": ["first", "second"]}', None) == "first"
    assert request_key("/v1/completions", b'{"prompt": [5, 6, 7]}', None) == [5, 6, 7]
    assert request_key("/generate", b'{"inputs": "tgi text"}', None) == "tgi text"
    chat = b'{"messages": [{"role": "system", "content": "S"}, {"role": "user", ' \
           b'"content": [{"type": "text", "text": "U"}]}]}'
    assert request_key("/v1/chat/completions", chat, None) == "system\nS\nuser\nU\n"
    tok = SimTokenizer()
    ids = request_key("/v1/chat/completions", chat, tok)
    assert ids == tok.encode(tok.apply_chat_template([{"role": "system", "content": "S"},
                                                      {"role": "user", "content": "U"}]), add_special_tokens=False)
    # unreadable or non-generation bodies have no key (routed by load; the replica judges the body)
    assert request_key("/v1/completions", b"not json", None) is None
    assert request_key("/v1/completions", b'{"prompt": 3}', None) is None
    assert request_key("/tokenize", b'{"prompt": "x"}', None) is None
    assert request_key("/v1/completions", b'{"prompt": "caf\xe9"}', None) is None  # not UTF-8
    assert request_key("/v1/completions", b"[" * 5000 + b"]" * 5000, None) is None  # absurdly deep


# ---- prefix-cache policy with made-up loads -------------------------------------------------
def test_imbalance_overrides_cache_affinity() -> None:
    r = route({"a": 1, "b": 2, "c": 20}, {"c": 4}, abs_count=16)
    assert (r.replica, r.reason) == ("a", "imbalance")
    r = route({"a": 1, "b": 2, "c": 17}, {"c": 4}, abs_count=16)  # spread 16 is not above 16
    assert r.reason != "imbalance"


def test_best_match_wins_then_lower_load() -> None:
    loads = {"a": 3, "b": 2, "c": 2}
    r = route(loads, {"a": 4, "b": 2, "c": 2})
    assert (r.replica, r.reason, r.matched_blocks, r.total_blocks) == ("a", "match", 4, 4)
    r = route(loads, {"a": 2, "b": 2, "c": 1})  # equal match: lower load first
    assert (r.replica, r.reason) == ("b", "match")


def test_hotspot_filter_is_mean_plus_k_stddev() -> None:
    loads = {"a": 4, "b": 0, "c": 2}  # mean 2, population stddev sqrt(8/3) = 1.633
    assert acceptable_load(loads, 1.0) == pytest.approx(2 + math.sqrt(8 / 3))
    r = route(loads, {"a": 3, "c": 1}, k=1.0)  # limit 3.63: a (4) is a hotspot, c (2) is fine
    assert (r.replica, r.reason) == ("c", "match")
    r = route(loads, {"a": 3, "c": 1}, k=2.0)  # limit 5.27: a is acceptable and matches best
    assert (r.replica, r.reason) == ("a", "match")
    r = route(loads, {"a": 3}, k=1.0)  # the only match is a hotspot: least-request
    assert (r.replica, r.reason, r.matched_blocks) == ("b", "overloaded", 0)


def test_no_match_goes_to_least_loaded() -> None:
    r = route({"a": 5, "b": 1, "c": 3}, {})
    assert (r.replica, r.reason) == ("b", "no-match")


@settings(max_examples=300, deadline=None)
@given(loads=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 40), min_size=1),
       raw_matches=st.dictionaries(st.sampled_from("abcdefg"), st.integers(1, 8)),
       abs_count=st.integers(0, 20), k=st.floats(0, 3))
def test_prefix_cache_route_properties(loads, raw_matches, abs_count, k) -> None:
    matched = {r: min(m, 8) for r, m in raw_matches.items()}
    r = route(loads, matched, total=8, abs_count=abs_count, k=k)
    assert r.replica in loads
    low = min(loads.values())
    if max(loads.values()) - low > abs_count:
        assert r.reason == "imbalance" and loads[r.replica] == low
        return
    limit = acceptable_load(loads, k)
    ok = [x for x in matched if x in loads and loads[x] <= limit]
    if ok:
        best = min(ok, key=lambda x: (-matched[x], loads[x]))
        assert r.reason == "match" and (matched[r.replica], loads[r.replica]) == (matched[best], loads[best])
    else:
        assert r.reason in ("no-match", "overloaded") and loads[r.replica] == low


# ---- the other policies ------------------------------------------------------------------------
def test_round_robin_least_request_power_of_two() -> None:
    rr = Router("round-robin")
    assert [rr.choose({"b": 0, "a": 9}).replica for _ in range(4)] == ["a", "b", "a", "b"]
    assert Router("least-request").choose({"a": 3, "b": 1, "c": 2}).replica == "b"
    p2 = Router("power-of-two", seed=1)
    loads = {"a": 0, "b": 10, "c": 20}
    picks = [p2.choose(loads).replica for _ in range(200)]
    assert "c" not in picks  # c is never the lighter of two distinct replicas
    assert picks.count("b") > 0 and picks.count("a") > picks.count("b")
    seen = {Router("random", seed=s).choose(loads).replica for s in range(30)}
    assert seen == {"a", "b", "c"}
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router("fastest")


def test_router_records_where_prefixes_went() -> None:
    router = Router("prefix-cache")
    h = block_hashes("p" * 40, 8)
    first = router.choose({"a": 0, "b": 0}, h)
    assert first.reason == "no-match"
    again = router.choose({"a": 1, "b": 1}, h)
    assert (again.replica, again.reason, again.matched_blocks) == (first.replica, "match", 5)
    router.forget(first.replica)
    assert router.choose({"a": 0, "b": 0}, h[:2]).reason == "no-match"


# ---- flags round trip (serve --dp starts replicas with the same config) ----------------------
def test_config_to_args_round_trips() -> None:
    p = argparse.ArgumentParser()
    add_config_args(p)
    add_config_args(p, ServerFlags)
    cfg = EngineConfig.build(model="sim", max_total_tokens=4096, schedule_policy="lpm", disable_prefix_cache=True,
                             num_threads=1, sim_step_ms=3.5)
    server = ServerConfig(port=8123, shutdown_timeout=2.5, served_model_name="m")
    ns = p.parse_args([*config_to_args(cfg), *config_to_args(server, ServerConfig)])
    assert config_from_args(ns) == cfg
    assert server_config_from_args(ns) == server
