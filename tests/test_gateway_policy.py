"""The gateway's pure parts: prefix block hashing and index, routing keys, the routing policies
(prefix-cache and forecast with made-up loads, matches and forecasts).

Loads and matches here are made up; the live behaviour (real replicas, real HTTP) is in
test_gateway.py.
"""

from __future__ import annotations

import argparse
import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockgate.config import EngineConfig, add_config_args, config_from_args, config_to_args
from lockgate.gateway.keys import read_generation, request_key, request_max_tokens, request_model
from lockgate.gateway.policy import (
    DECODE_HORIZON,
    DEFAULT_OUTPUT_TOKENS,
    DEFAULT_PREFILL_TOKENS_PER_S,
    HOMED_HALF_LIFE,
    TIE_FRACTION,
    TIE_S,
    ReplicaForecast,
    Router,
    acceptable_load,
    forecast_route,
    prefix_cache_route,
)
from lockgate.gateway.prefix_index import PrefixIndex, block_hashes
from lockgate.server_config import ServerConfig, ServerFlags, server_config_from_args
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
def key(path: str, body: bytes, tokenizer=None):
    return request_key(path, read_generation(path, body), tokenizer)


def test_request_keys() -> None:
    assert key("/v1/completions", b'{"prompt": "hello"}', None) == "hello"
    assert key("/v1/completions", b'{"prompt": ["first", "second"]}', None) == "first"
    assert key("/v1/completions", b'{"prompt": [5, 6, 7]}', None) == [5, 6, 7]
    assert key("/generate", b'{"inputs": "tgi text"}', None) == "tgi text"
    chat = b'{"messages": [{"role": "system", "content": "S"}, {"role": "user", ' \
           b'"content": [{"type": "text", "text": "U"}]}]}'
    assert key("/v1/chat/completions", chat, None) == "system\nS\nuser\nU\n"
    tok = SimTokenizer()
    ids = key("/v1/chat/completions", chat, tok)
    assert ids == tok.encode(tok.apply_chat_template([{"role": "system", "content": "S"},
                                                      {"role": "user", "content": "U"}]), add_special_tokens=False)
    # unreadable or non-generation bodies have no key (routed by load; the replica judges the body)
    assert key("/v1/completions", b"not json", None) is None
    assert key("/v1/completions", b'{"prompt": 3}', None) is None
    assert key("/tokenize", b'{"prompt": "x"}', None) is None
    assert key("/v1/completions", b'{"prompt": "caf\xe9"}', None) is None  # not UTF-8
    assert key("/v1/completions", b"[" * 5000 + b"]" * 5000, None) is None  # absurdly deep
    # the model and max tokens come from the same decoded body; absent or unreadable -> the API's default / None
    data = read_generation("/v1/completions", b'{"prompt": "p", "model": "sql", "max_tokens": 7}')
    assert (request_model("/v1/completions", data), request_max_tokens("/v1/completions", data)) == ("sql", 7)
    tgi = read_generation("/generate", b'{"inputs": "x", "parameters": {"adapter_id": "a"}}')
    assert (request_model("/generate", tgi), request_max_tokens("/generate", tgi)) == ("a", 20)
    assert request_max_tokens("/v1/chat/completions", read_generation("/v1/chat/completions", b'{"messages": []}')) is None
    assert read_generation("/v1/completions", b"[1, 2]") is None and read_generation("/health", b"{}") is None


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


# ---- forecast policy with made-up loads and forecasts ---------------------------------------------
def fc_route(loads, matched, forecasts, prompt=1000.0, block=100.0, total=10, abs_count=16, k=2.0, w=1.0, seed=0,
             out=None, homed=None):
    return forecast_route(loads, matched, total, forecasts=forecasts, prompt_tokens=prompt, block_tokens=block,
                          imbalance_abs_count=abs_count, std_dev_factor=k, work_weight=w, rng=random.Random(seed),
                          output_tokens=out, homed=homed)


