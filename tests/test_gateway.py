"""The gateway live: real ``lockgate serve`` replicas (sim model), a real ``lockgate gateway``, real HTTP.

Covers routing by prefix while balanced and by load past the imbalance threshold, retry when a
replica refuses, a replica killed under load, ``--replicas-file`` changes, no healthy replica,
client disconnects through the gateway, and ``serve --dp`` on the sim model and (one end-to-end
check) on the default model with the official openai client.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_util import ServerProc, free_port, free_port_run, pid_alive

SIM = ("--model", "sim", "--max-model-len", "4096", "--sim-step-ms", "5", "--max-total-tokens", "65536")
PREFIX = "You are a careful assistant. " * 20  # 580 characters: 4 full blocks of 128


def start_replicas(n: int, *extra: str) -> list[ServerProc]:
    reps = [ServerProc(*SIM, *extra) for _ in range(n)]
    for r in reps:
        r.wait_ready()
    return reps


def start_gateway(*args: str) -> ServerProc:
    return ServerProc(*args, "--health-interval", "0.5", command="gateway")


def wait_healthy(gw: ServerProc, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            body = httpx.get(gw.url + "/health", timeout=2).json()
            if body.get("healthy") == n:
                return
        except (httpx.HTTPError, ValueError):
            pass
        if gw.proc.poll() is not None:
            raise RuntimeError(gw.log())
        time.sleep(0.1)
    raise TimeoutError(f"gateway never saw {n} healthy replicas:\n{gw.log()[-3000:]}")


@contextlib.contextmanager
def fleet(n: int, *gateway_args: str):
    reps = start_replicas(n)
    gw = None
    try:
        gw = start_gateway(*(a for r in reps for a in ("--replica", r.url)), *gateway_args)
        wait_healthy(gw, n)
        yield gw, reps
    finally:
        if gw is not None:
            gw.stop()
        for r in reps:
            r.stop()


def complete(url: str, prompt: str, max_tokens: int = 4, headers: dict[str, str] | None = None,
             **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "sim", "prompt": prompt, "max_tokens": max_tokens, **kw},
                      headers=headers, timeout=60)


def route_of(resp: httpx.Response) -> dict[str, str]:
    fields = dict(part.strip().split("=", 1) for part in resp.headers["x-lockgate-route"].split(";"))
    return {"replica": resp.headers["x-lockgate-replica"], **fields}


# ---- prefix-cache routing ---------------------------------------------------------------------
def test_prefix_cache_keeps_groups_together_and_replicas_hit_their_cache() -> None:
    with fleet(2, "--policy", "prefix-cache") as (gw, reps):
        homes: dict[str, set[str]] = {}
        cached = 0
        for i in range(12):
            group = "ABC"[i % 3]
            r = complete(gw.url, group * 300 + PREFIX + f" question {i}")
            assert r.status_code == 200, r.text
            route = route_of(r)
            homes.setdefault(group, set()).add(route["replica"])
            if i >= 3:  # every group was seen once: the rest match their group's replica
                assert route["reason"] == "match" and route["matched_blocks"] == route["total_blocks"], route
                cached += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert all(len(h) == 1 for h in homes.values()), homes
        assert cached >= 9 * 800  # the replica really had the prefix: ~880 of ~890 tokens cached each
        scraped = httpx.get(gw.url + "/metrics")
        metrics = scraped.text
        assert 'reason="match"' in metrics and "lockgate:gateway_prefix_blocks_matched_total" in metrics
        # the fleet in one scrape: each replica's own series under its URL, in the engines' own format
        assert scraped.headers["content-type"] == httpx.get(reps[0].url + "/metrics").headers["content-type"]
        from prometheus_client.parser import text_string_to_metric_families

        generated: dict[str, float] = {}
        for fam in text_string_to_metric_families(metrics):
            for smp in fam.samples:
                if smp.name == "lockgate:generation_tokens_total":
                    generated[smp.labels["replica"]] = smp.value
        assert set(generated) == {r.url for r in reps} and sum(generated.values()) == 12 * 4
        hits = sum(smp.value for fam in text_string_to_metric_families(metrics) for smp in fam.samples
                   if smp.name == "lockgate:prefix_cache_hits_total")
        assert hits == cached  # the replicas' real hits, summed over the fleet




def test_every_series_the_grafana_dashboard_queries_exists() -> None:
    """dashboards/grafana.json against a live gateway scrape (its own series and its replicas'),
    after traffic that fills every kind: a metric missing or renamed fails here."""
    import re

    from prometheus_client.parser import text_string_to_metric_families

    board = json.loads((Path(__file__).parents[1] / "dashboards" / "grafana.json").read_text())
    queried = {name for p in board["panels"] for t in p["targets"] for name in re.findall(r"lockgate:\w+", t["expr"])}
    assert len(queried) >= 20
    with fleet(2) as (gw, _):
        for i in range(4):
            assert complete(gw.url, f"dashboard {i}", n=2).status_code == 200
        families = list(text_string_to_metric_families(httpx.get(gw.url + "/metrics").text))
    exported = {smp.name for fam in families for smp in fam.samples}
    assert queried <= exported, sorted(queried - exported)  # retries included: 0 before the first one


def test_load_wins_over_cache_past_the_imbalance_threshold() -> None:
    with fleet(2, "--policy", "prefix-cache", "--imbalance-abs-count", "2") as (gw, reps):
        prompt = PREFIX * 2
        routes = []
        with contextlib.ExitStack() as stack, httpx.Client(timeout=60) as client:
            for _ in range(5):  # long streams held open: each adds one to its replica's load
                resp = stack.enter_context(client.stream(
                    "POST", gw.url + "/v1/completions",
                    json={"model": "sim", "prompt": prompt, "max_tokens": 2500, "ignore_eos": True, "stream": True}))
                assert resp.status_code == 200
                routes.append(route_of(resp))
        first = routes[0]["replica"]
        # loads (first, other): (0,0) no-match, (1,0) match, (2,0) match; at (3,0) the spread 3 > 2 sends the
        # 4th to the other replica, which then holds the prefix too: the 5th matches both equally and takes
        # the less loaded one (3,1)
        assert [r["reason"] for r in routes] == ["no-match", "match", "match", "imbalance", "match"], routes
        assert [r["replica"] == first for r in routes] == [True, True, True, False, False], routes


# ---- failures ------------------------------------------------------------------------------------
def test_refused_connection_is_retried_on_another_replica() -> None:
    reps = start_replicas(2)
    gw = None
    try:
        gw = ServerProc(*(a for r in reps for a in ("--replica", r.url)), "--policy", "round-robin",
                        "--health-interval", "60", command="gateway")  # slow checks: only the proxy notices
        wait_healthy(gw, 2)
        dead = reps[0]
        assert dead.stop() == 0
        outs = [complete(gw.url, f"after the kill {i}") for i in range(4)]
        assert all(o.status_code == 200 for o in outs), [o.text for o in outs]
        routes = [route_of(o) for o in outs]
        assert all(r["replica"] == reps[1].url for r in routes)
        assert [r["reason"] for r in routes].count("retry") == 1  # the first refusal marks it unhealthy
        health = httpx.get(gw.url + "/health").json()
        assert health["healthy"] == 1 and "connection failed" in next(
            r["last_error"] for r in health["replicas"] if r["url"] == dead.url)
    finally:
        if gw is not None:
            gw.stop()
        for r in reps:
            r.stop()


def test_replica_killed_under_load_fails_only_streams_it_had_started() -> None:
    with fleet(2, "--policy", "least-request") as (gw, reps):
        victim = reps[0]
        results: list[tuple[str, str | None, str]] = []  # (kind, replica, outcome)
        lock = threading.Lock()
        started_on: list[str | None] = []  # replicas of streams whose headers (and so a token) have arrived

        def streamed(i: int) -> None:
            replica, text = None, ""
            try:
                with httpx.stream("POST", gw.url + "/v1/completions", timeout=60, json={
                        "model": "sim", "prompt": f"stream {i}", "max_tokens": 1500, "ignore_eos": True,
                        "stream": True}) as resp:
                    replica = resp.headers.get("x-lockgate-replica")
                    with lock:
                        started_on.append(replica)
                    text = "".join(resp.iter_text())
                outcome = "ok" if text.rstrip().endswith("data: [DONE]") else (
                    "error-event" if '"error"' in text else "truncated")
            except httpx.HTTPError as e:
                outcome = f"exception {type(e).__name__}"
            with lock:
                results.append(("stream", replica, outcome))

        def whole(i: int) -> None:
            r = complete(gw.url, f"whole {i}", max_tokens=1500, ignore_eos=True)
            with lock:
                results.append(("whole", r.headers.get("x-lockgate-replica"), "ok" if r.status_code == 200 else
                                f"{r.status_code} {r.text[:200]}"))

        with ThreadPoolExecutor(24) as pool:
            futures = [pool.submit(streamed if i % 2 else whole, i) for i in range(16)]
            deadline = time.monotonic() + 30
            # both kinds are running on the victim, and at least one stream there has begun answering
            while gateway_in_flight(gw).get(victim.url, 0) < 6 or victim.url not in started_on:
                assert time.monotonic() < deadline, (gateway_in_flight(gw), started_on)
                time.sleep(0.05)
            os.killpg(victim.proc.pid, signal.SIGKILL)  # the whole replica: API, scheduler, detokenizer
            futures += [pool.submit(streamed if i % 2 else whole, i) for i in range(16, 32)]
            for f in futures:
                f.result()
        for kind, replica, outcome in results:
            if kind == "stream" and replica == victim.url:
                assert outcome == "error-event", results  # started there: it ends with a clear error event
            else:
                assert outcome == "ok", (kind, replica, outcome)
        assert any(k == "stream" and r == victim.url for k, r, _ in results)  # the kill did hit live streams
        assert httpx.get(gw.url + "/health").json()["healthy"] == 1
        assert gateway_in_flight(gw) == {victim.url: 0, reps[1].url: 0}  # every attempt's count released


def gateway_in_flight(gw: ServerProc) -> dict[str, int]:
    return {r["url"]: r["in_flight"] for r in httpx.get(gw.url + "/v1/loads").json()["replicas"]}


class _Answers503(http.server.BaseHTTPRequestHandler):
    """A replica whose engine has failed: healthy at the last check, 503 on generation (a stand-in:
    a real replica cannot be made to do this on cue)."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = b'{"error": {"message": "engine failed"}}'
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_503_before_the_first_byte_is_retried_and_headers_pass_through() -> None:
    reps = start_replicas(1)
    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers503)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    fake_url = f"http://127.0.0.1:{fake.server_address[1]}"
    gw = None
    try:
        gw = ServerProc("--replica", fake_url, "--replica", reps[0].url, "--policy", "round-robin",
                        "--health-interval", "60", command="gateway")
        wait_healthy(gw, 2)
        # a header value that is not ASCII reaches the replica as the client sent it
        outs = [httpx.post(gw.url + "/v1/completions", json={"model": "sim", "prompt": f"p{i}", "max_tokens": 3},
                           headers={"x-note": "caf\u00e9".encode()}, timeout=30) for i in range(3)]
        assert [o.status_code for o in outs] == [200, 200, 200], [o.text for o in outs]
        reasons = [route_of(o)["reason"] for o in outs]
        assert reasons.count("retry") == 1 and {route_of(o)["replica"] for o in outs} == {reps[0].url}
        assert gateway_in_flight(gw) == {fake_url: 0, reps[0].url: 0}
        assert 'cause="503"' in httpx.get(gw.url + "/metrics").text
    finally:
        if gw is not None:
            gw.stop()
        fake.shutdown()
        for r in reps:
            r.stop()


