"""The server on the default model (SmolLM2-135M-Instruct, in the dtype --dtype auto measures best here).

End-to-end checks that need real text: 32 concurrent streaming requests complete with
correct usage; streamed text equals the whole response and the tokenizer's own decoding of
the generated ids, including multi-byte UTF-8; a stop string spanning tokens is never
emitted; seeded sampling is reproducible through HTTP.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import openai
import pytest

UNICODE_PROMPT = "Translate to French: 'The summer was very hot and the café was closed.'\nFrench:"


@pytest.fixture(scope="module")
def server(smol_server):
    return smol_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_32_concurrent_streams_complete_with_correct_usage(server) -> None:
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)

    async def one(i: int) -> tuple[int, int, int, str]:
        prompt = f"Request {i}: write a few words about the number {i}."
        stream = await aclient.completions.create(model="default", prompt=prompt, max_tokens=16 + i % 17,
                                                  stream=True, stream_options={"include_usage": True},
                                                  temperature=0.7, seed=i, extra_body={"ignore_eos": True})
        text, usage = [], None
        async for ch in stream:
            if ch.choices:
                text.append(ch.choices[0].text)
            if ch.usage:
                usage = ch.usage
        assert usage is not None
        return i, usage.prompt_tokens, usage.completion_tokens, "".join(text)

    async def all_() -> list[tuple[int, int, int, str]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    results = asyncio.run(all_())
    assert len(results) == 32  # max_tokens 16 + i % 17: every one of the 17 lengths
    for i, p_tokens, c_tokens, text in results:
        want = httpx.post(server.url + "/tokenize", json={"prompt": f"Request {i}: write a few words about the "
                                                                    f"number {i}."}).json()["count"]
        assert p_tokens == want
        assert c_tokens == 16 + i % 17  # ignore_eos: exactly max_tokens each
        assert text
    ld = httpx.get(server.url + "/v1/loads").json()
    assert ld["running"] == 0 and ld["slots_used"] == 0


def test_streamed_text_is_exact_including_multibyte(server, client) -> None:
    body = {"inputs": UNICODE_PROMPT, "parameters": {"max_new_tokens": 40, "details": True}}
    tgi = httpx.post(server.url + "/generate", json=body, timeout=120).json()
    ids = [t["id"] for t in tgi["details"]["tokens"]]
    want = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert any(ord(ch) > 127 for ch in want), want  # the check is about multi-byte text
    whole = client.completions.create(model="default", prompt=UNICODE_PROMPT, max_tokens=40, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="default", prompt=UNICODE_PROMPT, max_tokens=40, temperature=0, stream=True) if c.choices)
    assert tgi["generated_text"] == whole.choices[0].text == streamed == want
    assert "\ufffd" not in streamed


def test_stop_string_across_tokens_never_emitted(server, client) -> None:
    base = client.completions.create(model="default", prompt=UNICODE_PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:11]  # six characters somewhere inside, very likely spanning a token boundary
    assert stop.strip()
    for stream in (False, True):
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="default", prompt=UNICODE_PROMPT, max_tokens=40, temperature=0, stop=[stop], stream=True,
                extra_body={"ignore_eos": True}) if c.choices)
        else:
            r = client.completions.create(model="default", prompt=UNICODE_PROMPT, max_tokens=40, temperature=0,
                                          stop=[stop], extra_body={"ignore_eos": True})
            text = r.choices[0].text
            assert r.choices[0].finish_reason == "stop"
        assert text == base[:base.index(stop)]


def test_chat_answer_and_seeded_sampling(client) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=30, temperature=0)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    # The same seeded request again (alone, its prompt now a cache hit): bitwise the same answer by
    # default (README, "Same request, same answer"). Not with n = 2: its two choices are two requests
    # running together, and whether they enter the same step depends on when each reaches the
    # scheduler; only --deterministic makes that irrelevant (tests/test_determinism.py).
    a = client.chat.completions.create(model="default", messages=msgs, max_tokens=20, temperature=1.0, seed=7)
    b = client.chat.completions.create(model="default", messages=msgs, max_tokens=20, temperature=1.0, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content
    two = client.chat.completions.create(model="default", messages=msgs, max_tokens=20, temperature=1.0, seed=7, n=2)
    assert [c.index for c in two.choices] == [0, 1] and all(c.message.content for c in two.choices)


def test_speculation_streams_accepted_guesses_and_counts_them(server, client) -> None:
    """A greedy request on repetitive text: n-gram guesses are accepted (several tokens reach
    the client in one chunk), the streamed tokens and logprobs are the non-streamed ones, and
    /metrics counts the guesses."""
    def spec_counts() -> tuple[float, float]:
        text = httpx.get(server.url + "/metrics").text
        vals = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                if ln.startswith("lockgate:spec_decode_")}
        return vals.get("lockgate:spec_decode_num_draft_tokens_total", 0.0), \
            vals.get("lockgate:spec_decode_num_accepted_tokens_total", 0.0)

    drafted0, accepted0 = spec_counts()
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    kw = {"model": "default", "prompt": prompt, "max_tokens": 48, "temperature": 0, "logprobs": 1,
          "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    lps = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    assert "".join(c.text for c in chunks) == whole.text
    # (The second request finds its prompt in the prefix cache and computes only its last token
    # afresh: a different order of additions, so logprobs agree to rounding, not bitwise: to
    # float32's or, where --dtype auto measured bf16 faster, to bf16's.)
    assert tokens == whole.logprobs.tokens and len(tokens) == 48
    tol = 1e-3 if "in torch.float32, loaded" in server.log() else 0.05
    assert lps == pytest.approx(whole.logprobs.token_logprobs, abs=tol)
    assert max(len(c.logprobs.tokens) for c in chunks if c.logprobs) > 1  # one step gave several tokens
    drafted, accepted = spec_counts()
    assert drafted > drafted0 and accepted > accepted0 and accepted - accepted0 <= drafted - drafted0


@pytest.mark.parametrize(("path", "raw", "needle"), [
    ("/v1/completions", '{"prompt": [1180591620717411303424], "max_tokens": 2}', "prompt[0]"),
    ("/v1/completions", '{"prompt": [49152], "max_tokens": 2}', "out of range"),  # the vocabulary's size
    ("/v1/completions", '{"prompt": "a \\ud800 b", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udbff"}]}', "messages[0].content"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_input_the_tokenizer_cannot_take_is_a_400(server, path, raw, needle) -> None:
    r = httpx.post(server.url + path, content=raw.encode(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and needle in r.text, r.text
    assert httpx.get(server.url + "/v1/loads").json()["queued_in_api"] == 0


def test_a_large_text_is_tokenized_off_the_event_loop(server) -> None:
    """A 2 MB prompt takes the real tokenizer seconds; /health must keep answering meanwhile."""
    text = "The quick brown fox jumps over the lazy dog. " * 45_000
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            t = time.perf_counter()
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            latencies.append(time.perf_counter() - t)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    t0 = time.perf_counter()
    try:
        r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=120)
    finally:
        busy = time.perf_counter() - t0
        done.set()
        poller.join()
    assert r.status_code == 200 and r.json()["count"] > 400_000
    # Inline, a /health sent during the work would wait for all of it; in a thread it waits for a GIL slice.
    assert len(latencies) >= 3 and max(latencies) < busy / 3, (max(latencies), busy)


def test_only_the_scheduler_process_loads_torch(server) -> None:
    """The API process and the detokenizer tokenize with the torch-free tokenizer (tests/test_tokenizer.py)."""
    pids = server.child_pids()
    assert "libtorch" not in open(f"/proc/{server.proc.pid}/maps").read()
    assert "libtorch" not in open(f"/proc/{pids['detokenizer']}/maps").read()
    assert "libtorch" in open(f"/proc/{pids['scheduler']}/maps").read()


def test_the_scheduler_process_runs_with_huge_page_malloc(server) -> None:
    """Only the scheduler (KV pool, weights) asks glibc for transparent huge pages; a user's own
    GLIBC_TUNABLES are kept, and one that sets glibc.malloc.hugetlb itself is left alone."""
    from lockgate.server.launch import HUGE_PAGES_TUNABLE, scheduler_env

    def environ(pid: int) -> list[str]:
        return open(f"/proc/{pid}/environ", "rb").read().decode().split("\0")

    def tunables(pid: int) -> str | None:
        return next((v.partition("=")[2] for v in environ(pid) if v.startswith("GLIBC_TUNABLES=")), None)

    pids = server.child_pids()
    ours = os.environ.get("GLIBC_TUNABLES")  # the server was started with this process's environment
    assert tunables(pids["scheduler"]) == scheduler_env(os.environ).get("GLIBC_TUNABLES", ours)
    assert "glibc.malloc.hugetlb" in (tunables(pids["scheduler"]) or "")
    assert tunables(pids["detokenizer"]) == ours
    assert scheduler_env({}) == {"GLIBC_TUNABLES": HUGE_PAGES_TUNABLE}
    assert scheduler_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGE_PAGES_TUNABLE}"}
    assert scheduler_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}


def test_tgi_stream_gives_each_token_its_own_text_and_top_tokens_under_speculation(server) -> None:
    """Several tokens can arrive in one step (accepted guesses); each TGI event must carry its own
    token's text (what an incremental decode of the ids so far adds), not the whole step's."""
    from lockgate.checkpoint.loader import prepare_model_dir
    from lockgate.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer("default", prepare_model_dir("default"))
    body = {"inputs": "The quick brown fox jumps over the lazy dog. " * 4,
            "parameters": {"max_new_tokens": 40, "top_n_tokens": 2, "details": True}}
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=120) as r:
        events = [json.loads(ln[5:]) for ln in r.iter_lines() if ln.startswith("data:")]
    ids = [e["token"]["id"] for e in events]
    texts = [e["token"]["text"] for e in events]
    assert "".join(texts) == events[-1]["generated_text"] == tok.decode(ids)
    for k in range(len(ids)):  # token k's text: what decoding ids[:k+1] adds to ids[:k] (ASCII text here)
        assert texts[k] == tok.decode(ids[:k + 1])[len(tok.decode(ids[:k])):], (k, ids[k], texts[k])
    assert all(len(e["top_tokens"]) == 2 and e["top_tokens"][0]["id"] == e["token"]["id"] for e in events)
    whole = httpx.post(server.url + "/generate", json=body, timeout=120).json()
    assert [t["id"] for t in whole["details"]["tokens"]] == ids
    assert len(whole["details"]["top_tokens"]) == len(ids)


def test_skip_server_warmup_reports_ready_without_the_warm_up_and_serves() -> None:
    from server_util import ServerProc

    s = ServerProc("--model", "default", "--kv-cache-memory", "64MiB")  # the tests' default: --skip-server-warmup
    try:
        s.wait_ready(300)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                        "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        log = s.log()
        assert "lockgate ready: " in log and "allocating the KV pool" in log and "warming up" not in log, log[-3000:]
    finally:
        s.stop()


def test_a_log_file_gets_each_start_phase_as_lines_and_the_ready_line_last(server) -> None:
    """Not a terminal (the log is a file): every start-up phase is a start line and a ``done in``
    line, no bar is drawn (no carriage return), and ``lockgate ready:`` follows the warm-up."""
    import re

    log = server.log()
    assert "\r" not in log
    for what in (r"allocating the KV pool \(\d+ MiB", r"warming up \(\d+-token prefill", r"loading the weights"):
        assert re.search(what + r".* \.\.\.\n", log), what
        assert re.search(what + r".*: done in \d+\.\ds\n", log), what
    ready = log.find(f"lockgate ready: {server.url} (model default, ")
    assert ready > log.find("warming up (") > 0, log[-3000:]