def test_forecast_prefers_the_cached_replica_while_its_queue_is_shorter_than_the_prefill_saved() -> None:
    loads = {"a": 1, "b": 1}
    matched = {"a": 9}  # a holds 900 of 1000 tokens; b would prefill all 1000 (1 s at 1000 tok/s)
    rate = ReplicaForecast(0.0, 1000.0)
    r = fc_route(loads, matched, {"a": rate, "b": rate})
    assert (r.replica, r.reason, r.matched_blocks) == ("a", "match", 9)
    assert r.est_ttft_s == pytest.approx(0.1) and r.est_prefill_s == pytest.approx(0.1)
    # a's queue takes 1.5 s: its TTFT (1.6 s) is worse than b's (1.0 s), but b would also add 0.9 s of
    # prefill the fleet need not do; score a 1.6 vs b 1.0 + 0.9 = 1.9: a still wins
    r = fc_route(loads, matched, {"a": ReplicaForecast(1.5, 1000.0), "b": rate})
    assert (r.replica, r.reason) == ("a", "match")
    # 2.5 s: a (2.6) is within 25% + 0.25 s + the least own prefill (a's 0.1 s) of b (1.9): a near-tie,
    # and the longer match keeps it
    r = fc_route(loads, matched, {"a": ReplicaForecast(2.5, 1000.0), "b": rate})
    assert (r.replica, r.reason) == ("a", "match")
    # well past the saved prefill twice over (work weight 1) and the margin: b wins on time
    r = fc_route(loads, matched, {"a": ReplicaForecast(3.0, 1000.0), "b": rate})
    assert (r.replica, r.reason, r.matched_blocks) == ("b", "forecast", 0)
    assert r.est_ttft_s == pytest.approx(1.0)
    # work weight 0: the request's own TTFT alone decides (a at 2.1 s > b at 1.0 s, past the margin)
    r = fc_route(loads, matched, {"a": ReplicaForecast(2.0, 1000.0), "b": rate}, w=0.0)
    assert r.replica == "b"
    assert fc_route(loads, matched, {"a": ReplicaForecast(2.0, 1000.0), "b": rate}).replica == "a"  # w = 1


def test_forecast_weighs_each_replica_at_its_own_prefill_rate() -> None:
    # no match anywhere: the whole prompt everywhere; a prefills 4x faster (0.25 s against 1 s): clearly
    # quicker, so it wins although it is busier
    fast, slow = ReplicaForecast(0.0, 4000.0), ReplicaForecast(0.0, 1000.0)
    r = fc_route({"a": 2, "b": 0}, {}, {"a": fast, "b": slow})
    assert (r.replica, r.reason) == ("a", "no-match")
    # a's queue of 0.9 s makes it 1.15 s against 1.0 s: a near-tie for a cold request: the less loaded wins
    r = fc_route({"a": 2, "b": 0}, {}, {"a": ReplicaForecast(0.9, 4000.0), "b": slow})
    assert r.replica == "b"
    r = fc_route({"a": 0, "b": 2}, {}, {"a": ReplicaForecast(2.0, 4000.0), "b": slow})
    assert r.replica == "b"  # 2.25 s against 1.0 s: clearly slower, whatever the loads
    # a replica without a reported rate is priced at the others' median; none reported: the default
    r = fc_route({"a": 0, "b": 0, "c": 0}, {"c": 5}, {"a": ReplicaForecast(0.0, 2000.0),
                                                       "b": ReplicaForecast(0.0, 4000.0)})
    assert r.replica == "c" and r.est_ttft_s == pytest.approx(500 / 3000)
    r = fc_route({"a": 0, "b": 0}, {"b": 5}, {})
    assert r.replica == "b" and r.est_ttft_s == pytest.approx(500 / DEFAULT_PREFILL_TOKENS_PER_S)


def test_forecast_prices_the_decode_at_each_replicas_step_time() -> None:
    # both hold the prefix; b decodes a big batch (50 ms a step against a's 20 ms): 64 tokens cost 1.9 s more
    loads = {"a": 4, "b": 2}
    forecasts = {"a": ReplicaForecast(0.0, 1000.0, 0.020), "b": ReplicaForecast(0.0, 1000.0, 0.050)}
    r = fc_route(loads, {"a": 9, "b": 9}, forecasts, out=64)
    assert (r.replica, r.reason) == ("a", "match")
    # a short answer makes the steps matter less than the load (a near-tie: the less loaded b)
    assert fc_route(loads, {"a": 9, "b": 9}, forecasts, out=2).replica == "b"
    # a long one is priced up to DECODE_HORIZON tokens only; unknown length: DEFAULT_OUTPUT_TOKENS
    capped = fc_route(loads, {"a": 9}, {"a": ReplicaForecast(0.0, 1000.0, 0.050), "b": ReplicaForecast(0.0, 1000.0,
                                                                                                        0.020)},
                      out=100_000)
    # a: 0.1 + 256 x 0.05 = 12.9; b: 1.0 + 256 x 0.02 + 0.9 = 7.0: b, though 100,000 tokens would say so louder
    assert capped.replica == "b" and capped.reason == "forecast"
    # a replica that reports no step time is priced at the others' median
    r = fc_route({"a": 0, "b": 0, "c": 0}, {"a": 9, "b": 9, "c": 9},
                 {"a": ReplicaForecast(0.0, 1000.0, 0.010), "b": ReplicaForecast(0.0, 1000.0, 0.030),
                  "c": ReplicaForecast(0.0, 1000.0)}, out=DECODE_HORIZON)
    assert r.replica == "a"  # c counts as 20 ms a step, b 30 ms


