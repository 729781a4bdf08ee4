"""No request can hurt another (issue 17), on the sim model: real processes, real HTTP.

Each test attacks one failure point and then checks that nothing was lost: the API's queue count,
the engine's slots and later requests. The default model's cases (tokenizer-specific input, a
large text tokenized off the event loop) are in test_server_model.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest
from server_util import ServerProc, free_port_run, pid_alive

SIM = ("--model", "sim", "--max-model-len", "512", "--sim-step-ms", "5", "--log-level", "INFO")


@pytest.fixture(scope="module")
def server():
    s = ServerProc(*SIM, "--max-total-tokens", "4096", "--max-queued-requests", "4", "--max-request-bytes", "64KiB")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def loads(url: str) -> dict:
    return httpx.get(url + "/v1/loads").json()


def assert_nothing_held(url: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        ld = loads(url)
        if ld["queued_in_api"] == 0 and ld["in_flight"] == 0 and ld["slots_used"] == 0:
            return
        assert time.monotonic() < deadline, ld
        time.sleep(0.05)


def post_raw(url: str, path: str, raw: str, **kw) -> httpx.Response:
    return httpx.post(url + path, content=raw.encode(), headers={"content-type": "application/json"}, timeout=30,
                      **kw)


# Raw JSON: Python's json.dumps would escape differently; these are what a hostile client sends.
BAD_BODIES = [
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 3, "stop": ["\\ud800"]}', "stop[0]"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 3, "stop_token_ids": [18446744073709551616]}',
     "stop_token_ids[0]"),
    ("/v1/completions", '{"prompt": [1180591620717411303424], "max_tokens": 3}', "prompt[0]"),
    ("/v1/completions", '{"prompt": "\\udfff lone", "max_tokens": 3}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 3, "stop_token_ids": [9223372036854775808]}',
     "stop_token_ids"),
    ("/v1/completions", '{"prompt": ' + "[" * 2000 + "]" * 2000 + "}", "nested too deeply"),
    ("/v1/completions", '{"prompt": ' + "[" * 70 + "1" + "]" * 70 + "}", "nested too deeply"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "stop": "\\udc00"}', "stop"),
    ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/detokenize", '{"tokens": [1180591620717411303424]}', "tokens[0]"),
    ("/generate", '{"inputs": "\\ud800"}', "inputs"),
    ("/generate", '{"inputs": "x", "parameters": {"stop": ["\\ud800"]}}', "parameters.stop[0]"),
]


@pytest.mark.parametrize(("path", "raw", "needle"), BAD_BODIES)
def test_bad_input_is_a_4xx_naming_the_field_and_holds_no_queue_place(server, path, raw, needle) -> None:
    for _ in range(6):  # more than --max-queued-requests 4: a leaked place would lock the server out
        r = post_raw(server.url, path, raw)
        assert r.status_code in (400, 422), (r.status_code, r.text)
        assert needle in r.text, r.text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "fine", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
    assert_nothing_held(server.url)


def test_batch_larger_than_the_queue_is_a_400_not_a_429(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
    assert r.status_code == 400 and "--max-queued-requests 4" in r.text and "retry-after" not in r.headers
    assert_nothing_held(server.url)


def test_body_limit_is_a_413_before_the_body_is_read(server) -> None:
    big = json.dumps({"prompt": "x" * 100_000, "max_tokens": 1})
    r = post_raw(server.url, "/v1/completions", big)  # Content-Length declared
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: read up to the limit, then refused
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192].encode()

    r = httpx.post(server.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    r = httpx.post(server.url + "/generate", content=big.replace('"prompt"', '"inputs"').encode())
    assert r.status_code == 413 and "error_type" in r.json()  # TGI routes keep TGI's error body
    small = json.dumps({"prompt": "x" * 1000, "max_tokens": 1})

    def small_chunks():
        yield small[:100].encode()
        yield small[100:].encode()

    r = httpx.post(server.url + "/v1/completions", content=small_chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and "context length" in r.text  # read whole, then judged on its merits
    assert_nothing_held(server.url)


def test_client_leaving_a_whole_response_logs_no_traceback(server) -> None:
    def leave() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={"prompt": "bye", "max_tokens": 400, "ignore_eos": True},
                       timeout=0.3)

    ts = [threading.Thread(target=leave) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert_nothing_held(server.url)
    log = server.log()
    assert "never retrieved" not in log and "Traceback" not in log, log[-3000:]


def test_a_body_cut_short_by_the_client_is_dropped_quietly(server) -> None:
    import socket

    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 5000\r\n\r\n{\"prompt\": \"cut")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    assert_nothing_held(server.url)
    assert "ClientDisconnect" not in server.log() and "Traceback" not in server.log(), server.log()[-3000:]


def test_openapi_documents_bodies_and_errors(server) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"):
        op = doc["paths"][path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert "$ref" in schema or "properties" in schema, (path, schema)
        assert {"200", "400", "413", "429", "503"} <= set(op["responses"]), (path, op["responses"].keys())
    ref = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    completion = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert "prompt" in completion["properties"] and "prompt" in completion["required"]


# ---- liveness: a frozen child ---------------------------------------------------------------
@pytest.mark.parametrize("child", ["scheduler", "detokenizer"])
def test_a_stopped_child_is_detected_in_flight_requests_fail_and_the_server_exits(child) -> None:
    s = ServerProc(*SIM, "--sim-step-ms", "20", "--heartbeat-timeout", "3")
    try:
        s.wait_ready()
        pids = s.child_pids()
        time.sleep(2.5)  # idle longer than a heartbeat: an idle engine is not a frozen one
        assert httpx.get(s.url + "/health").status_code == 200
        events: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={
                    "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
                events.extend(ln for ln in r.iter_lines() if ln.startswith("data: "))

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.5)
        os.kill(pids[child], signal.SIGSTOP)
        t.join(30)
        assert not t.is_alive()
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert f"the {child} process (pid {pids[child]}, stopped) has not answered" in error["message"]
        assert s.proc.wait(30) == 1  # exits for its supervisor to restart it
        assert s.wait_children_gone()  # the stopped one too
        assert "--heartbeat-timeout 3" in s.log()
    finally:
        for pid in s.child_pids().values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGCONT)
        s.stop()


# ---- shutdown: what the grace cuts ------------------------------------------------------------
def test_streams_cut_by_the_shutdown_grace_end_with_a_reason_and_an_error() -> None:
    s = ServerProc(*SIM, "--sim-step-ms", "20", "--shutdown-timeout", "1")
    try:
        s.wait_ready()
        events: list[str] = []
        whole: list[httpx.Response] = []

        def stream() -> None:
            with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=30, json={
                    "messages": [{"role": "user", "content": "x"}], "max_tokens": 400, "ignore_eos": True,
                    "stream": True}) as r:
                events.extend(ln for ln in r.iter_lines() if ln.startswith("data: "))

        def one() -> None:
            whole.append(httpx.post(s.url + "/v1/completions", timeout=30,
                                    json={"prompt": "x", "max_tokens": 400, "ignore_eos": True}))

        ts = [threading.Thread(target=stream), threading.Thread(target=one)]
        for t in ts:
            t.start()
        time.sleep(0.5)
        s.proc.send_signal(signal.SIGTERM)
        for t in ts:
            t.join(30)
        assert s.proc.wait(30) == 0
        assert events[-1] == "data: [DONE]"
        finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e[6:])["choices"] if c["finish_reason"]]
        assert finishes == ["abort"]  # the finish reason, then why
        assert "shutting down" in json.loads(events[-2][6:])["error"]["message"]
        assert whole[0].status_code == 503 and "shutting down" in whole[0].json()["error"]["message"]
    finally:
        s.stop()


# ---- the gateway: its key and a replica that dies ----------------------------------------------
def test_gateway_requires_the_key_and_records_only_authenticated_prompts() -> None:
    port = free_port_run(3)
    s = ServerProc(*SIM, "--dp", "2", "--api-key", "K", port=port)
    try:
        s.wait_ready()
        key = {"Authorization": "Bearer K"}
        assert httpx.get(s.url + "/health").status_code == 200
        for path in ("/v1/loads", "/metrics", "/v1/models"):
            r = httpx.get(s.url + path)
            assert r.status_code == 401 and "API key" in r.text, (path, r.status_code)
            assert httpx.get(s.url + path, headers=key).status_code == 200

        def queried() -> float:
            text = httpx.get(s.url + "/metrics", headers=key).text
            return float(next(ln.split()[-1] for ln in text.splitlines()
                              if ln.startswith("lockgate:gateway_prefix_blocks_queried_total")))

        before = queried()
        body = {"prompt": "secret prompt " * 20, "max_tokens": 2}
        r = httpx.post(s.url + "/v1/completions", json=body)
        assert r.status_code == 401
        assert queried() == before  # never routed, never put in the prefix index
        assert httpx.post(s.url + "/v1/completions", json=body, headers=key).status_code == 200
        assert queried() > before
    finally:
        s.stop()


def test_serve_dp_restarts_a_dead_replica_and_reports_degraded_meanwhile() -> None:
    port = free_port_run(3)
    s = ServerProc(*SIM, "--dp", "2", "--health-interval", "0.5", port=port)
    try:
        s.wait_ready()
        deadline = time.monotonic() + 60
        while httpx.get(s.url + "/health").json()["status"] != "ok":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        victim = s.child_pids()["replica1"]
        os.kill(victim, signal.SIGKILL)  # its scheduler and detokenizer follow (they watch their parent)
        # The gateway holds the dead replica's port (bound, not listening): a connection is refused at
        # once (the proxy retries it elsewhere), not queued until the restart.
        deadline = time.monotonic() + 0.9  # the restart comes after 1 s
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port + 1}/health", timeout=0.5)
            except httpx.ConnectError:
                break
            except httpx.TimeoutException as e:
                raise AssertionError("a connection to a dead replica's port hung instead of being refused") from e
            assert time.monotonic() < deadline, "the dead replica's port still answered"
            time.sleep(0.02)
        statuses = set()
        deadline = time.monotonic() + 60
        while True:
            h = httpx.get(s.url + "/health")
            assert h.status_code == 200  # the other replica keeps serving
            statuses.add(h.json()["status"])
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "still", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
            if "degraded" in statuses and h.json()["status"] == "ok":
                break
            assert time.monotonic() < deadline, (statuses, h.json())
            time.sleep(0.2)
        metrics = httpx.get(s.url + "/metrics").text
        assert f'lockgate:gateway_replica_restarts_total{{replica="http://127.0.0.1:{port + 1}"}} 1.0' in metrics
        assert "replica 1 (http://127.0.0.1:" in s.log() and "restarting it in 1s" in s.log()
        assert s.child_pids()["replica1#2"] != victim
    finally:
        pids = s.child_pids()
        assert s.stop() == 0
    assert not any(pid_alive(p) for p in pids.values()), pids


# ---- fuzzing every route from its OpenAPI document ----------------------------------------------
def test_schema_fuzzing_finds_no_5xx_and_leaks_nothing() -> None:
    """schemathesis draws bodies from the server's own OpenAPI document, valid ones and ones that
    break it (negative mode), for every route; a fixed Hypothesis seed keeps the run the same."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    s = ServerProc(*SIM, "--sim-step-ms", "1", "--max-queued-requests", "8", "--default-max-tokens", "16")
    try:
        s.wait_ready()
        schema = schemathesis.openapi.from_url(s.url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 11
        server_errors: list[tuple[str, int, str, object]] = []

        def fuzz(op, mode) -> None:
            @given(op.as_strategy(generation_mode=mode))
            @settings(max_examples=25, derandomize=True, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case) -> None:
                r = case.call(base_url=s.url, timeout=60)
                if r.status_code >= 500:
                    server_errors.append((f"{op.method.upper()} {op.path}", r.status_code, r.text[:300], case.body))

            run()

        for op in operations:  # a route without a body has no invalid form to draw
            for mode in GenerationMode if op.method == "post" else [GenerationMode.POSITIVE]:
                fuzz(op, mode)
        assert not server_errors, server_errors[:5]
        assert_nothing_held(s.url)
        assert "Traceback" not in s.log(), s.log()[-3000:]
    finally:
        s.stop()


# ---- units: limits and the one owner of a queue place -------------------------------------------
def test_default_body_limit_follows_the_context() -> None:
    from lockgate.server_config import ServerConfig

    assert ServerConfig().request_bytes_limit(8192) == 4 * 1024**2  # SmolLM2: 4 MiB; a 10 MB prompt is a 413
    assert ServerConfig().request_bytes_limit(131072) == 128 * 131072
    assert ServerConfig(max_request_bytes="64KiB").request_bytes_limit(131072) == 65536
    for bad in ("12", "lots"):
        with pytest.raises(ValueError, match="--max-request-bytes"):
            ServerConfig(max_request_bytes=bad)
    with pytest.raises(ValueError, match="--heartbeat-timeout"):
        ServerConfig(heartbeat_timeout=0.5)


def test_a_request_that_fails_on_its_way_to_the_scheduler_holds_no_queue_place() -> None:
    """Every input the HTTP routes accept now serializes, so this failure point is reached here with a
    stand-in channel that refuses to send (the real one raised on surrogates and 65-bit ints)."""
    import asyncio

    from lockgate.ipc.messages import Ready
    from lockgate.sampling import SamplingParams
    from lockgate.server.frontend import EngineClient
    from lockgate.server.metrics import Metrics

    class Refusing:
        def send_nowait(self, msg: object) -> None:
            raise OverflowError("cannot serialize")

        def close(self) -> None:
            pass

    async def scenario() -> None:
        client = EngineClient("m", "sim", "ipc:///nonexistent/a", f"ipc:///tmp/lockgate-test-{os.getpid()}", Metrics("m"))
        try:
            client.info = Ready(model="m", model_dir=None, max_model_len=64, capacity=64, vocab_size=300,
                                eos_token_ids=[2], dtype="sim", scheduler_pid=0)
            client.to_scheduler.close()
            client.to_scheduler = Refusing()  # type: ignore[assignment]
            for _ in range(3):
                with pytest.raises(OverflowError):
                    client.submit(client.new_id("t"), [5, 6], SamplingParams(max_tokens=2))
            assert client.num_queued == 0 and client.streams == {}
        finally:
            await client.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "gateway", "tune", "bench"])
