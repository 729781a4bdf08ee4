"""``lockgate bench``: statistics, workload generators, arrival process, SSE parsing, report, and
end-to-end runs against a real ``--model sim`` server (byte-level tokenizer: 1 byte = 1 token)."""

from __future__ import annotations

import json
import math
import sys

import aiohttp
import numpy as np
import pytest
from server_util import ServerProc

from lockgate.bench import report, stats
from lockgate.bench.client import (
    LoadConfig,
    RequestRecord,
    StreamReader,
    _client,
    _error_text,
    arrival_offsets,
    request_body,
    send,
)
from lockgate.bench.tokens import LocalTokenizer
from lockgate.bench.workloads import (
    MIXED_SHORT,
    SHAREGPT_MEAN_INPUT,
    SHAREGPT_MEAN_OUTPUT,
    TextMaker,
    WorkloadSpec,
    build_workload,
    sharegpt_lengths,
)
from lockgate.cli import main
from lockgate.tokenizer.tokenizer import SimTokenizer


@pytest.fixture(scope="module")
def sim_tok() -> LocalTokenizer:
    return LocalTokenizer(SimTokenizer(), "sim")


def texts(wl) -> list[str]:
    return [t.text for s in wl.sessions for t in s.turns]


# ---- statistics -------------------------------------------------------------------------------
def _linear_percentile(sorted_v: list[float], p: float) -> float:
    """The textbook linear-interpolation percentile: rank (n-1)p/100 between neighbours."""
    rank = (len(sorted_v) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_v) - 1)
    return sorted_v[lo] + (rank - lo) * (sorted_v[hi] - sorted_v[lo])


def test_summarize_ms_matches_the_percentile_formula_and_numpy() -> None:
    rng = np.random.default_rng(7)
    values = list(rng.exponential(0.05, size=37))  # seconds
    out = stats.summarize_ms([*values, None], "ttft")  # None entries are ignored
    ms = sorted(v * 1000 for v in values)
    assert out["ttft_mean_ms"] == pytest.approx(sum(ms) / len(ms), abs=0.006)
    for p in (50, 90, 99):
        assert out[f"ttft_p{p}_ms"] == pytest.approx(_linear_percentile(ms, p), abs=0.006)
        assert out[f"ttft_p{p}_ms"] == pytest.approx(float(np.percentile(ms, p)), abs=0.006)
    assert stats.summarize_ms([], "x") == {"x_mean_ms": None, "x_p50_ms": None, "x_p90_ms": None, "x_p99_ms": None}


def test_goodput_and_tpot() -> None:
    ttft = [0.010, 0.050, 0.200, 0.030, 0.040]
    tpot = [0.005, 0.020, 0.005, None, 0.009]
    duration = 2.0
    # by hand: TTFT <= 100 ms drops #2; TPOT <= 10 ms drops #1; None meets the TPOT SLO
    assert stats.goodput(ttft, tpot, duration, 100.0, None) == 4 / duration
    assert stats.goodput(ttft, tpot, duration, None, 10.0) == 4 / duration
    assert stats.goodput(ttft, tpot, duration, 100.0, 10.0) == 3 / duration
    assert stats.goodput(ttft, tpot, duration, None, None) == len(ttft) / duration
    assert stats.goodput(ttft, tpot, 0.0, 100.0, None) == 0.0
    assert stats.meets_slo(0.1, None, 100.0, 1.0) and not stats.meets_slo(0.1001, None, 100.0, None)
    e2e, first, n = 1.3, 0.1, 13
    assert stats.tpot(e2e, first, n) == pytest.approx((e2e - first) / (n - 1))
    assert stats.tpot(e2e, first, 1) is None