def test_replicas_file_changes_are_picked_up_live(tmp_path: Path) -> None:
    reps = start_replicas(2)
    listing = tmp_path / "replicas.txt"
    listing.write_text(f"# the fleet\n{reps[0].url}\n")
    gw = None
    try:
        gw = start_gateway("--replicas-file", str(listing), "--policy", "round-robin")
        wait_healthy(gw, 1)
        assert {route_of(complete(gw.url, f"a{i}"))["replica"] for i in range(4)} == {reps[0].url}
        listing.write_text(f"{reps[0].url}\n{reps[1].url}/\n")
        wait_healthy(gw, 2)
        assert {route_of(complete(gw.url, f"b{i}"))["replica"] for i in range(4)} == {reps[0].url, reps[1].url}
        listing.write_text(f"{reps[1].url}\n")
        deadline = time.monotonic() + 10
        while len(httpx.get(gw.url + "/health").json()["replicas"]) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {route_of(complete(gw.url, f"c{i}"))["replica"] for i in range(4)} == {reps[1].url}
        assert "replicas file" in gw.log() and "removed" in gw.log()
    finally:
        if gw is not None:
            gw.stop()
        for r in reps:
            r.stop()


def test_no_healthy_replica_is_a_503_with_a_message() -> None:
    gw = start_gateway("--replica", f"http://127.0.0.1:{free_port()}")
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                h = httpx.get(gw.url + "/health", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert h.status_code == 503 and h.json()["status"] == "no healthy replica"
        r = complete(gw.url, "hello")
        assert r.status_code == 503 and "no healthy replica" in r.json()["error"]["message"]
        t = httpx.post(gw.url + "/generate", json={"inputs": "hi"}, timeout=10)
        assert t.status_code == 503 and "no healthy replica" in t.json()["error"]  # TGI's error shape
    finally:
        assert gw.stop() == 0


def test_bad_gateway_flags_fail_fast(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("http://127.0.0.1:1\nftp://nope\n")
    for args, needle in ((["--replicas-file", str(bad)], "bad.txt:2"),
                         (["--replica", "http://127.0.0.1:1/v1"], "must not have a path"),
                         ([], "no replica"),
                         (["--replica", "http://127.0.0.1:1", "--std-dev-factor", "-1"], "--std-dev-factor"),
                         (["--replica", "http://127.0.0.1:1", "--health-interval", "nan"], "--health-interval")):
        gw = ServerProc(*args, command="gateway")
        try:
            assert gw.proc.wait(30) == 2
            assert needle in gw.log(), gw.log()
        finally:
            gw.stop()


def test_client_disconnect_through_the_gateway_frees_the_replica() -> None:
    with fleet(1) as (gw, reps):
        for stream in (True, False):
            with httpx.Client(timeout=60) as client:
                if stream:
                    with client.stream("POST", gw.url + "/v1/completions", json={
                            "model": "sim", "prompt": "bye", "max_tokens": 3000, "ignore_eos": True,
                            "stream": True}) as resp:
                        next(resp.iter_bytes())
                else:
                    with pytest.raises(httpx.ReadTimeout):
                        client.post(gw.url + "/v1/completions", timeout=1.0, json={
                            "model": "sim", "prompt": "bye", "max_tokens": 3000, "ignore_eos": True})
            deadline = time.monotonic() + 10
            while True:
                ld = httpx.get(reps[0].url + "/v1/loads").json()
                gl = httpx.get(gw.url + "/v1/loads").json()["replicas"][0]
                if ld["in_flight"] == 0 and ld["slots_used"] == 0 and gl["in_flight"] == 0:
                    break
                assert time.monotonic() < deadline, (stream, ld, gl)
                time.sleep(0.05)


# ---- serve --dp -------------------------------------------------------------------------------------
def test_serve_dp_on_sim_routes_and_stops_everything() -> None:
    """Also: named keys reach the replicas (by environment) and tenants pass through the gateway, whose
    /metrics shows the replicas' per-tenant series."""
    port = free_port_run(4)
    s = ServerProc(*SIM, "--dp", "3", "--policy", "round-robin", "--api-key", "alice=alicekey", "--api-key",
                   "plainkey", port=port)
    try:
        s.wait_ready()
        wait_healthy(s, 3)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="alicekey", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert raw.parse().choices[0].message.content
        auth = {"Authorization": "Bearer plainkey", "x-lockgate-tenant": "bob"}
        seen = {route_of(complete(s.url, f"p{i}", headers=auth))["replica"] for i in range(6)}
        assert seen == {f"http://127.0.0.1:{port + i}" for i in (1, 2, 3)}
        text = httpx.get(s.url + "/metrics", headers=auth).text
        for tenant in ("alice", "bob"):
            assert re.search(r"lockgate:tenant_generation_tokens_total\{[^}]*tenant=\"" + tenant + "\"", text), [ln for ln in text.splitlines() if "tenant" in ln]
        models = httpx.get(s.url + "/v1/models", headers=auth).json()["data"]
        assert [m["id"] for m in models] == ["sim"]
        assert "--num-threads" not in s.log() and "torch threads" in s.log()
    finally:
        pids = s.child_pids()
        code = s.stop()
    assert code == 0
    assert len([k for k in pids if k.startswith("replica")]) == 3 and len(pids) == 3 + 3 * 2  # each replica: scheduler + detokenizer
    assert not any(pid_alive(p) for p in pids.values()), pids


def test_serve_dp_reserves_replica_ports_and_names_a_taken_one() -> None:
    """The gateway binds every replica's port before anything starts (a connection's local port or
    another server cannot take it later); a port already taken is a start-up error naming it."""
    port = free_port_run(3)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port + 2))
        s = ServerProc(*SIM, "--dp", "2", port=port)
        try:
            assert s.proc.wait(60) == 2
            assert f"replica 2 of --dp 2 needs port {port + 2} (--port + 2), which is not free" in s.log(), s.log()
            assert "started replica" not in s.log()  # nothing was started
        finally:
            s.stop()
    bad = ServerProc(*SIM, "--listen-fd", "97", port=port)
    try:
        assert bad.proc.wait(60) == 2
        assert "--listen-fd 97 is not an open socket" in bad.log(), bad.log()
    finally:
        bad.stop()