def test_forecast_keeps_the_imbalance_and_stddev_guards() -> None:
    fast = ReplicaForecast(0.0, 1000.0)
    # spread 20 > 16: least-request whatever the forecasts say (c has the prefix and an empty queue)
    r = fc_route({"a": 1, "b": 2, "c": 21}, {"c": 10, "a": 3}, {"a": ReplicaForecast(30.0, 1000.0), "c": fast})
    assert (r.replica, r.reason, r.matched_blocks) == ("a", "imbalance", 3)
    # mean + 1 x stddev = 3.63: a (4) is out however good its forecast; c (2) holds less: overloaded
    loads = {"a": 4, "b": 0, "c": 2}
    r = fc_route(loads, {"a": 10, "c": 5}, {"a": fast, "b": fast, "c": fast}, k=1.0)
    assert (r.replica, r.reason, r.matched_blocks) == ("c", "overloaded", 5)
    r = fc_route(loads, {"a": 10, "c": 5}, {"a": fast, "b": fast, "c": fast}, k=2.0)
    assert (r.replica, r.reason) == ("a", "match")


def test_forecast_ties_go_to_the_longest_match_then_the_least_loaded_then_at_random() -> None:
    seen = {fc_route({"a": 1, "b": 0, "c": 0}, {}, {}, seed=s).replica for s in range(20)}
    assert seen == {"b", "c"}
    # rates measured 5% apart are a near-tie: cold traffic is balanced by load, not sent to the "faster"
    forecasts = {"a": ReplicaForecast(0.0, 1050.0), "b": ReplicaForecast(0.0, 1000.0)}
    assert fc_route({"a": 3, "b": 2}, {}, forecasts).replica == "b"
    assert fc_route({"a": 2, "b": 3}, {}, forecasts).replica == "a"
    # a near-tie between a cached and a cold replica keeps the cache, whatever the loads
    r = fc_route({"a": 3, "b": 2}, {"a": 9}, {"a": ReplicaForecast(1.95, 1000.0), "b": ReplicaForecast(0.0, 1000.0)})
    assert (r.replica, r.reason) == ("a", "match")


@settings(max_examples=300, deadline=None)
@given(loads=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 30), min_size=1),
       raw_matches=st.dictionaries(st.sampled_from("abcdefg"), st.integers(1, 10)),
       etas=st.dictionaries(st.sampled_from("abcdef"), st.floats(0, 20)),
       rates=st.dictionaries(st.sampled_from("abcdef"), st.floats(100, 10000)),
       steps=st.dictionaries(st.sampled_from("abcdef"), st.floats(0.001, 0.2)),
       out=st.one_of(st.none(), st.integers(1, 1000)),
       abs_count=st.integers(0, 20), k=st.floats(0, 3), w=st.floats(0, 3))