# ---- workloads -----------------------------------------------------------------------------------
def test_random_fixed_and_ranged_lengths_are_exact(sim_tok) -> None:
    wl = build_workload(WorkloadSpec("random", 20, input_len=50, output_len=7), sim_tok, seed=3)
    assert wl.num_requests == 20 and len(wl.sessions) == 20
    for s in wl.sessions:
        (t,) = s.turns
        assert (t.input_len, t.output_len) == (50, 7) and len(sim_tok.encode(t.text)) == 50
    ranged = build_workload(WorkloadSpec("random", 40, input_len=100, output_len=20, range_ratio=0.5), sim_tok, 3)
    ins = [s.turns[0].input_len for s in ranged.sessions]
    outs = [s.turns[0].output_len for s in ranged.sessions]
    assert all(50 <= i <= 150 for i in ins) and all(10 <= o <= 30 for o in outs)
    assert len(set(ins)) > 5 and len(set(outs)) > 5
    assert all(len(sim_tok.encode(s.turns[0].text)) == s.turns[0].input_len for s in ranged.sessions)


def test_same_seed_same_workload_other_seed_differs(sim_tok) -> None:
    for name in ("random", "sharegpt-like", "mixed", "shared-prefix", "multi-turn"):
        spec = WorkloadSpec(name, 8, input_len=30, output_len=10, range_ratio=0.3, prefix_len=40, suffix_len=10,
                            turns=2, max_model_len=4096)
        a, b, c = (build_workload(spec, sim_tok, seed) for seed in (5, 5, 6))
        assert a == b, name
        assert texts(a) != texts(c), name


def test_sharegpt_like_lengths_follow_the_published_means_and_fit_the_context(sim_tok) -> None:
    pairs = np.array(sharegpt_lengths(np.random.default_rng(0), 20000, ctx=1 << 20))
    assert pairs[:, 0].mean() == pytest.approx(SHAREGPT_MEAN_INPUT, rel=0.05)
    assert pairs[:, 1].mean() == pytest.approx(SHAREGPT_MEAN_OUTPUT, rel=0.05)
    assert np.median(pairs[:, 0]) < pairs[:, 0].mean()  # long right tail
    wl = build_workload(WorkloadSpec("sharegpt-like", 30, max_model_len=512), sim_tok, seed=1)
    for s in wl.sessions:
        t = s.turns[0]
        assert t.input_len + t.output_len <= 512 and t.input_len >= 4 and t.output_len >= 4
        assert len(sim_tok.encode(t.text)) == t.input_len


def test_mixed_is_half_short_half_long_shuffled(sim_tok) -> None:
    wl = build_workload(WorkloadSpec("mixed", 21, input_len=20, output_len=300), sim_tok, seed=2)
    outs = [s.turns[0].output_len for s in wl.sessions]
    assert outs.count(MIXED_SHORT) == 10 and outs.count(300) == 11
    assert outs != sorted(outs)  # interleaved, not all short first
    assert all(len(sim_tok.encode(t)) == 20 for t in texts(wl))


def test_shared_prefix_groups_share_exactly_the_prefix(sim_tok) -> None:
    g, m, p, u = 3, 4, 60, 15
    wl = build_workload(WorkloadSpec("shared-prefix", g * m, output_len=5, groups=g, prompts_per_group=m,
                                     prefix_len=p, suffix_len=u), sim_tok, seed=4)
    assert len(wl.prefixes) == g and len(set(wl.prefixes)) == g
    assert sorted(s.group for s in wl.sessions) == sorted(list(range(g)) * m)
    assert [s.group for s in wl.sessions] != sorted(s.group for s in wl.sessions)  # groups interleaved
    for pre in wl.prefixes:
        assert len(sim_tok.encode(pre)) == p
    suffixes = []
    for s in wl.sessions:
        (t,) = s.turns
        assert t.text.startswith(wl.prefixes[s.group]) and len(sim_tok.encode(t.text)) == p + u == t.input_len
        suffixes.append(t.text[len(wl.prefixes[s.group]):])
    assert len(set(suffixes)) == g * m
    # --num-requests alone: prompts-per-group = num_requests // groups
    assert build_workload(WorkloadSpec("shared-prefix", 9, groups=2, prefix_len=8, suffix_len=4, output_len=2),
                          sim_tok, 0).num_requests == 8


