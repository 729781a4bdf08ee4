"""The three-process server on the ``sim`` model: real processes, real HTTP, the official openai client.

The sim model (``--model sim``) runs the real scheduler, detokenizer and API with a simulated
runner (deterministic tokens, a small cost model of step time), so these tests exercise every
process boundary in seconds. The default model's end-to-end checks are in test_server_model.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from server_util import ServerProc, pid_alive

SIM = ("--model", "sim", "--max-model-len", "512", "--sim-step-ms", "5", "--log-level", "INFO")


@pytest.fixture(scope="module")
def server():
    s = ServerProc(*SIM, "--max-total-tokens", "4096")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def loads(server) -> dict:
    return httpx.get(server.url + "/v1/loads").json()


def wait_idle(server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        ld = loads(server)
        if ld["running"] == 0 and ld["waiting"] == 0 and ld["in_flight"] == 0 and ld["slots_used"] == 0:
            return ld
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle: {ld}")
        time.sleep(0.05)


# ---- OpenAI API through the official client --------------------------------------------
def test_completions_and_chat_with_openai_client(server, client) -> None:
    r = client.completions.create(model="sim", prompt="Hello there", max_tokens=7)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].text) > 0
    assert r.usage.prompt_tokens == len(b"Hello there") and r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.usage.prompt_tokens_details.cached_tokens == 0

    # streaming returns the same text as the whole response (the sim model is deterministic)
    chunks = list(client.completions.create(model="sim", prompt="Hello there", max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 7 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    c = client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert c.choices[0].message.role == "assistant" and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 5
    sc = list(client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}],
                                             max_completion_tokens=5, stream=True))
    assert sc[0].choices[0].delta.role == "assistant"
    assert "".join(x.choices[0].delta.content or "" for x in sc) == c.choices[0].message.content


def test_n_choices_batch_prompts_echo_and_logprobs(server, client) -> None:
    r = client.completions.create(model="sim", prompt=["ab", "cde"], max_tokens=3, n=2, echo=True)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]
    by = {ch.index: ch.text for ch in r.choices}
    assert by[0].startswith("ab") and by[2].startswith("cde")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    lp = client.completions.create(model="sim", prompt="xyz", max_tokens=4, logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(len(t) == 2 for t in lp.top_logprobs)
    ch = client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                        logprobs=True, top_logprobs=3)
    content = ch.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)


def test_models_tokenize_detokenize(server, client) -> None:
    ms = client.models.list()
    assert [m.id for m in ms.data] == ["sim"]
    t = httpx.post(server.url + "/tokenize", json={"prompt": "héllo"}).json()
    assert t["count"] == len("héllo".encode()) == len(t["tokens"]) and t["max_model_len"] == 512
    assert httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "héllo"}
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2


# ---- TGI-native API ---------------------------------------------------------------------
def test_tgi_generate_and_stream(server) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 6, "details": True}}
    r = httpx.post(server.url + "/generate", json=body)
    assert r.status_code == 200
    out = r.json()
    assert out["details"]["generated_tokens"] == 6 and out["details"]["finish_reason"] == "length"
    assert len(out["details"]["tokens"]) == 6 and all("logprob" in t for t in out["details"]["tokens"])
    with httpx.stream("POST", server.url + "/generate_stream", json=body) as s:
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    assert len(events) == 6 and [e["index"] for e in events] == list(range(1, 7))
    assert events[-1]["generated_text"] == out["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert all(e["generated_text"] is None for e in events[:-1])
    bad = httpx.post(server.url + "/generate", json={"inputs": "x", "parameters": {"top_p": 1.5}})
    assert bad.status_code == 422 and "top_p" in bad.json()["error"]


def test_any_model_name_means_the_one_served_unless_strict(server, client) -> None:
    """One model, no adapters: a request naming another model (huggingface_hub sends "dummy",
    TGI's clients "tgi") gets that model, answered under its real name; --strict-model-name
    restores vLLM's 404."""
    for name in ("dummy", "tgi", "gpt-4o"):
        r = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert r.model == client.models.list().data[0].id
        c = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert c.model == r.model and c.choices[0].message.content is not None
    strict = ServerProc(*SIM, "--max-total-tokens", "4096", "--strict-model-name")
    try:
        strict.wait_ready()
        r = httpx.post(strict.url + "/v1/completions", json={"prompt": "x", "model": "gpt-9", "max_tokens": 1})
        assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]
        served = httpx.get(strict.url + "/v1/models").json()["data"][0]["id"]
        ok = httpx.post(strict.url + "/v1/completions", json={"prompt": "x", "model": served, "max_tokens": 1})
        assert ok.status_code == 200
    finally:
        strict.stop()


TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"


def test_chat_template_flag_as_text_or_file_and_its_errors(tmp_path) -> None:
    """--chat-template replaces the model's template (vLLM's flag): inline or from a file, in the API's
    chat and /tokenize; a missing file or a template that does not parse stops the start with one line."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = "[system] Be brief.\n[user] Hi\n[bot]"
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    for value in (TEMPLATE, str(path)):
        s = ServerProc(*SIM, "--chat-template", value)
        try:
            s.wait_ready()
            ids = httpx.post(s.url + "/tokenize", json={"messages": messages}).json()["tokens"]
            assert httpx.post(s.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == want
            r = httpx.post(s.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
        finally:
            s.stop()
    for value, needle in (("/no/such/template.jinja", "no such file"), ("{% if %}", "does not parse")):
        r = subprocess.run([sys.executable, "-m", "lockgate.cli", "serve", *SIM, "--chat-template", value],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


# ---- bad input --------------------------------------------------------------------------
@pytest.mark.parametrize("body, status, needle, param", [
    ("{not json", 400, "not valid JSON", None),
    ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens", "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p", "top_p"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature", "temperature"),
    ({"prompt": ""}, 400, "empty", "prompt"),
    ({"prompt": "x", "max_tokens": 600}, 400, "512", "max_tokens"),
    ({"prompt": "x" * 600, "max_tokens": 1}, 400, "512", "max_tokens"),
    ({"prompt": [1, 2, 99999999]}, 400, "vocabulary", "prompt"),
    ({"max_tokens": 3}, 400, "prompt", "prompt"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of", "best_of"),
    ({"prompt": "x", "stop": [str(i) for i in range(17)]}, 400, "16", "stop"),
])
def test_bad_completion_requests_get_clear_4xx(server, body, status, needle, param) -> None:
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + "/v1/completions", content=data, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and err["type"]
    assert err["param"] == param, err  # the field the error is about, as OpenAI names it


def test_chat_bad_input_and_tolerated_fields(server, client) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and "text" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages[0].content"
    # a key the request gave that lockgate ignores is not blamed for an error it did not cause
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "only": 1, "guided_regex": "a", "guided_choice": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    # nulls, other servers' extensions and unknown fields are accepted
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "sim", "messages": [{"role": "user", "content": "hi", "tool_calls": None}], "max_tokens": 2,
        "temperature": None, "top_p": None, "stop": None, "tools": [], "parallel_tool_calls": False,
        "response_format": None, "chat_template_kwargs": {}, "some_new_field": 1})
    assert r.status_code == 200, r.text
    # fields that would change the output and that lockgate does not implement: a 400 naming each,
    # never a silent 200 (the same fields with values that ask for nothing pass, above and here)
    chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    # (or that it implements, given a value it cannot honour: an unknown response_format type, a tool
    # without its function, tool_choice without tools, a structured_outputs key it does not know)
    for field, value in (("response_format", {"type": "xml"}), ("tools", [{"type": "function"}]),
                         ("tool_choice", "required"), ("logit_bias", {"5": 10}), ("functions", [{"name": "f"}]),
                         ("structural_tag", {"x": 1}), ("structured_outputs", {"x": 1})):
        r = httpx.post(server.url + "/v1/chat/completions", json={**chat, field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
        assert r.json()["error"]["param"] == (field if field != "tools" else "tools[0].function"), r.text
    ok = httpx.post(server.url + "/v1/chat/completions", json={**chat, "response_format": {"type": "text"},
                                                                "tool_choice": "none", "logit_bias": {}})
    assert ok.status_code == 200, ok.text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "suffix": "end", "max_tokens": 2})
    assert r.status_code == 400 and "suffix" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/generate", json={"inputs": "x", "parameters": {"adapter_id": "my-lora"}})
    assert r.status_code == 404 and "my-lora" in r.json()["error"], r.text  # TGI's adapter_id names a LoRA
    for param, value in (("grammar", {"type": "ebnf", "value": "a+"}),
                         ("truncate", 10), ("typical_p", 0.5), ("watermark", True), ("decoder_input_details", True)):
        r = httpx.post(server.url + "/generate", json={"inputs": "x", "parameters": {param: value}})
        assert r.status_code == 422 and param in r.json()["error"], (param, r.text)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty") as bad:
        client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "x"}], frequency_penalty=3)
    assert bad.value.param == "frequency_penalty"  # what the openai package reads from the error body


# ---- cancellation -----------------------------------------------------------------------
def test_client_disconnects_abort_and_free_slots(server) -> None:
    wait_idle(server)
    body = {"prompt": "long one", "max_tokens": 400, "ignore_eos": True, "stream": True}

    def stream_then_drop() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # got the first token; close the connection

    threads = [threading.Thread(target=stream_then_drop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # non-streaming requests whose client gives up
    for _ in range(3):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
    ld = wait_idle(server)  # 400 tokens x 5 ms would take 2 s each; aborted at once instead
    assert ld["slots_free"] + ld["slots_evictable"] == ld["capacity"]  # aborted KV: free or cached
    metrics = httpx.get(server.url + "/metrics").text
    aborted = [ln for ln in metrics.splitlines() if ln.startswith('lockgate:request_success_total{finished_reason="abort"')
               or ln.startswith("lockgate:request_success_total") and 'finished_reason="abort"' in ln]
    assert aborted and float(aborted[0].split()[-1]) >= 11


def scrape(url: str) -> dict[str, float]:
    """/metrics as sample name{labels} -> value (labels sorted, model_name and engine dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for smp in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()) if k not in ("model_name", "engine"))
            out[f"{smp.name}{{{labels}}}" if labels else smp.name] = smp.value
    return out