def test_forecast_route_properties(loads, raw_matches, etas, rates, steps, out, abs_count, k, w) -> None:
    forecasts = {x: ReplicaForecast(etas.get(x, 0.0), rates.get(x), steps.get(x)) for x in {*etas, *rates, *steps}}
    r = fc_route(loads, raw_matches, forecasts, abs_count=abs_count, k=k, w=w, out=out)
    assert r.replica in loads and r.matched_blocks == raw_matches.get(r.replica, 0)
    low = min(loads.values())
    if max(loads.values()) - low > abs_count:
        assert r.reason == "imbalance" and loads[r.replica] == low
        return
    limit = acceptable_load(loads, k)
    assert loads[r.replica] <= limit
    ok = [x for x in loads if loads[x] <= limit]

    def median(values):
        v = sorted(values)
        return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2 if v else None

    rate_m = median([forecasts[x].prefill_tokens_per_s for x in ok if x in forecasts
                     and forecasts[x].prefill_tokens_per_s]) or DEFAULT_PREFILL_TOKENS_PER_S
    step_m = median([forecasts[x].decode_step_s for x in ok if x in forecasts and forecasts[x].decode_step_s]) or 0.0
    d = min(DECODE_HORIZON, out if out is not None else DEFAULT_OUTPUT_TOKENS)

    def parts(x):
        f = forecasts.get(x, ReplicaForecast())
        rate = f.prefill_tokens_per_s or rate_m
        u = max(0.0, 1000.0 - raw_matches.get(x, 0) * 100.0)
        return f.queue_eta_s, u, rate, f.decode_step_s or step_m

    least = min(parts(x)[1] for x in ok)

    def score(x):
        eta, u, rate, step = parts(x)
        return eta + u / rate + d * step + w * (u - least) / rate

    margin = min(score(x) for x in ok) * (1 + TIE_FRACTION) + TIE_S + min(parts(x)[1] / parts(x)[2] for x in ok)
    tied = [x for x in ok if score(x) <= margin + 1e-9]
    assert r.replica in tied  # no acceptable replica is forecast clearly faster
    best = min((-raw_matches.get(x, 0), loads[x]) for x in tied)  # ties: longest match, then load
    assert (-raw_matches.get(r.replica, 0), loads[r.replica]) == best
    top = max((raw_matches.get(x, 0) for x in loads), default=0)
    if top == 0:
        assert r.reason == "no-match"
    elif raw_matches.get(r.replica, 0) == top:
        assert r.reason == "match"
    else:
        assert r.reason in ("forecast", "overloaded")


def test_router_forecast_records_blocks_and_learns_the_text_token_ratio() -> None:
    router = Router("forecast")
    h = block_hashes("p" * 40, 8)
    first = router.choose({"a": 0, "b": 0}, h, prompt_tokens=40, block_tokens=8)
    assert first.reason == "no-match" and first.header().startswith("policy=forecast; reason=no-match")
    again = router.choose({"a": 0, "b": 0}, h, prompt_tokens=40, block_tokens=8,
                          forecasts={first.replica: ReplicaForecast(0.001, 1000.0)})
    assert (again.replica, again.reason, again.matched_blocks) == (first.replica, "match", 5)
    assert "est_ttft_s=" in again.header()
    assert router.tokens_per_key(text=False) == 1.0
    assert router.tokens_per_key(text=True) == Router.TEXT_TOKENS_PER_KEY  # a guess until a count is seen
    router.learn_tokens(400, 100)
    assert router.tokens_per_key(text=True) == pytest.approx(0.25)
    router.learn_tokens(400, 400)
    assert router.tokens_per_key(text=True) == pytest.approx(0.25 + Router.RATIO_WEIGHT * 0.75)


def test_forecast_balances_new_prefixes_on_those_homed_recently_then_on_load() -> None:
    # a has homed 2 prefixes and has 1 request open now; b homed 1 and has 2 open (its group's followers
    # came at once): a new prefix goes to b, where least-request would send it to a
    r = fc_route({"a": 1, "b": 2}, {}, {}, homed={"a": 2.0, "b": 1.0})
    assert (r.replica, r.reason) == ("b", "no-match")
    assert fc_route({"a": 1, "b": 2}, {}, {}).replica == "a"  # nothing homed: the load decides
    # a request some replica holds a prefix of is not cold: the match decides, homed counts do not
    assert fc_route({"a": 1, "b": 2}, {"a": 3}, {}, homed={"a": 5.0}).replica == "a"
    # a burst of new prefixes alternates whatever the momentary loads, and the counts decay
    router = Router("forecast")
    homes = [router.choose({"a": i % 3, "b": 0}, block_hashes(f"{i}" * 64, 16), prompt_tokens=64, block_tokens=16).replica
             for i in range(1, 7)]
    assert sorted(homes) == ["a", "a", "a", "b", "b", "b"], homes
    assert router.homed() == pytest.approx({"a": 3.0, "b": 3.0}, rel=1e-3)
    later = time.monotonic() + HOMED_HALF_LIFE
    assert router.homed(later) == pytest.approx({"a": 1.5, "b": 1.5}, rel=1e-3)
    router.forget("a")
    assert set(router.homed()) == {"b"}


def test_prefix_cache_fallback_reports_the_blocks_its_replica_holds() -> None:
    router = Router("prefix-cache", imbalance_abs_count=0)
    h = block_hashes("q" * 24, 8)
    router.index.record(h, "a")
    r = router.choose({"a": 0, "b": 3}, h)  # imbalanced: least-request picks a, which holds all 3 blocks
    assert (r.replica, r.reason, r.matched_blocks) == ("a", "imbalance", 3)


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