def test_multi_turn_conversations_and_growth(sim_tok) -> None:
    wl = build_workload(WorkloadSpec("multi-turn", 10, input_len=25, output_len=6, turns=4), sim_tok, seed=8)
    assert [len(s.turns) for s in wl.sessions] == [4, 4, 2] and wl.num_requests == 10
    assert all(len(sim_tok.encode(t)) == 25 for t in texts(wl))
    # each turn's body carries the whole conversation so far: it extends the previous prompt
    cfg = LoadConfig(url="x", model="sim")
    history: list[str] = []
    prompts = []
    for k, turn in enumerate(wl.sessions[0].turns):
        history.append(turn.text)
        prompts.append(request_body(cfg, history, turn.output_len)["prompt"])
        history.append(f"<reply {k}>")
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(prompts, prompts[1:], strict=False))
    chat = request_body(LoadConfig(url="x", endpoint="chat"), ["q1", "a1", "q2"], 9)
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "user"] and "prompt" not in chat
    assert chat["max_tokens"] == chat["min_tokens"] == 9 and chat["ignore_eos"] is True
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


def test_workload_refuses_what_cannot_fit_and_bad_knobs(sim_tok) -> None:
    with pytest.raises(ValueError, match="context of 100"):
        build_workload(WorkloadSpec("random", 2, input_len=90, output_len=20, max_model_len=100), sim_tok, 0)
    with pytest.raises(ValueError, match="multi-turn"):
        build_workload(WorkloadSpec("multi-turn", 2, input_len=30, output_len=30, turns=4, max_model_len=200),
                       sim_tok, 0)
    with pytest.raises(ValueError, match="range-ratio"):
        build_workload(WorkloadSpec("random", 2, range_ratio=1.0), sim_tok, 0)
    with pytest.raises(ValueError, match="input-len"):
        build_workload(WorkloadSpec("random", 2, input_len=0), sim_tok, 0)


def test_exact_lengths_with_a_real_bpe_tokenizer() -> None:
    from lockgate.checkpoint.loader import prepare_model_dir
    from lockgate.tokenizer.tokenizer import HFTokenizer

    # the default model's tokenizer (converted once from the GGUF and cached; a few seconds the first time)
    tok = LocalTokenizer(HFTokenizer(prepare_model_dir("default")), "default")
    maker = TextMaker(tok, seed=0)
    for n in (1, 2, 7, 33, 128):
        assert len(tok.encode(maker.text(n))) == n
    head = maker.text(40)
    tail = maker.text(9, head=head)
    assert len(tok.encode(head + tail)) == 49


# ---- arrival process -----------------------------------------------------------------------------
@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_have_the_requested_rate_and_burstiness(burstiness: float) -> None:
    rate, n = 8.0, 40001
    t = arrival_offsets(n, rate, burstiness, seed=0)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # gamma(shape k): coefficient of variation 1/sqrt(k) (Poisson: 1)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert np.array_equal(t, arrival_offsets(n, rate, burstiness, seed=0))
    assert not np.array_equal(t, arrival_offsets(n, rate, burstiness, seed=1))


def test_arrivals_all_at_once_for_infinite_rate() -> None:
    assert np.array_equal(arrival_offsets(5, float("inf"), 1.0, 0), np.zeros(5))
    with pytest.raises(ValueError):
        arrival_offsets(5, 0.0, 1.0, 0)


# ---- SSE parsing against canned streams ----------------------------------------------------------
def _sse(*events: object) -> bytes:
    return "".join(f"data: {json.dumps(e, ensure_ascii=False) if not isinstance(e, str) else e}\n\n"
                   for e in events).encode()


def _record(events: bytes, endpoint: str = "completions", cut: int | None = None) -> RequestRecord:
    """The record StreamReader makes of a canned stream, its bytes arriving in pieces of ``cut``
    (None: all at once) 1 ms apart."""
    rec = RequestRecord(0, 0, 0, -1, 5, 4)
    reader = StreamReader(rec, endpoint == "chat", 0.0)
    pieces = [events] if cut is None else [events[i:i + cut] for i in range(0, len(events), cut)]
    for k, piece in enumerate(pieces):
        reader.feed(piece, 0.001 * (k + 1))
        if reader.done:
            break
    reader.finish(1.0)
    return rec