def test_metrics_follow_vllm_names_and_count_what_happened(server, client) -> None:
    before = scrape(server.url)
    r = client.completions.create(model="sim", prompt="metrics", max_tokens=4, n=2)
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    wait_idle(server)
    after = scrape(server.url)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("lockgate:generation_tokens_total") == 8 == grew("lockgate:request_generation_tokens_sum")
    assert grew("lockgate:prompt_tokens_total") == 2 * r.usage.prompt_tokens  # per sequence, as vLLM counts
    assert grew("lockgate:request_prompt_tokens_sum") == grew("lockgate:prompt_tokens_total")
    for per_request in ("request_generation_tokens", "request_prompt_tokens", "e2e_request_latency_seconds",
                        "request_queue_time_seconds", "request_inference_time_seconds",
                        "request_prefill_time_seconds", "request_decode_time_seconds",
                        "time_to_first_token_seconds"):
        assert grew(f"lockgate:{per_request}_count") == 2, per_request
    # one sampling group of n = 2, max_tokens 4, whose longest sequence made 4 tokens
    assert (grew("lockgate:request_params_n_count"), grew("lockgate:request_params_n_sum")) == (1, 2)
    assert grew("lockgate:request_params_max_tokens_sum") == 4
    assert grew("lockgate:request_max_num_generation_tokens_sum") == 4
    assert grew("lockgate:inter_token_latency_seconds_count") == 6  # 3 gaps per sequence
    assert grew("lockgate:request_success_total{finished_reason=length}") == 2
    assert after["lockgate:num_preemptions_total"] == 0
    assert 0 <= after["lockgate:kv_cache_usage_perc"] <= 1
    for name in ("lockgate:num_requests_running", "lockgate:num_requests_waiting", "lockgate:prefix_cache_hits_total",
                 "lockgate:prefix_cache_queries_total", "lockgate:spec_decode_num_draft_tokens_total",
                 "lockgate:spec_decode_num_accepted_tokens_total"):
        assert name in after, name
    # vLLM's bucket bounds are all here (its queries' le values exist), token buckets 1-2-5 up to the context
    assert 'lockgate:time_to_first_token_seconds_bucket{le=2560.0}' in after
    assert 'lockgate:e2e_request_latency_seconds_bucket{le=7680.0}' in after
    assert 'lockgate:request_prompt_tokens_bucket{le=500.0}' in after  # the sim's context is 512
    assert not any(k.startswith("lockgate:request_prompt_tokens_bucket{le=1000.0") for k in after)


