"""Issue 24's forecast part: each replica's queue ETA, the ``forecast`` routing policy, 429 retries with a
forecast ``Retry-After``, and hit attribution (predicted vs real cached tokens per replica and policy).

The replica side's pure parts first (backlog counting, step rates, the ETA formula, the usage comment
filter), then live: real ``lockgate serve`` sim replicas (whose step cost is ``--sim-step-ms`` +
``--sim-token-ms`` per token, so their prefill rate is known) behind a real ``lockgate gateway``,
over real HTTP with httpx and the official openai client. Every process is stopped by pid, also
on failure (``server_util.ServerProc``).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_util import ServerProc
from test_gateway import complete, start_gateway, wait_healthy

from lockgate.engine.forecast import StepRates, estimate
from lockgate.gateway.proxy import UsageComment
from lockgate.kvcache.radix import RadixCache
from lockgate.sampling import SamplingParams
from lockgate.scheduler.backlog import Backlog, measure
from lockgate.scheduler.request import Request


# ---- the replica's forecast, pure ------------------------------------------------------------------
def req(ids, max_tokens=10, rid="r"):
    return Request(rid, np.asarray(ids, dtype=np.int64), SamplingParams(max_tokens=max_tokens))


def test_backlog_counts_shared_spans_once_and_skips_what_the_cache_holds() -> None:
    prefix = list(range(100, 400))  # 300 tokens
    burst = [req(prefix + [7, i], rid=f"b{i}") for i in range(5)]  # 5 prompts of 302 tokens on one prefix
    b = measure(burst, [], None)
    assert 300 <= b.prefill_tokens <= 300 + 5 * 64  # the prefix once, each tail once (a piece is <= 64)
    assert b.prefill_tokens < 2 * 302
    assert (b.decode_tokens, b.longest_decode, b.waiting) == (50, 10, 5)
    alone = measure([req(list(range(1000, 1302)), rid=f"u{i}") for i in range(1)], [], None)
    assert alone.prefill_tokens == 302
    distinct = measure([req([i] * 302, rid=f"d{i}") for i in range(1, 6)], [], None)
    assert distinct.prefill_tokens == 5 * 302  # nothing shared: every token counts
    # the cache holds the prefix: only what follows it is left to compute (the tree is not touched)
    tree = RadixCache()
    tree.insert(prefix, np.arange(300))
    nodes = tree.num_nodes
    b = measure(burst, [], tree)
    assert 2 <= b.prefill_tokens <= 5 * 2 + 64 and tree.num_nodes == nodes
    # a running request still prefilling counts what it has not computed; a decoding one its tokens left
    running = req(list(range(5000, 5800)), max_tokens=40, rid="run")
    running.num_computed = 500
    decoding = req([9] * 20, max_tokens=40, rid="dec")
    decoding.num_computed, decoding.output_ids = 20, [1] * 15
    b = measure([], [running, decoding], tree)
    assert b.prefill_tokens == 300 and b.decoding == 1 and b.shortest_running_decode == 25
    assert b.decode_tokens == 40 + 25 and b.longest_decode == 40
    # past the limit the rest is extrapolated from the mean of those examined
    many = measure([req([i] * 100, rid=f"m{i}") for i in range(1, 41)], [], None, limit=10)
    assert many.prefill_tokens == 40 * 100


def test_step_costs_are_fitted_and_the_eta_formula() -> None:
    rates = StepRates()
    assert estimate(Backlog(), rates, max_prefill_tokens=256, max_running=8, blocked=False).queue_eta_s == 0.0
    unknown = estimate(Backlog(prefill_tokens=10), rates, max_prefill_tokens=256, max_running=8, blocked=False)
    assert unknown.queue_eta_s is None and unknown.prefill_tokens_per_s is None  # nothing measured yet
    rates.observe(500, 0, 0.27)  # one step: all of it reads as prefill cost (the least-norm fit)
    assert rates.prefill_tokens_per_s == pytest.approx(500 / 0.27, rel=1e-3)
    # steps costing 5 ms + 1 ms a prefill token + 0.5 ms a decode row: the fit finds the three costs
    rates = StepRates()
    for p, r in [(0, 4), (1000, 0), (500, 4), (0, 12), (256, 8), (64, 2), (0, 1), (700, 16)] * 3:
        rates.observe(p, r, 0.005 + 0.001 * p + 0.0005 * r)
    overhead, per_token, per_row = rates.costs()
    # (the overhead's small ridge leaves it within a fraction of a percent)
    assert (overhead, per_token, per_row) == pytest.approx((0.005, 0.001, 0.0005), rel=5e-3)
    assert rates.decode_step_s(10) == pytest.approx(0.010, rel=5e-3)
    # 600 tokens to prefill while 2 requests decode: 0.6 s + 3 steps of 256, each with its overhead and rows
    b = Backlog(prefill_tokens=600, decode_tokens=90, longest_decode=50, shortest_running_decode=20, decoding=2,
                waiting=3)
    f = estimate(b, rates, max_prefill_tokens=256, max_running=8, blocked=False)
    assert f.queue_eta_s == pytest.approx(0.6 + 3 * 0.006, rel=5e-3)
    assert f.drain_eta_s == pytest.approx(0.6 + 3 * 0.006 + 50 * 0.006, rel=5e-3)
    assert f.decode_step_s == pytest.approx(0.006, rel=5e-3) and f.prefill_tokens_per_s == pytest.approx(1000, rel=5e-3)
    blocked = estimate(b, rates, max_prefill_tokens=256, max_running=8, blocked=True)
    # the first finish frees room
    assert blocked.queue_eta_s == pytest.approx(0.6 + 3 * 0.006 + 20 * 0.006, rel=5e-3)
    wide = estimate(Backlog(decode_tokens=800, longest_decode=50, decoding=8), rates, max_prefill_tokens=256,
                    max_running=8, blocked=False)
    assert wide.queue_eta_s == 0.0  # 800 tokens over 8 rows: 100 steps > the longest 50
    assert wide.drain_eta_s == pytest.approx(100 * 0.009, rel=5e-3)
    # the fit follows the steps: the same steps now 4x as slow per token take over within ~100 steps
    for _ in range(5):
        for p, r in [(0, 4), (1000, 0), (500, 4), (256, 8)] * 5:
            rates.observe(p, r, 0.005 + 0.004 * p + 0.0005 * r)
    assert rates.prefill_tokens_per_s == pytest.approx(250, rel=0.02)
    # noise that would make a cost negative drops it instead
    flat = StepRates()
    for p, t in ((100, 0.06), (200, 0.055), (300, 0.05), (400, 0.045)):
        flat.observe(p, 0, t)  # bigger steps ran faster (noise): no token cost, all overhead
    assert flat.costs()[1] == pytest.approx(0, abs=1e-9) and flat.costs()[0] > 0 and flat.prefill_tokens_per_s is None


def test_usage_comment_is_taken_out_of_a_stream_whatever_the_pieces() -> None:
    events = [b'data: {"a": 1}\n\n', b": x-lockgate-usage prompt_tokens=120 cached_tokens=96\n\n", b"data: [DONE]\n\n"]
    whole = b"".join(events)
    for cuts in ([], [3], [1, 20], [30, 31, 60]):  # the comment's own chunk, read in pieces
        pieces = [events[0]]
        comment, last = events[1], 0
        for c in [*cuts, len(comment)]:
            pieces.append(comment[last:c])
            last = c
        pieces.append(events[2])
        f = UsageComment()
        out = b"".join(f.feed(p) for p in pieces if p) + f.flush()
        assert out == events[0] + events[2] and f.found == (120, 96)
    f = UsageComment()  # other comments and data pass untouched
    other = [b": ping\n\n", b":", b" x", b'data: {"b": 2}\n\n']
    assert b"".join(f.feed(p) for p in other) + f.flush() == b"".join(other) and f.found is None
    f = UsageComment()
    assert b"".join(f.feed(p) for p in [whole]) == whole  # not a chunk of its own: relayed as it came


# ---- live: replicas and a gateway -------------------------------------------------------------------
# 0.5 ms a token, 1 ms a step: a replica prefills ~1,900 tokens/s; 256 tokens a step keeps steps short
SIM = ("--model", "sim", "--max-model-len", "8192", "--sim-step-ms", "1", "--sim-token-ms", "0.5",
       "--max-total-tokens", "65536", "--max-prefill-tokens", "256")


@contextlib.contextmanager
def fleet(n: int, replica_args: tuple[str, ...], *gateway_args: str):
    reps = [ServerProc(*SIM, *replica_args) for _ in range(n)]
    gw = None
    try:
        for r in reps:
            r.wait_ready()
        for i, r in enumerate(reps):  # one request each: the replicas measure their step rates
            warm = complete(r.url, f"warm up {i} " + "w" * 400)
            assert warm.status_code == 200, warm.text
        gw = start_gateway(*(a for r in reps for a in ("--replica", r.url)), *gateway_args)
        wait_healthy(gw, n)
        yield gw, reps
    finally:
        if gw is not None:
            gw.stop()
        for r in reps:
            r.stop()


def wait_until(cond, timeout: float, proc: ServerProc | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(proc.log()[-3000:] if proc else "condition not met in time")
        time.sleep(0.05)


def route_of(resp: httpx.Response) -> dict[str, str]:
    return {"replica": resp.headers["x-lockgate-replica"],
            **dict(part.strip().split("=", 1) for part in resp.headers["x-lockgate-route"].split(";"))}


def occupy(url: str, prompts: list[str]) -> list[threading.Thread]:
    """Streams sent straight to a replica, in threads (the gateway does not see them)."""
    def one(p: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"model": "sim", "prompt": p, "max_tokens": 2, "stream": True}) as s:
                s.read()

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in prompts]
    for t in threads:
        t.start()
    return threads


def gateway_view(gw: ServerProc) -> dict[str, dict]:
    return {r["url"]: r for r in httpx.get(gw.url + "/v1/loads", timeout=5).json()["replicas"]}


def series(gw: ServerProc, name: str) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(gw.url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name:
                out[(s.labels.get("replica"), s.labels.get("policy"))] = s.value
    return out


def test_forecast_routing_eta_and_hit_attribution() -> None:
    with fleet(2, (), "--policy", "forecast") as (gw, reps):
        a, b = reps
        # ---- each replica's /v1/loads: the ETA appears and grows with the work queued there
        idle = httpx.get(a.url + "/v1/loads").json()
        assert idle["queue_eta_s"] == 0.0 and 1000 < idle["prefill_tokens_per_s"] < 2500, idle
        etas = []
        threads = []
        for k in (1, 4):
            threads += occupy(a.url, [f"{k}-{i} " + chr(65 + i) * 1200 for i in range(k)])
            wait_until(lambda k=k: httpx.get(a.url + "/v1/loads").json()["prefill_backlog_tokens"] >= 1000 * k, 10)
            now = httpx.get(a.url + "/v1/loads").json()
            etas.append(now["queue_eta_s"])
            # the ETA is the backlog at the measured rate (plus decode steps riding along)
            assert now["queue_eta_s"] >= 0.9 * now["prefill_backlog_tokens"] / now["prefill_tokens_per_s"] - 0.3
        assert 0.3 < etas[0] < etas[1], etas
        # ---- the gateway reads it (its poll, once a second)
        wait_until(lambda: gateway_view(gw)[a.url]["forecast"]["queue_eta_s"] > 1.0, 5, gw)
        for t in threads:
            t.join(30)
        wait_until(lambda: max(v["forecast"]["queue_eta_s"] for v in gateway_view(gw).values()) < 0.05, 10, gw)

        # ---- forecast routing: a group stays where its prefix is while that replica's queue is short
        group = "You are a terse assistant for the harbour office. " * 16  # 816 chars: 6 blocks of 128
        first = complete(gw.url, group + "Q0")
        home = route_of(first)["replica"]
        other = b.url if home == a.url else a.url
        assert route_of(first)["reason"] == "no-match"
        second = complete(gw.url, group + "Q1")
        r2 = route_of(second)
        assert (r2["replica"], r2["reason"], r2["matched_blocks"]) == (home, "match", "6"), r2
        assert float(r2["est_ttft_s"]) < 0.2
        # ... unless the queue there clearly outweighs the prefill saved (~0.4 s, counted twice, plus the
        # policy's margin: ~1.3 s in all): ~9,000 tokens (~4.5 s) queued at home, so that the ETA
        # stays above 2 s for more than one of the gateway's 1 s polls (with 6,000 it did for ~0.5 s,
        # and the wait below missed it when the streams reached the scheduler one by one)
        threads = occupy(home, [f"busy {i} " + chr(75 + i) * 1500 for i in range(6)])
        wait_until(lambda: gateway_view(gw)[home]["forecast"]["queue_eta_s"] > 2.0, 5, gw)
        third = complete(gw.url, group + "Q2")
        r3 = route_of(third)
        assert (r3["replica"], r3["reason"], r3["matched_blocks"]) == (other, "forecast", "0"), r3
        for t in threads:
            t.join(30)

        # ---- hit attribution: the gateway's counters move with the replicas' real cached tokens
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        usages = [first.json()["usage"], second.json()["usage"], third.json()["usage"]]
        for i in range(3):
            c = client.completions.create(model="sim", prompt=group + f"Q{3 + i}", max_tokens=3)
            usages.append(c.usage.model_dump())
        stream = client.chat.completions.create(model="sim", messages=[{"role": "user", "content": group}],
                                                max_tokens=3, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        usages.append(chunks[-1].usage.model_dump())
        # the raw stream through the gateway carries no usage comment (taken out), and ends as it should
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=30,
                          json={"model": "sim", "prompt": group + "Q9", "max_tokens": 3, "stream": True,
                                "stream_options": {"include_usage": True}}) as s:
            raw = s.read().decode()
        assert "x-lockgate-usage" not in raw and raw.endswith("data: [DONE]\n\n"), raw[-300:]
        last = [ln for ln in raw.splitlines() if ln.startswith("data: {")][-1]
        usages.append(json.loads(last[6:])["usage"])
        tgi = httpx.post(gw.url + "/generate", json={"inputs": group + "T", "parameters": {"max_new_tokens": 2}},
                         timeout=30)
        assert tgi.status_code == 200
        real = series(gw, "lockgate:gateway_real_cached_tokens_total")
        prompt = series(gw, "lockgate:gateway_prompt_tokens_total")
        predicted = series(gw, "lockgate:gateway_predicted_cached_tokens_total")
        tgi_counts = (int(tgi.headers["x-lockgate-prompt-tokens"]), int(tgi.headers["x-lockgate-cached-tokens"]))
        assert sum(real.values()) == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) + tgi_counts[1]
        assert sum(prompt.values()) == sum(u["prompt_tokens"] for u in usages) + tgi_counts[0]
        assert {p for _, p in real} == {"forecast"} and {r for r, _ in real} == {a.url, b.url}
        assert sum(real.values()) > 3000  # the group's prefix really came from the caches
        # the prediction: whole matched blocks (768 of the prompt's ~820 tokens) on every request that matched
        home_predicted, home_real = predicted[(home, "forecast")], real[(home, "forecast")]
        assert 0.7 * home_real <= home_predicted <= home_real, (home_predicted, home_real)
        assert predicted.get((other, "forecast"), 0) <= real[(other, "forecast")]
        gauges = httpx.get(gw.url + "/metrics").text
        assert "lockgate:gateway_replica_queue_eta_seconds" in gauges


def test_429_is_retried_elsewhere_and_a_full_fleet_gets_retry_after_from_the_forecast() -> None:
    # each replica takes one queued request at most; round-robin sends every other request to the full one
    with fleet(2, ("--max-queued-requests", "1"), "--policy", "round-robin") as (gw, reps):
        a, b = reps
        threads = occupy(a.url, ["long a " + "x" * 8000])  # ~4 s before its first token: a is full meanwhile
        wait_until(lambda: httpx.get(a.url + "/v1/loads").json()["queued_in_api"] == 1, 5)
        direct = complete(a.url, "straight to a")
        assert direct.status_code == 429 and int(direct.headers["Retry-After"]) >= 2  # its own ETA, not "1"
        outs = [complete(gw.url, f"through the gateway {i}") for i in range(2)]
        assert [o.status_code for o in outs] == [200, 200], [o.text for o in outs]
        assert {route_of(o)["replica"] for o in outs} == {b.url}  # a refused: the gateway went on to b
        retried = [route_of(o)["reason"] for o in outs].count("retry")
        assert retried >= 1
        retries = {(s.labels["replica"], s.labels["cause"]): s.value
                   for fam in text_string_to_metric_families(httpx.get(gw.url + "/metrics").text)
                   for s in fam.samples if s.name == "lockgate:gateway_retries_total" and s.value}
        assert retries == {(a.url, "429"): retried}  # (the other replica/cause series exist, at 0)
        # both full: the client gets 429 with Retry-After from the fleet's forecast (the smaller ETA, up)
        threads += occupy(b.url, ["long b " + "y" * 7000])  # long enough that the ETAs stay > 1 s under load
        wait_until(lambda: httpx.get(b.url + "/v1/loads").json()["queued_in_api"] == 1, 5)
        wait_until(lambda: min(v["forecast"]["queue_eta_s"] for v in gateway_view(gw).values()) > 1.5, 5, gw)
        refused = complete(gw.url, "nobody has room")
        view = gateway_view(gw)
        smallest = min(v["forecast"]["queue_eta_s"] for v in view.values())
        assert refused.status_code == 429, refused.text
        wait = int(refused.headers["Retry-After"])
        assert wait >= 2 and abs(wait - math.ceil(smallest)) <= 1, (wait, smallest)
        assert "full" in refused.json()["error"]["message"]
        assert 'kind="refused"' in httpx.get(gw.url + "/metrics").text
        for t in threads:
            t.join(30)
        # room again: the same request goes through
        assert complete(gw.url, "nobody has room").status_code == 200