@pytest.mark.parametrize("cut", [None, 1, 7, 64])
def test_stream_reader_prefers_usage_and_falls_back_to_chunks(cut: int | None) -> None:
    # multi-byte characters: a piece may end inside one (cut = 1, 7)
    chunks = [{"choices": [{"index": 0, "text": w, "finish_reason": None}]} for w in ("é", "b🙂", "", "d")]
    usage = {"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 5,
                                      "prompt_tokens_details": {"cached_tokens": 2}}}
    events = _sse(*chunks, usage, "[DONE]")
    rec = _record(events, cut=cut)
    assert rec.success and rec.text == "éb🙂d" and len(rec.itl) == 2  # three chunks carried text
    assert (rec.output_tokens, rec.tokens_from, rec.prompt_tokens, rec.cached_tokens) == (5, "usage", 6, 2)
    assert rec.latency == 1.0
    if cut is None:  # every line arrived with the one read at 1 ms
        assert rec.ttft == 0.001 and rec.itl == [0.0, 0.0]
    else:  # a chunk is timed by the piece that ends its line
        ends = [i for i, b in enumerate(events) if b == ord("\n")][0::2]  # where each data line ends
        firsts = [ends[k] // cut + 1 for k in (0, 1, 3)]  # pieces completing the text events
        assert rec.ttft == pytest.approx(0.001 * firsts[0])
        assert rec.itl == pytest.approx([0.001 * (firsts[1] - firsts[0]), 0.001 * (firsts[2] - firsts[1])])
    rec = _record(_sse(*chunks, "[DONE]"), cut=cut)
    assert rec.success and (rec.output_tokens, rec.tokens_from) == (3, "chunks")
    chat = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "hi"}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}]
    rec = _record(_sse(*chat, "[DONE]"), endpoint="chat", cut=cut)
    assert rec.success and rec.text == "hi" and rec.finish_reason == "length" and rec.output_tokens == 1


def test_stream_reader_times_a_chunk_by_the_bytes_that_complete_it() -> None:
    rec = RequestRecord(0, 0, 0, -1, 5, 4)
    reader = StreamReader(rec, False, 0.0)
    first, second = _sse({"choices": [{"text": "a"}]}), _sse({"choices": [{"text": "b"}]})
    reader.feed(first[:10], 0.1)  # half a line: nothing yet
    assert rec.ttft is None
    reader.feed(first[10:] + second[:5], 0.2)
    reader.feed(second[5:], 0.5)
    reader.finish(0.6)
    assert rec.success and rec.ttft == 0.2 and rec.itl == [pytest.approx(0.3)] and rec.text == "ab"


def test_stream_reader_stops_at_done() -> None:
    rec = _record(_sse({"choices": [{"text": "a"}]}, "[DONE]", {"choices": [{"text": "b"}]}))  # one read
    assert rec.success and rec.text == "a" and rec.itl == []


def test_error_text_and_stream_errors() -> None:
    body = json.dumps({"error": {"message": "max_tokens is too large", "code": 400}})
    assert _error_text(400, body) == "HTTP 400: max_tokens is too large"
    assert _error_text(502, "", "Bad Gateway") == "HTTP 502: Bad Gateway"
    rec = _record(_sse({"choices": [{"text": "a"}]}, {"error": {"message": "engine died"}}))
    assert not rec.success and "engine died" in rec.error
    rec = _record(_sse("[DONE]"))
    assert not rec.success and "without any generated text" in rec.error