# ---- separate servers: limits, auth, lifecycle ---------------------------------------------
def test_queue_limit_429_and_api_key() -> None:
    s = ServerProc(*SIM, "--sim-step-ms", "100", "--max-running-requests", "1", "--max-queued-requests", "2",
                   "--api-key", "sekret")
    try:
        s.wait_ready()
        assert httpx.get(s.url + "/health").status_code == 200  # no key needed
        r = httpx.get(s.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = httpx.post(s.url + "/generate", json={"inputs": "x"})  # TGI route: TGI's error body
        assert r.status_code == 401 and "API key" in r.json()["error"] and r.json()["error_type"] == "error"
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
        assert c.models.list().data[0].id == "sim"
        chunks = list(c.completions.create(model="sim", prompt="x", max_tokens=3, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"
        codes: list[int] = []
        headers: list[str | None] = []

        def one() -> None:
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5},
                           headers={"Authorization": "Bearer sekret"}, timeout=30)
            codes.append(r.status_code)
            headers.append(r.headers.get("retry-after"))

        ts = [threading.Thread(target=one) for _ in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert 429 in codes and 200 in codes
        assert all(h == "1" for c_, h in zip(codes, headers, strict=True) if c_ == 429)
    finally:
        s.stop()


def test_sigterm_finishes_in_flight_and_exits_cleanly() -> None:
    s = ServerProc(*SIM, "--sim-step-ms", "20", "--shutdown-timeout", "10")
    try:
        s.wait_ready()
        results: list[str] = []

        def one() -> None:
            try:
                r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 30}, timeout=30)
                results.append(r.json()["choices"][0]["finish_reason"])
            except httpx.HTTPError as e:
                results.append(type(e).__name__)

        ts = [threading.Thread(target=one) for _ in range(4)]
        for t in ts:
            t.start()
        time.sleep(0.3)
        s.proc.send_signal(signal.SIGTERM)
        for t in ts:
            t.join()
        assert s.proc.wait(30) == 0
        assert results == ["length"] * 4  # 30 tokens x 20 ms fit in the grace period
        assert s.wait_children_gone()
    finally:
        s.stop()


def test_scheduler_death_stops_server_without_orphans() -> None:
    s = ServerProc(*SIM)
    try:
        s.wait_ready()
        pids = s.child_pids()
        os.kill(pids["scheduler"], signal.SIGKILL)
        assert s.proc.wait(30) == 1
        assert s.wait_children_gone()
        log = s.log()
        assert f"scheduler process (pid {pids['scheduler']}) exited unexpectedly with signal SIGKILL" in log
    finally:
        s.stop()


