"""The load generator: sends a workload to an OpenAI-compatible server and times every chunk.

Owns the HTTP side of ``lockgate bench``: one ``aiohttp.ClientSession``, streaming requests
(``stream: true``, ``stream_options.include_usage``) to ``/v1/completions`` or
``/v1/chat/completions``, and one ``RequestRecord`` per request with the timestamp of every
chunk that carried text (``StreamReader``: the parsing, apart from the transport). Not the openai
package: its iterator hides when bytes arrived. Not httpx either: the client shares the machine
with the server it measures, and at c = 128 (16k streamed chunks) httpx's async streaming took
0.77 s of CPU against aiohttp's 0.25 s, time taken from the server's cores (the server's run was
~3% longer on the Zen 5 class CPU).

Timing (``time.perf_counter``, seconds since the first dispatch):

* TTFT: request sent -> first chunk with text; ITL: the gaps between later text chunks (per
  chunk, as vLLM reports it: a chunk carrying two tokens is one gap); E2E: sent -> stream end.
  TPOT = (E2E - TTFT) / (output tokens - 1) (``stats.tpot``).
* Output tokens: the server's ``usage.completion_tokens`` when it reports it, else the number
  of text chunks (``tokens_from`` says which).

Load shape: sessions (one per request, one per conversation for multi-turn) start at the
times of ``arrival_offsets``: a gamma process with shape = burstiness and mean gap 1/rate
(burstiness 1 = Poisson, < 1 burstier, > 1 more regular; vLLM's definition), all at t = 0
for rate = inf. ``--max-concurrency`` caps requests in flight with a semaphore. The turns of
a conversation go one after another; each carries the whole conversation so far, the
server's replies included. Every request asks for exactly ``output_len`` tokens:
``max_tokens`` = ``min_tokens`` = output_len and ``ignore_eos`` (fields some servers ignore;
the report counts the requests that came back shorter).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from lockgate.bench.stats import tpot
from lockgate.bench.workloads import Session, Workload


@dataclass
class LoadConfig:
    url: str
    endpoint: str = "completions"  # or "chat"
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout: float = 600.0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


@dataclass
class RequestRecord:
    index: int
    session: int
    turn: int
    group: int
    input_len: int            # prompt tokens as the client built them (no template, no special tokens)
    output_len: int           # tokens asked for
    start: float = 0.0        # seconds since the first dispatch
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    tokens_from: str = "chunks"
    prompt_tokens: int | None = None  # the server's count (usage), template and special tokens included
    cached_tokens: int | None = None
    finish_reason: str | None = None
    success: bool = False
    error: str = ""
    text: str = ""            # the generated text (kept for multi-turn history; not in the JSON)

    @property
    def tpot(self) -> float | None:
        if not self.success or self.latency is None or self.ttft is None:
            return None
        return tpot(self.latency, self.ttft, self.output_tokens)

    def chunk_times(self) -> list[float]:
        """Arrival times (since the first dispatch) of the text chunks."""
        if self.ttft is None:
            return []
        return [float(t) for t in self.start + self.ttft + np.concatenate([[0.0], np.cumsum(self.itl)])]

    def to_json(self) -> dict[str, Any]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {"index": self.index, "session": self.session, "turn": self.turn, "group": self.group,
                "input_len": self.input_len, "output_len": self.output_len, "success": self.success,
                "error": self.error or None, "start_s": r(self.start), "ttft_s": r(self.ttft),
                "tpot_s": r(self.tpot), "e2e_s": r(self.latency), "output_tokens": self.output_tokens,
                "tokens_from": self.tokens_from, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "finish_reason": self.finish_reason,
                "itl_s": [round(x, 6) for x in self.itl]}


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Start times (s) of n sessions: 0, then gamma(shape=burstiness, mean=1/rate) gaps; all 0 for inf."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be positive, got {rate} and {burstiness}")
    if n <= 0 or np.isinf(rate):
        return np.zeros(max(n, 0))
    gaps = np.random.default_rng([seed, 2]).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def request_body(cfg: LoadConfig, history: list[Any], output_len: int) -> dict[str, Any]:
    """The JSON body for one turn; ``history`` is the prompt pieces so far (user, reply, user, ...)."""
    body: dict[str, Any] = {"max_tokens": output_len, "temperature": cfg.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.model is not None:
        body["model"] = cfg.model
    if cfg.ignore_eos:
        body.update(ignore_eos=True, min_tokens=output_len)
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user" if k % 2 == 0 else "assistant", "content": piece}
                            for k, piece in enumerate(history)]
    else:
        body["prompt"] = "".join(history)
    return body


def _error_text(status: int, body: str, reason: str | None = None) -> str:
    """``HTTP <status>: <message>`` from an error response (an OpenAI error body's message, else the text)."""
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    return f"HTTP {status}: {msg or body[:300] or reason or ''}"


class StreamReader:
    """One response's server-sent events into its ``RequestRecord``, fed bytes as they arrive.

    ``feed(data, now)`` splits the bytes into lines (a line may arrive in pieces) and reads every
    complete ``data:`` line at ``now`` (the arrival of the bytes that completed it); ``done`` turns
    true at ``data: [DONE]`` or a stream error; ``finish()`` settles the record. Separate from the
    HTTP client so that the parsing is tested on canned streams cut anywhere."""

    def __init__(self, rec: RequestRecord, chat: bool, start: float) -> None:
        self.rec, self.chat, self.start, self.last = rec, chat, start, start
        self.parts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.done = False
        self._buf = b""

    def feed(self, data: bytes, now: float) -> None:
        buf, at = self._buf + data, 0
        while not self.done and (nl := buf.find(b"\n", at)) >= 0:
            self._line(buf[at:nl].decode(errors="replace"), now)  # a line is whole: no character cut in two
            at = nl + 1
        self._buf = buf[at:]

    def _line(self, line: str, now: float) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        obj = json.loads(data)
        rec = self.rec
        if obj.get("error"):
            err = obj["error"]
            rec.error = "stream error: " + str(err.get("message") if isinstance(err, dict) else err)
            self.done = True
            return
        self.usage = obj.get("usage") or self.usage
        for ch in obj.get("choices") or []:
            if self.chat:
                delta = ch.get("delta") or {}
                text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            else:
                text = ch.get("text") or ""
            if text:
                if rec.ttft is None:
                    rec.ttft = now - self.start
                else:
                    rec.itl.append(now - self.last)
                self.last = now
                self.parts.append(text)
            rec.finish_reason = ch.get("finish_reason") or rec.finish_reason

    def finish(self, end: float) -> None:
        """The stream is over (``end``: when): latency, text, token counts, success."""
        rec = self.rec
        if rec.error:
            return
        rec.latency = end - self.start
        rec.text = "".join(self.parts)
        usage = self.usage
        if usage is not None and usage.get("completion_tokens") is not None:
            rec.output_tokens, rec.tokens_from = int(usage["completion_tokens"]), "usage"
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        else:
            rec.output_tokens = len(rec.itl) + (rec.ttft is not None)
        if rec.ttft is None:
            rec.error = "the stream ended without any generated text"
            return
        rec.success = True


async def send(http: aiohttp.ClientSession, cfg: LoadConfig, body: dict[str, Any], rec: RequestRecord,
               t0: float) -> None:
    """One streaming request; fills ``rec`` (success, timings, counts, or the error)."""
    st = time.perf_counter()
    rec.start = st - t0
    reader = StreamReader(rec, cfg.endpoint == "chat", st)
    try:
        async with http.post(cfg.url.rstrip("/") + cfg.path, json=body, allow_redirects=False) as r:
            if r.status != 200:
                rec.error = _error_text(r.status, await r.text(errors="replace"), r.reason)
                return
            async for data in r.content.iter_any():
                reader.feed(data, time.perf_counter())
                if reader.done:
                    break
            reader.finish(time.perf_counter())
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # ValueError: bad JSON
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration: float       # first dispatch -> last request done
    started_at: float     # wall clock (time.time()) of the first dispatch
    max_in_flight: int


def make_records(workload: Workload) -> list[RequestRecord]:
    recs: list[RequestRecord] = []
    for s, sess in enumerate(workload.sessions):
        for t, turn in enumerate(sess.turns):
            recs.append(RequestRecord(len(recs), s, t, sess.group, turn.input_len, turn.output_len))
    return recs


def _client(cfg: LoadConfig) -> aiohttp.ClientSession:
    """One session for the run: at most ``max_concurrency`` connections (0: no cap), kept alive;
    ``timeout`` bounds each wait for bytes, not the whole stream; redirects are not followed (a
    30x is the request's error, as before)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=cfg.max_concurrency or 0),
                                 headers=cfg.headers, trust_env=True,  # HTTP(S)_PROXY / NO_PROXY, as httpx
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=cfg.timeout))


async def warmup(cfg: LoadConfig, text: str, n: int) -> list[RequestRecord]:
    """n short requests before the clock starts (connections, first-call costs); their records."""
    recs = []
    async with _client(cfg) as http:
        for _ in range(n):
            rec = RequestRecord(-1, -1, 0, -1, 0, 4)
            await send(http, cfg, request_body(cfg, [text], 4), rec, time.perf_counter())
            recs.append(rec)
    return recs


async def run_load(cfg: LoadConfig, workload: Workload,
                   on_done: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """Send the whole workload; returns every request's record (failed ones included)."""
    recs = make_records(workload)
    by_session: dict[int, list[RequestRecord]] = {}
    for rec in recs:
        by_session.setdefault(rec.session, []).append(rec)
    offsets = arrival_offsets(len(workload.sessions), cfg.request_rate, cfg.burstiness, cfg.seed)
    sem = asyncio.Semaphore(cfg.max_concurrency or len(recs))
    in_flight = max_in_flight = 0

    async def one_session(i: int, sess: Session, http: aiohttp.ClientSession, t0: float) -> None:
        nonlocal in_flight, max_in_flight
        await asyncio.sleep(max(0.0, t0 + float(offsets[i]) - time.perf_counter()))
        history: list[str] = []
        for turn, rec in zip(sess.turns, by_session[i], strict=True):
            if history and len(history) % 2 == 1:  # the previous turn failed: no reply to build on
                rec.error = "not sent: an earlier turn of this conversation failed"
            else:
                history.append(turn.text)
                if rec.turn:  # the conversation so far is part of this prompt
                    prev = by_session[i][rec.turn - 1]
                    rec.input_len = prev.input_len + prev.output_tokens + turn.input_len
                async with sem:
                    in_flight += 1
                    max_in_flight = max(max_in_flight, in_flight)
                    try:
                        await send(http, cfg, request_body(cfg, history, turn.output_len), rec, t0)
                    finally:
                        in_flight -= 1
                if rec.success:
                    history.append(rec.text)
            if on_done is not None:
                on_done(rec)

    async with _client(cfg) as http:
        started_at, t0 = time.time(), time.perf_counter()
        await asyncio.gather(*(one_session(i, s, http, t0) for i, s in enumerate(workload.sessions)))
        duration = time.perf_counter() - t0
    return RunResult(recs, duration, started_at, max_in_flight)