def test_summary_counts_short_outputs_and_failures() -> None:
    def rec(i: int, out: int, asked: int, ok: bool = True) -> RequestRecord:
        r = RequestRecord(i, i, 0, -1, 10, asked, start=0.1 * i, ttft=0.02, latency=0.02 + 0.01 * (out - 1),
                          itl=[0.01] * (out - 1), output_tokens=out, tokens_from="usage", success=ok)
        if not ok:
            r.error = "HTTP 500: boom"
        return r

    recs = [rec(0, 8, 8), rec(1, 5, 8), rec(2, 8, 8), rec(3, 0, 8, ok=False)]
    s = report.summarize(recs, duration=2.0, slo_ttft_ms=50.0)
    assert (s["completed"], s["failed"], s["first_error"]) == (3, 1, "HTTP 500: boom")
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 21
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 10.5 and s["total_token_throughput"] == 25.5
    assert s["goodput"] == 1.5 and s["short_outputs"] == 1
    assert s["tpot_mean_ms"] == pytest.approx(10.0) and s["ttft_p99_ms"] == pytest.approx(20.0)
    w = report.warnings_for(s)
    assert any("did not honour ignore_eos/min_tokens for 1 requests" in x for x in w)
    assert any("1 of 4 requests failed; first error: HTTP 500: boom" in x for x in w)