def test_serve_dp_default_model_end_to_end() -> None:
    port = free_port_run(3)
    s = ServerProc("--model", "default", "--dp", "2", "--prefix-tokenizer", "model", "--max-total-tokens",
                   "8192", port=port)
    try:
        s.wait_ready(timeout=300)
        wait_healthy(s, 2, timeout=300)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "system", "content": "You are a geography teacher who answers in one sentence. " * 8},
                    {"role": "user", "content": "What is the capital of France?"}]
        answers, replicas, cached = [], [], []
        for _ in range(3):
            raw = client.chat.completions.with_raw_response.create(model="default", messages=messages,
                                                                   max_tokens=12, temperature=0)
            r = raw.parse()
            answers.append(r.choices[0].message.content)
            replicas.append(raw.headers["x-lockgate-replica"])
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            route = dict(p.strip().split("=", 1) for p in raw.headers["x-lockgate-route"].split(";"))
        assert "Paris" in answers[0] and len(set(answers)) == 1
        assert len(set(replicas)) == 1  # model-token keys: the same chat prompt stays on its replica
        assert cached[0] == 0 and cached[1] > 100 and cached[2] > 100
        # keys are the model's tokens (16 per block): exactly the replica's prompt, cut into blocks
        assert route["reason"] == "match" and int(route["total_blocks"]) == r.usage.prompt_tokens // 16
        stream = client.completions.create(model="default", prompt="The capital of Italy is", max_tokens=5,
                                           temperature=0, stream=True)
        assert "Rome" in "".join(c.choices[0].text for c in stream if c.choices)
        usage = json.loads(httpx.get(s.url + "/v1/loads").text)
        assert sum(1 for r in usage["replicas"] if r["healthy"]) == 2
    finally:
        assert s.stop() == 0