def test_watchdog_kills_a_stuck_step() -> None:
    # A 3-second sim step against a 1-second watchdog: the scheduler logs the batch and exits.
    s = ServerProc(*SIM, "--sim-step-ms", "3000", "--watchdog-timeout", "1")
    try:
        s.wait_ready()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "stuck", "max_tokens": 3}, timeout=30)
        assert r.status_code == 500 and "exited unexpectedly" in r.json()["error"]["message"]
        assert s.proc.wait(30) == 1
        assert s.wait_children_gone()
        log = s.log()
        assert "watchdog" in log and "Running batch: 1 running: cmpl-" in log
    finally:
        s.stop()


def test_api_process_imports_no_torch(server) -> None:
    maps = open(f"/proc/{server.proc.pid}/maps").read()
    assert "libtorch" not in maps
    sched = open(f"/proc/{server.child_pids()['scheduler']}/maps").read()
    assert pid_alive(server.child_pids()["detokenizer"])
    assert "libtorch" not in sched  # the sim runner needs no torch either


def test_shared_prefix_reports_cached_tokens(server, client) -> None:
    system = "You are a helpful assistant. " * 8  # 232 bytes = 232 sim tokens
    first = client.completions.create(model="sim", prompt=system + "Question one?", max_tokens=3)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model="sim", prompt=system + "Question two?", max_tokens=3)
    shared = len(system + "Question ")
    assert second.usage.prompt_tokens_details.cached_tokens == shared
    chat = [client.chat.completions.create(model="sim", messages=[{"role": "system", "content": system},
                                                                  {"role": "user", "content": q}], max_tokens=2)
            for q in ("a?", "b?")]
    assert chat[1].usage.prompt_tokens_details.cached_tokens > len(system)
    text = httpx.get(server.url + "/metrics").text
    hits = next(ln for ln in text.splitlines() if ln.startswith("lockgate:prefix_cache_hits_total"))
    queries = next(ln for ln in text.splitlines() if ln.startswith("lockgate:prefix_cache_queries_total"))
    assert float(hits.split()[-1]) >= shared + len(system)
    assert float(queries.split()[-1]) > float(hits.split()[-1])


def test_group_sigterm_stops_everything_cleanly() -> None:
    """A TERM to the whole process group (what a supervisor or a terminal may send) is a clean stop."""
    s = ServerProc(*SIM)
    try:
        s.wait_ready()
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        os.killpg(s.proc.pid, signal.SIGTERM)  # start_new_session: the server leads its own group
        assert s.proc.wait(30) == 0
        assert s.wait_children_gone()
        assert "exited unexpectedly" not in s.log()
    finally:
        s.stop()


# ---- drop-in details (issue 23): TGI's root route and /info, OpenAI-format 404s, flags -------------
def test_tgi_root_route_answers_a_list_and_info_describes_the_server(server) -> None:
    r = httpx.post(server.url + "/", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}}, timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert isinstance(body, list) and len(body) == 1 and isinstance(body[0]["generated_text"], str)
    with httpx.stream("POST", server.url + "/", json={"inputs": "Hello", "stream": True,
                                                      "parameters": {"max_new_tokens": 2}}, timeout=30) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in s.iter_lines() if ln.startswith("data:")]
    assert json.loads(events[-1][5:])["details"]["generated_tokens"] == 2
    info = httpx.get(server.url + "/info").json()
    assert info["model_id"] == "sim" and info["max_total_tokens"] == 512 and info["max_input_tokens"] == 511
    assert info["version"] and info["model_dtype"]


def test_unknown_routes_and_methods_get_openai_errors(server) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and "/v1/embeddings" in err["message"]
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]