# ---- command line ----------------------------------------------------------------------------------
def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["bench", "--url", "http://127.0.0.1:9", "--plot", "--out", str(tmp_path / "r.json")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_bad_flags_exit_2_before_contacting_the_server(capsys) -> None:
    base = ["bench", "--url", "http://127.0.0.1:9"]
    assert main([*base, "--request-rate", "0"]) == 2
    assert main([*base, "--plot"]) == 2
    assert main([*base, "--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "3",
                 "--num-requests", "5"]) == 2
    err = capsys.readouterr().err
    assert "--request-rate" in err and "--out" in err and "= 6 requests" in err
    assert main([*base, "--timeout", "-1"]) == 2 and main([*base, "--warmup-requests", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--timeout must be positive" in err and "got -1" in err and "--warmup-requests must be >= 0, got -1" in err
    # the workload's knobs too (port 9 is closed: reaching it would say "cannot reach")
    assert main([*base, "--num-requests", "0"]) == 2 and main([*base, "--input-len", "0"]) == 2
    assert main([*base, "--workload", "random", "--range-ratio", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "--num-requests must be at least 1, got 0" in err and "--input-len must be at least 1, got 0" in err
    assert "--range-ratio must be in [0, 1), got 1.5" in err and "cannot reach" not in err
    assert main([*base, "--num-requests", "1"]) == 1  # nothing listens there
    assert "cannot reach" in capsys.readouterr().err


# ---- end to end against a sim server ---------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    s = ServerProc("--model", "sim", "--max-model-len", "512", "--sim-step-ms", "2", "--max-total-tokens", "8192",
                   "--log-level", "WARNING")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_send_over_http_records_the_servers_refusal_and_a_dead_port(server) -> None:
    import asyncio

    async def go(url: str, max_tokens: int) -> RequestRecord:
        cfg = LoadConfig(url=url, timeout=30.0)
        rec = RequestRecord(0, 0, 0, -1, 4, max_tokens)
        async with aiohttp.ClientSession() as http:
            await send(http, cfg, request_body(cfg, ["hello"], max_tokens), rec, 0.0)
        return rec

    ok = asyncio.run(go(server.url, 4))
    assert ok.success and ok.output_tokens == 4 and ok.tokens_from == "usage" and ok.latency >= ok.ttft > 0
    refused = asyncio.run(go(server.url, 10_000))  # beyond --max-model-len 512
    assert not refused.success and refused.error.startswith("HTTP 400: ") and "512" in refused.error
    dead = asyncio.run(go("http://127.0.0.1:9", 4))  # nothing listens there
    assert not dead.success and dead.error.startswith("ClientConnectorError")


def test_client_timeout_bounds_each_wait_not_the_stream() -> None:
    """``LoadConfig.timeout`` is the longest wait for the next bytes (as httpx's read timeout was):
    a stream of 8 tokens 0.3 s apart passes a 1 s timeout although it lasts longer, and fails a
    0.1 s one."""
    import asyncio

    slow = ServerProc("--model", "sim", "--max-model-len", "128", "--sim-step-ms", "300", "--log-level", "WARNING")
    try:
        slow.wait_ready()

        async def go(timeout: float) -> RequestRecord:
            cfg = LoadConfig(url=slow.url, timeout=timeout)
            rec = RequestRecord(0, 0, 0, -1, 4, 8)
            async with _client(cfg) as http:
                await send(http, cfg, request_body(cfg, ["hello"], 8), rec, 0.0)
            return rec

        ok = asyncio.run(go(1.0))
        assert ok.success and ok.output_tokens == 8 and ok.latency > 1.0
        late = asyncio.run(go(0.1))
        assert not late.success and "Timeout" in late.error
    finally:
        slow.stop()


SUMMARY_KEYS = {"duration_s", "num_requests", "completed", "failed", "first_error", "total_input_tokens",
                "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
                "goodput", "short_outputs", "max_in_flight",
                *(f"{m}_{p}_ms" for m in ("ttft", "tpot", "itl", "e2e") for p in ("mean", "p50", "p90", "p99"))}


def test_end_to_end_random_then_multi_turn_chat_then_compare(server, tmp_path, capsys) -> None:
    a, b = tmp_path / "random.json", tmp_path / "chat.json"
    assert main(["bench", "--url", server.url, "--workload", "random", "--num-requests", "12", "--max-concurrency",
                 "4", "--input-len", "32", "--output-len", "16", "--seed", "1", "--out", str(a),
                 "--slo-ttft-ms", "5000", "--slo-tpot-ms", "1000", "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "Successful requests:" in table and "TTFT" in table and "Goodput" in table
    res = json.loads(a.read_text())
    s = res["summary"]
    assert SUMMARY_KEYS <= set(s)
    assert (s["completed"], s["failed"], s["short_outputs"]) == (12, 0, 0)
    assert s["total_output_tokens"] == 12 * 16 and s["total_input_tokens"] == 12 * 32
    assert s["server_prompt_tokens"] == 12 * 32  # byte-level: the client's count is the server's
    assert 1 <= s["max_in_flight"] <= 4 and s["goodput"] == s["request_throughput"] > 0
    assert all(s[f"{m}_p50_ms"] > 0 for m in ("ttft", "tpot", "itl", "e2e"))
    assert res["command"].startswith("lockgate bench --url") and res["machine"]["cpu_count"] >= 1
    assert res["started_at"] <= res["finished_at"] and res["warnings"] == []
    assert res["config"]["max_concurrency"] == 4 and res["config"]["model"] == "sim"
    reqs = res["requests"]
    assert len(reqs) == 12 and all(r["success"] and r["tokens_from"] == "usage" for r in reqs)
    # one gap per text chunk after the first; a chunk may carry several tokens when the server batches them
    assert all(r["output_tokens"] == 16 and 1 <= len(r["itl_s"]) <= 15 and r["finish_reason"] == "length"
               for r in reqs)
    assert all(r["prompt_tokens"] == 32 for r in reqs)

    assert main(["bench", "--url", server.url, "--endpoint", "chat", "--workload", "multi-turn", "--num-requests",
                 "6", "--turns", "3", "--input-len", "20", "--output-len", "8", "--request-rate", "50",
                 "--out", str(b), "--no-progress"]) == 0
    res2 = json.loads(b.read_text())
    assert (res2["summary"]["completed"], res2["summary"]["failed"]) == (6, 0)
    for conv in (0, 1):
        turns = sorted((r for r in res2["requests"] if r["session"] == conv), key=lambda r: r["turn"])
        assert len(turns) == 3
        prompt = [r["prompt_tokens"] for r in turns]
        assert prompt[0] < prompt[1] < prompt[2]  # each turn extends the conversation
        assert prompt[1] - prompt[0] >= 20 + 8 and turns[2]["cached_tokens"] > 0
    capsys.readouterr()

    assert main(["bench", "compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "random" in out and "chat" in out and "multi-turn" in out and "x)" in out
    assert "ratios are each run's value / random's" in out

    if report.have_matplotlib():
        for path in report.plot(res, a):
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