def test_every_command_prints_its_help(command) -> None:
    # A '%' in a flag's help once made 'lockgate serve --help' crash (argparse %-formats help text).
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lockgate.cli", command, "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout


def test_every_flag_of_every_command_has_help_text() -> None:
    import argparse

    from lockgate.cli import build_parser

    bare: list[str] = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, [*path, name])
            elif not (a.help or "").strip():
                bare.append(" ".join([*path, *(a.option_strings or [a.dest])]))

    walk(build_parser(), ["lockgate"])
    assert bare == []


@pytest.mark.parametrize("command", ["generate", "chat", "tune"])
def test_a_model_lockgate_cannot_load_is_one_line_not_a_traceback(command, tmp_path) -> None:
    import subprocess
    import sys

    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text('{"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}')
    save_file({"w": np.zeros(4, np.float32)}, str(tmp_path / "model.safetensors"))
    args = [command, "--model", str(tmp_path), "--log-level", "WARNING"] + (["hello"] if command != "tune" else [])
    out = subprocess.run([sys.executable, "-m", "lockgate.cli", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and out.stderr.strip().splitlines()[-1].startswith("lockgate: error:")
    assert "gpt_neox" in out.stderr and "llama" in out.stderr  # what it is, and what is supported


def test_serve_dp_shutdown_gives_streams_the_replicas_grace_and_restarts_nothing() -> None:
    """Ctrl-C to the whole group: the gateway and the replicas all get SIGINT; a stream still running
    when the replicas' --shutdown-timeout ends gets its abort chunk and error event through the
    gateway, and the idle replica that exits at once (code 0) is not mistaken for a crash."""
    port = free_port_run(3)
    s = ServerProc(*SIM, "--sim-step-ms", "50", "--dp", "2", "--shutdown-timeout", "2", "--policy", "round-robin",
                   port=port)
    try:
        s.wait_ready()
        deadline = time.monotonic() + 60
        while httpx.get(s.url + "/health").json()["status"] != "ok":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        events: list[str] = []
        took: list[float] = []

        def stream() -> None:
            with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={
                    "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
                events.extend(ln for ln in r.iter_lines() if ln.startswith("data: "))

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        os.killpg(s.proc.pid, signal.SIGINT)
        t.join(60)
        took.append(time.monotonic() - t0)
        assert s.proc.wait(60) == 0
        assert events[-1] == "data: [DONE]", events[-3:]
        assert "shutting down" in json.loads(events[-2][6:])["error"]["message"]
        assert [c["finish_reason"] for e in events[:-2] for c in json.loads(e[6:])["choices"] if c["finish_reason"]] \
            == ["abort"]
        assert took[0] < 9, took  # the replicas' 2 s grace, not the gateway's old fixed 10 s
        log = s.log()
        assert "restarting it" not in log and "restarted" not in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    finally:
        s.stop()


def test_gateway_drops_a_body_cut_short_quietly() -> None:
    import socket

    port = free_port_run(2)
    s = ServerProc(*SIM, "--dp", "1", port=port)
    try:
        s.wait_ready()
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", s.port)) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n{\"prompt\": \"cut")
        time.sleep(0.5)
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
        assert "ClientDisconnect" not in s.log() and "Traceback" not in s.log(), s.log()[-3000:]
    finally:
        s.stop()


def test_a_batch_that_can_never_be_queued_is_refused_before_tokenizing(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["p" * 2000] * 20, "max_tokens": 2})
    assert r.status_code == 400 and "20 prompts x n=1" in r.text and r.json()["error"]["param"] == "prompt"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                               "n": 5, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
