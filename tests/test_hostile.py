"""No request can take the server down (issue 48): grammars, adapters, tool calls and connections
under hostile input, against real servers over real HTTP.

Each attack asserts what a client sees (a 4xx naming the field, never a 5xx or a cut stream) and
that nothing else was hurt: the processes are alive, ``/v1/loads`` holds nothing afterwards, and
(on the default model) ``/health`` never stalls for more than 0.5 s and an unconstrained stream
running meanwhile never for more than 1 s (on a quiet 2-core host the six attacks arriving at once
cost the stream one gap of ~0.2 s; 0.56 s was seen with the rest of the suite's processes around). The sim model serves the API surface; the default model the stall bound and the
tool schemas a real tokenizer compiles.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_util import ServerProc, pid_alive

from lockgate.server.tool_parsers import PARSERS

SIM = ("--model", "sim", "--max-model-len", "4096", "--sim-step-ms", "5", "--max-total-tokens", "65536")


def rule_bomb(n: int = 3000) -> str:
    """Lark rules each referring to the next twice: recursion as deep as the rules are many."""
    return "start: r0\n" + "\n".join(f'r{i}: r{i + 1} r{i + 1} | "x{i}"' for i in range(n)) + f'\nr{n}: "end"'


REGEX_BOMB = "((a{200}){200}){200}"  # ~1.3 s to compile on Zen 3: six times a 0.2 s limit
DEEP_JSON = "[" * 1000


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> tuple[Path, Path]:
    """(the --lora-root, a directory outside it)."""
    return tmp_path_factory.mktemp("lora-root"), tmp_path_factory.mktemp("elsewhere")


@pytest.fixture(scope="module")
def server(roots):
    s = ServerProc(*SIM, "--sim-step-ms", "1", "--allow-runtime-lora-updating", "--lora-root", str(roots[0]),
                   "--grammar-workers", "2",
                   "--grammar-compile-timeout", "5", "--http-header-timeout", "1.5", "--http-body-timeout", "1.5",
                   "--max-loras", "2")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def post(url: str, path: str, body: dict | str, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(url + path, content=content.encode(), headers={"content-type": "application/json"},
                      timeout=timeout)


def alive(s: ServerProc) -> None:
    assert s.proc.poll() is None, s.log()[-3000:]
    assert all(pid_alive(p) for p in s.child_pids().values()), s.child_pids()
    assert httpx.get(s.url + "/health", timeout=10).status_code == 200


def nothing_held(url: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        ld = httpx.get(url + "/v1/loads", timeout=10).json()
        if ld["queued_in_api"] == 0 and ld["in_flight"] == 0 and ld["slots_used"] == 0 and ld["waiting"] == 0:
            return
        assert time.monotonic() < deadline, ld
        time.sleep(0.05)


# ---- grammars --------------------------------------------------------------------------------
GRAMMAR_BOMBS = [  # (body fields, the field the 400 must name, what its message says)
    ({"guided_grammar": rule_bomb()}, "guided_grammar", "crashed the grammar compiler"),
    ({"structured_outputs": {"grammar": rule_bomb()}}, "structured_outputs", "crashed the grammar compiler"),
    ({"ebnf": rule_bomb(4000)}, "ebnf", "crashed the grammar compiler"),
    ({"guided_json": DEEP_JSON}, "guided_json", "nested too deeply"),
    ({"json_schema": DEEP_JSON}, "json_schema", "nested too deeply"),
    ({"structured_outputs": {"json": DEEP_JSON}}, "structured_outputs", "nested too deeply"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP_JSON}}},
     "response_format", "nested too deeply"),
    ({"guided_json": '{"type": "object", "x": "\\ud800"}'}, "guided_json", "lone surrogate"),
    ({"guided_regex": "(" * 5000 + ")" * 5000}, "guided_regex", ""),
    ({"guided_grammar": "start: " + "(" * 3000 + '"a"' + ")" * 3000}, "guided_grammar", ""),
    ({"guided_choice": ["x" * 10] * 0}, "guided_choice", "non-empty"),
    ({"guided_json": '{"a":' * 5000 + "1" + "}" * 5000, "guided_whitespace_pattern": " "}, "guided_json",
     "nested too deeply"),
    ({"structured_outputs": {"json": {"x-guidance": [1]}, "disable_any_whitespace": True}}, "structured_outputs",
     "x-guidance must be an object"),
    ({"guided_regex": "x" * 300_000}, "guided_regex", "characters long"),
]


@pytest.mark.parametrize(("fields", "param", "needle"), GRAMMAR_BOMBS,
                         ids=[f"{i}-{p}" for i, (_, p, _) in enumerate(GRAMMAR_BOMBS)])
def test_a_grammar_bomb_is_a_400_naming_its_field_and_hurts_nobody(server, fields, param, needle) -> None:
    r = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **fields})
    assert r.status_code == 400, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    again = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **fields})  # cached: the same
    assert again.status_code == 400 and again.json()["error"]["message"] == err["message"]
    ok = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "guided_regex": "[a-z]{3}"})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) == 3, ok.text
    alive(server)
    nothing_held(server.url)


def test_compiles_never_hold_other_requests_and_a_full_queue_is_a_429() -> None:
    """One slow worker, a queue of two: slow grammars fill it; a third constraint gets 429 with
    Retry-After at once, and unconstrained requests meanwhile answer at their usual pace."""
    s = ServerProc(*SIM, "--grammar-workers", "1", "--grammar-queue-size", "2", "--grammar-compile-timeout", "5")
    try:
        s.wait_ready()
        slow = [f"((a{{200}}){{200}}){{{200 + i}}}" for i in range(4)]  # distinct: no shared compile
        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(post, s.url, "/v1/completions",
                                {"prompt": "hi", "max_tokens": 2, "guided_regex": g}) for g in slow]
            time.sleep(0.3)
            t0 = time.monotonic()
            plain = [post(s.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4}) for _ in range(5)]
            plain_s = time.monotonic() - t0
            codes = [f.result().status_code for f in futs]
            busy = next(f.result() for f in futs if f.result().status_code == 429)
        # ~0.1 s alone; held behind a compile they would wait out its 5 s limit (the bound leaves
        # room for a loaded 2-core machine, where the other test worker's servers share the cores)
        assert all(r.status_code == 200 for r in plain) and plain_s < 4.0, plain_s
        assert codes.count(429) >= 1 and set(codes) <= {200, 400, 429}, codes  # (400: it broke mid-answer)
        assert int(busy.headers["retry-after"]) >= 1 and busy.json()["error"]["param"] == "guided_regex"
        alive(s)
        nothing_held(s.url)
    finally:
        s.stop()


def test_a_constraint_that_breaks_after_its_first_token_ends_with_an_error_not_a_stop(server) -> None:
    """llguidance gives up on some grammars only once decoding is under way (a limit it reaches
    past the first mask): the request ends with a 400 (a stream: an error event, then [DONE]),
    never a "stop" whose text does not follow the constraint."""
    body = {"prompt": "hi", "max_tokens": 8, "structured_outputs": {"regex": "a{4294967295}"}}
    r = post(server.url, "/v1/completions", body)
    assert r.status_code == 400 and "constraint failed" in r.json()["error"]["message"], r.text[:300]
    assert r.json()["error"]["param"] == "structured_outputs"  # the field whose constraint failed
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2] and "constraint failed" in lines[-2], lines[-3:]
    assert json.loads(lines[-2][len("data: "):])["error"]["param"] == "structured_outputs"
    nothing_held(server.url)


def test_a_tool_schema_the_engine_cannot_compile_is_a_400_before_anything_runs(server) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"$defs": {"a": {"$ref": "#/$defs/a"}},
                                                                           "$ref": "#/$defs/a"}}}]
    r = post(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                   "tool_choice": "required", "max_tokens": 16})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text[:300]


def test_abandoned_compiles_do_not_hold_the_workers_for_later_constraints() -> None:
    """Clients that send slow grammars and leave: their queued compiles are dropped, and a request
    that stays waits only for what was already running (or gets a 429 after two timeouts)."""
    s = ServerProc(*SIM, "--grammar-workers", "1", "--grammar-compile-timeout", "0.2")
    try:
        s.wait_ready()
        # a compile past the limit is a 400 naming the field and the limit, and is not tried again
        r = post(s.url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_regex": REGEX_BOMB})
        assert r.status_code == 400 and "did not compile within 0.2 s" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "guided_regex"
        again = post(s.url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_regex": REGEX_BOMB})
        assert again.status_code == 400 and again.json()["error"]["message"] == r.json()["error"]["message"]
        with ThreadPoolExecutor(8) as pool:
            for i in range(8):  # each client gives up after 0.3 s
                pool.submit(lambda i=i: httpx.post(s.url + "/v1/completions", timeout=0.3, json={
                    "prompt": "x", "max_tokens": 2, "guided_regex": f"((a{{200}}){{200}}){{{300 + i}}}"}))
            time.sleep(0.6)
            t0 = time.monotonic()
            r = post(s.url, "/v1/completions", {"prompt": "x", "max_tokens": 3, "guided_regex": "[0-9]{3}"})
            waited = time.monotonic() - t0
        # at most the one compile running and a worker restart; all eight: eight timeouts and restarts
        assert r.status_code == 200 and waited < 6, (r.status_code, waited)
        alive(s)
    finally:
        s.stop()


# ---- adapters --------------------------------------------------------------------------------
def sim_adapter(where: Path, config: str | None = None) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "adapter_config.json").write_text(config if config is not None else json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}))
    return where


HOSTILE_CONFIGS = {  # name -> (adapter_config.json text, what the 400 says)
    "r-null": ('{"r": null}', "r must be an integer"),
    "alpha-object": ('{"r": 8, "lora_alpha": {}}', "lora_alpha must be a finite number"),
    "alpha-huge": ('{"r": 8, "lora_alpha": 1e400}', "lora_alpha: a number is out of range"),
    "deep": ('{"r": ' + "[" * 3000 + "]" * 3000 + "}", "nested too deeply"),
    "modules-object": ('{"r": 8, "target_modules": {"a": 1}}', "target_modules"),
    "module-name": ('{"r": 8, "target_modules": ["q_proj\\u0000"]}', "not a module name"),
    "pattern-regex": ('{"r": 8, "alpha_pattern": {"(a+)+$": 2}}', "patterns are not supported"),
    "rank-huge": ('{"r": 100000}', "r must be an integer"),
    "not-object": ("[1, 2]", "not a JSON object"),
    "surrogate": ('{"r": 8, "base_model_name_or_path": "\\ud800"}', "lone surrogate"),
}


@pytest.mark.parametrize("name", list(HOSTILE_CONFIGS))
def test_a_hostile_adapter_config_is_a_400_and_the_scheduler_lives(server, roots, name) -> None:
    text, needle = HOSTILE_CONFIGS[name]
    path = sim_adapter(roots[0] / f"hostile-{name}", text)
    r = post(server.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text[:400]
    alive(server)
    assert name not in [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]


def test_adapter_files_are_size_checked_and_links_out_are_refused(server, roots) -> None:
    root, elsewhere = roots
    big = sim_adapter(root / "big", '{"r": 8, "pad": "' + "x" * (2 * 1024 * 1024) + '"}')
    t0 = time.monotonic()
    r = post(server.url, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
    assert r.status_code == 400 and "larger than" in r.text and time.monotonic() - t0 < 5
    secret = elsewhere / "secret.json"
    secret.write_text(json.dumps({"r": 8, "base_model_name_or_path": "the secret", "target_modules": ["s3cret"]}))
    linked = root / "linked"
    linked.mkdir()
    (linked / "adapter_config.json").symlink_to(secret)
    r = post(server.url, "/v1/load_lora_adapter", {"lora_name": "linked", "lora_path": str(linked)})
    assert r.status_code == 400 and "outside the adapter directory" in r.text
    assert "s3cret" not in httpx.get(server.url + "/v1/models").text
    alive(server)


def test_paths_outside_the_lora_root_get_one_answer_and_names_are_printable(server, roots) -> None:
    root, elsewhere = roots
    real = sim_adapter(elsewhere / "real")
    answers = set()
    for path in (str(real), str(elsewhere / "absent"), "/etc", str(root / ".." / elsewhere.name / "real"),
                 str(root / "nope" / ".." / ".." / elsewhere.name)):
        r = post(server.url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        answers.add(r.json()["error"]["message"])
    assert len(answers) == 1, answers  # nothing tells a path that exists from one that does not
    for bad in ("a\u0000b", "line\nbreak", "   ", "\u202esim", "a\u200bb"):
        r = post(server.url, "/v1/load_lora_adapter", {"lora_name": bad, "lora_path": str(sim_adapter(root / "n"))})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    alive(server)


def test_a_fifo_where_a_file_should_be_is_a_400_at_once_and_loads_go_on(server, roots) -> None:
    fifo = roots[0] / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "adapter_config.json")
    t0 = time.monotonic()
    r = post(server.url, "/v1/load_lora_adapter", {"lora_name": "fifo", "lora_path": str(fifo)})
    assert r.status_code == 400 and "not a regular file" in r.text and time.monotonic() - t0 < 5, r.text
    good = sim_adapter(roots[0] / "after-fifo")
    assert post(server.url, "/v1/load_lora_adapter", {"lora_name": "after-fifo", "lora_path": str(good)}
                ).status_code == 200
    assert post(server.url, "/v1/unload_lora_adapter", {"lora_name": "after-fifo"}).status_code == 200


def test_runtime_adapter_changes_are_off_unless_enabled() -> None:
    s = ServerProc(*SIM)
    try:
        s.wait_ready()
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/etc"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "a"})):
            r = post(s.url, path, body)
            assert r.status_code == 403 and "--allow-runtime-lora-updating" in r.text, r.text
    finally:
        s.stop()


def test_load_unload_churn_under_load_gives_404s_never_500s(server, roots) -> None:
    """Requests for an adapter being loaded and unloaded over and over: each is answered by the
    adapter (200) or told it is not loaded (404 naming it); none fails, nothing is left held."""
    path = sim_adapter(roots[0] / "churn")
    stop = threading.Event()
    codes: list[int] = []
    bad: list[str] = []

    def client() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            while not stop.is_set():
                for stream in (False, True):
                    r = c.post("/v1/completions", json={"model": "churn", "prompt": "hello", "max_tokens": 8,
                                                        "stream": stream})
                    codes.append(r.status_code)
                    if r.status_code == 200 and stream and "[DONE]" not in r.text:
                        bad.append(r.text[-300:])
                    if r.status_code == 200 and stream and '"error"' in r.text:
                        bad.append(r.text[-300:])
                    if r.status_code not in (200, 404) or (r.status_code == 404 and "churn" not in r.text):
                        bad.append(f"{r.status_code} {r.text[:300]}")

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        for _ in range(25):
            assert post(server.url, "/v1/load_lora_adapter", {"lora_name": "churn", "lora_path": str(path)}
                        ).status_code == 200
            time.sleep(0.02)
            assert post(server.url, "/v1/unload_lora_adapter", {"lora_name": "churn"}).status_code == 200
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not bad, bad[:5]
    assert codes.count(200) > 0 and codes.count(404) > 0, (codes.count(200), codes.count(404))
    alive(server)
    nothing_held(server.url)


# ---- tool calls: model output the parser did not expect ------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NESTED = "{\"a\": " * 70 + "1" + "}" * 70  # past jsonsafe's 64 levels
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # the sim server's format (its template does not render tools: hermes)
HOSTILE_OUTPUTS = [
    OPEN + '\n{"name": {"x": 1}, "arguments": {}}\n' + CLOSE,  # a name that is an object
    OPEN + '\n{"name": ["get_weather"], "arguments": {}}\n' + CLOSE,
    OPEN + '\n{"name": "get_weather", "arguments": ' + NESTED + "}\n" + CLOSE,  # deeper than the parser goes
    OPEN + '\n{"name": "get_weather", "arguments": {"city": "\\ud800"}}\n' + CLOSE,  # a lone surrogate escape
    OPEN + '\n{"name": "get_weather", "arguments": [1, 2]}\n' + CLOSE,
    OPEN + '\n{"name": "get_weather", "arguments": "{\\"city\\": ' + "[" * 70 + '"}\n' + CLOSE,
    OPEN + '\n{"name": "get_weather", "arguments": {"city": 1e400}}\n' + CLOSE,
    OPEN + "\n" + "[" * 80,  # never closed
]


@pytest.mark.parametrize("i", range(len(HOSTILE_OUTPUTS)))
def test_tool_call_output_the_parser_did_not_expect_is_text_whole_and_streamed(server, i) -> None:
    """The sim model is made to write exactly ``HOSTILE_OUTPUTS[i]`` (a one-choice constraint):
    whole, a 200 whose content is the text; streamed, every event parses and it ends with [DONE]."""
    text = HOSTILE_OUTPUTS[i]
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "tool_choice": "auto",
            "guided_choice": [text], "max_tokens": len(text.encode()) + 4}
    r = post(server.url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text[:400]
    msg = r.json()["choices"][0]["message"]
    assert not msg.get("tool_calls") and msg["content"] == text
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert not any("error" in e for e in events), events[-3:]
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == text


FRAGMENTS = st.sampled_from([OPEN, CLOSE, "\n", "{", "}", "[", "]", '"name"', '"arguments"', '"parameters"', ":", ",",
                             '"get_weather"', '"other"', '"\\ud800"', '"city"', "1e400", "null", "<tool_", "</tool",
                             '{"name": "get_weather", "arguments": {"city": "Paris"}}', "\\", '"', "x",
                             # the other formats' pieces
                             "<function=get_weather>", "<parameter=city>", "</parameter>", "</function>", "<function=",
                             "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "get_weather", "<|python_tag|>", ";", "</s>",
                             "<|python_start|>", "<|python_end|>", "get_weather(", "city=", ")", "'Paris'", "(",
                             " ", "1", "True", "x=1", "lambda: 0", "{1, 2}", "b'x'", "1j", "9" * 30])


@pytest.mark.parametrize("fmt", sorted(PARSERS))
@settings(max_examples=160, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(FRAGMENTS, st.text(max_size=6)), max_size=40), st.lists(st.integers(1, 9), max_size=20))
def test_the_tool_call_parser_is_total_and_streams_what_it_parses(fmt, pieces, cuts) -> None:
    """Any text, every format: parsing never raises; every call names a known function with a JSON
    object's text as its arguments (valid UTF-8); fed in any chunks, the stream gives the same content and calls."""
    text = "".join(pieces)
    parser, tools = PARSERS[fmt], {"get_weather": TOOLS[0]["function"]["parameters"]}
    content, calls = parser.parse(text, tools)
    for c in calls:
        assert c.name in tools
        assert isinstance(json.loads(c.arguments), dict)
        c.arguments.encode("utf-8")
    stream, shown, streamed = parser.stream(tools), [], []
    at = 0
    for n in [*cuts, len(text)]:
        piece, at = text[at:at + n], at + n
        out, got = stream.feed(piece)
        shown.append(out)
        streamed += got
    rest, more = stream.finish()
    shown.append(rest)
    streamed += more
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    whole = "".join(shown)
    if not calls:
        assert whole == text == content  # nothing parsed: every character comes out as it went in
    else:  # the calls' text is taken out; what is shown is the rest (whitespace next to a call may go)
        assert "".join(whole.split()) == "".join((content or "").split())