def test_cli_version_defaults_in_help_and_vllm_flag_names() -> None:
    import subprocess
    import sys

    from lockgate.cli import build_parser

    out = subprocess.run([sys.executable, "-m", "lockgate.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("lockgate ")
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    assert "(default: 8000)" in text and "--max-num-seqs" in text
    assert "--no-disable-prefix-cache" not in text and "--disable-prefix-cache" in text
    ns = build_parser().parse_args(["serve", "--max-num-seqs", "3", "--disable-prefix-cache"])
    assert ns.max_running_requests == 3 and ns.disable_prefix_cache is True


def test_tenants_keys_per_tenant_limit_metrics_and_loads(tmp_path) -> None:
    """A request's tenant is its key's name, else x-lockgate-tenant, else ``user``; one tenant over
    --max-queued-per-tenant gets 429 with Retry-After while another's requests still go through;
    per-tenant series on /metrics and counts on /v1/loads."""
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nbob=bobkey\n\nplainkey\n")
    s = ServerProc(*SIM, "--sim-step-ms", "40", "--max-running-requests", "1", "--max-queued-per-tenant", "2",
                   "--api-key", "alice=alicekey", "--api-key-file", str(keys), "--tenant-weight", "bob=2")
    try:
        s.wait_ready()
        alice = openai.OpenAI(base_url=s.url + "/v1", api_key="alicekey", max_retries=0)
        bob = openai.OpenAI(base_url=s.url + "/v1", api_key="bobkey", max_retries=0)
        plain = openai.OpenAI(base_url=s.url + "/v1", api_key="plainkey", max_retries=0)
        # the key's name wins over the header
        r = alice.completions.create(model="sim", prompt="x", max_tokens=2, extra_headers={"x-lockgate-tenant": "bob"})
        assert r.choices[0].finish_reason == "length"
        plain.completions.create(model="sim", prompt="x", max_tokens=2, user="carol")
        plain.chat.completions.create(model="sim", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                      extra_headers={"x-lockgate-tenant": "dave"}, user="ignored")
        with pytest.raises(openai.BadRequestError) as e:
            plain.completions.create(model="sim", prompt="x", max_tokens=2, user="u" * 300)
        assert e.value.param == "user" and "256" in str(e.value)
        # alice floods: over her limit she gets 429 (with Retry-After); bob is not affected
        codes: list[int] = []
        retry: list[str | None] = []

        def flood() -> None:
            # 40 tokens at 40 ms a step: the three accepted ones keep alice's queue full for ~5 s,
            # long enough for /v1/loads to be read under a loaded test host
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 40},
                           headers={"Authorization": "Bearer alicekey"}, timeout=30)
            codes.append(r.status_code)
            retry.append(r.headers.get("retry-after"))

        ts = [threading.Thread(target=flood) for _ in range(6)]
        for t in ts:
            t.start()
        def tenant_loads() -> dict:
            return httpx.get(s.url + "/v1/loads", headers={"Authorization": "Bearer bobkey"}).json()["tenants"]

        deadline = time.monotonic() + 10
        while tenant_loads().get("alice", {}).get("in_flight", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        ld = {"tenants": tenant_loads()}
        # in flight: the running one and those waiting; waiting without a first token: within the limit
        # (how many are still waiting when read depends on when the running one got its first token)
        assert 1 <= ld["tenants"]["alice"]["queued"] <= 2 and ld["tenants"]["alice"]["in_flight"] >= 2, ld
        r = bob.completions.create(model="sim", prompt="y", max_tokens=2)  # bob's own queue is empty
        assert r.choices[0].finish_reason == "length"
        for t in ts:
            t.join()
        assert codes.count(429) >= 1 and 200 in codes, codes
        assert all(h is not None and int(h) >= 1 for c_, h in zip(codes, retry, strict=True) if c_ == 429)
        text = httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer alicekey"}).text
        for tenant in ("alice", "bob", "carol", "dave"):
            assert f'lockgate:tenant_generation_tokens_total{{engine="0",model_name="sim",tenant="{tenant}"}}' in text, tenant
            assert f'lockgate:tenant_time_to_first_token_seconds_count{{engine="0",model_name="sim",tenant="{tenant}"}}' in text
        assert 'lockgate:tenant_requests_waiting{engine="0",model_name="sim",tenant="alice"} 0.0' in text
        assert 'tenant="ignored"' not in text
    finally:
        s.stop()