# ---- connections -------------------------------------------------------------------------------
def test_a_connection_that_never_finishes_its_headers_or_body_is_closed(server) -> None:
    conns = []
    for request in (b"GET /health HTTP/1.1\r\nHost: x\r\n", b"",  # half the headers; nothing at all
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{"):  # one byte of a 100-byte body
        s = socket.create_connection(("127.0.0.1", server.port))
        s.settimeout(10)
        s.sendall(request)
        conns.append((s, time.monotonic()))
    for s, t0 in conns:
        assert s.recv(100) == b"" and time.monotonic() - t0 < 4  # closed by the server (1.5 s deadlines)
        s.close()
    # a keep-alive client that sends its requests in time is not affected
    with httpx.Client(base_url=server.url) as c:
        assert all(c.get("/health").status_code == 200 for _ in range(3))
        time.sleep(1.0)
        assert c.get("/health").status_code == 200


# ---- the default model: tool schemas, and the stall bound under attack ---------------------------
UNIT_TOOL = [{"type": "function", "function": {"name": "get_temperature", "description": "the temperature", "parameters": {
    "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"], "title": "Unit", "type": "string"}},
    "properties": {"city": {"title": "City", "type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"], "title": "GetTemperature", "type": "object"}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_temperature"}}])
def test_tool_parameters_with_defs_work_under_every_tool_choice(smol_server, choice) -> None:
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x")
    out = client.chat.completions.create(model="default", tools=UNIT_TOOL, tool_choice=choice, max_tokens=60,
                                         temperature=0, messages=[{"role": "user", "content": "Weather in Paris?"}])
    (call,) = out.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_temperature" and args["unit"] in ("celsius", "fahrenheit")


def test_attacks_never_stall_health_or_a_running_stream(smol_server, tmp_path) -> None:
    """While grammar bombs, hostile adapter files and a large config arrive, a stream's tokens and
    /health keep coming: no stream gap above 1 s, no /health answer slower than 0.5 s; every attack is a 4xx."""
    url = smol_server.url
    gaps: list[float] = []
    health: list[float] = []
    streaming = threading.Event()
    done = threading.Event()

    def stream() -> None:
        body = {"model": "default", "prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "stream": True,
                "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            last = None
            for ln in r.iter_lines():
                now = time.monotonic()
                if ln.startswith("data: {"):
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    streaming.set()
        done.set()

    def poll_health() -> None:
        with httpx.Client(timeout=10) as c:
            while not done.is_set():
                t0 = time.monotonic()
                assert c.get(url + "/health").status_code == 200
                health.append(time.monotonic() - t0)
                time.sleep(0.05)

    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_text('{"r": 8, "pad": "' + "x" * (150 * 1024 * 1024) + '"}')
    # the grammar machinery starts with the first constraint (a worker process, the scheduler's view
    # of the tokenizer: a second of CPU, once); that start-up is not what is measured here
    assert post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_regex": "[0-9]{2}"}).status_code == 200
    threads = [threading.Thread(target=stream), threading.Thread(target=poll_health)]
    for t in threads:
        t.start()
    assert streaming.wait(60)
    attacks = [("/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_grammar": rule_bomb()}),
               ("/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_json": DEEP_JSON}),
               ("/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_regex": "((a{150}){150}){120}"}),
               ("/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_grammar": "start: " + "(" * 3000 + '"a"'
                                    + ")" * 3000}),
               ("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)}),
               ("/v1/load_lora_adapter", {"lora_name": "null", "lora_path": str(sim_adapter(tmp_path / "n",
                                                                                          '{"r": null}'))})]
    with ThreadPoolExecutor(len(attacks)) as pool:
        results = list(pool.map(lambda a: post(url, *a), attacks))
    statuses = [r.status_code for r in results]
    for t in threads:
        t.join(120)
    assert all(400 <= s < 500 for s in statuses[:2] + statuses[3:]), [(r.status_code, r.text[:200]) for r in results]
    assert statuses[2] in (200, 400), results[2].text[:300]  # a slow regex compiles in a worker, or times out
    metrics = httpx.get(url + "/metrics").text
    assert 'lockgate:grammar_compiles_total{engine="0",model_name="default",outcome="crash"}' in metrics
    assert gaps and max(gaps) < 1.0, sorted(gaps)[-5:]
    assert health and max(health) < 0.5, sorted(health)[-5:]
    alive(smol_server)
    nothing_held(url)
    os.remove(big / "adapter_config.json")
