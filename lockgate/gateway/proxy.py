"""The gateway's HTTP app: route each request to a replica, retry elsewhere, stream the answer through.

Owns the request path through the gateway:

1. read the body, compute the routing key and its block hashes (``keys``, ``prefix_index``);
2. ask the ``Router`` for a replica among the healthy ones (``Fleet.candidates``; for ``forecast``
   with each one's ``Fleet.forecasts`` and the prompt's estimated token count), and, for
   ``forecast``, note the request's estimated prefill there (``Replica.note_sent``);
3. forward method, path, query, headers (minus hop-by-hop ones, plus ``x-lockgate-usage-comment: 1``)
   and body; relay status, headers and body bytes as they arrive (no buffering, so SSE streams keep
   their pace), adding ``x-lockgate-replica`` and ``x-lockgate-route``;
4. hit attribution: read the replica's prompt and cached token counts (``x-lockgate-prompt-tokens`` /
   ``x-lockgate-cached-tokens`` on a whole response; on a stream the ``: x-lockgate-usage ...``
   comment line it ends with, taken out of the relayed bytes, ``UsageComment``) and count them with
   the tokens the route predicted cached (``GatewayMetrics.attributed``); text keys also teach the
   router its tokens-per-character ratio.

Failure rules:

* Before the first response byte, a transport error (refused connection, connection dropped
  without an answer: the replica died while the request queued or ran), a 503 or a 429 from the
  replica is retried on another healthy replica not tried yet (route reason ``retry``), up to
  ``max_attempts`` attempts in all; a refused connection or a 503 also marks the replica unhealthy
  until its next good check (a 429 does not: the replica is busy, not broken).
  Generation has no side effects, so a retried request loses nothing.
* After the first byte, a replica dying ends that response: an SSE stream gets a final
  ``data: {"error": ...}`` event naming the replica; any other body is cut by aborting the
  connection (so it cannot look complete); other requests are untouched.
* No healthy replica: 503 with a message. Every attempt failing: 429 if some replica answered 429
  (the fleet is full, not broken), with ``Retry-After`` from the fleet's forecast
  (``Fleet.retry_after``: the smallest queue ETA, rounded up, at least 1 s); else 502 naming the
  first error.
* A client that goes away closes the upstream request, so the replica aborts it and frees its KV.

Invariants: ``Replica.in_flight`` is incremented exactly once per forwarded attempt and
decremented exactly once when that attempt's response ends, however it ends; a request makes at
most ``max_attempts`` attempts, each on a different replica; what the client receives is byte for
byte what the replica sent, but for the usage comment line.

The gateway's own routes: ``/health`` (200 while any replica is healthy, status ``degraded``
while some are not), ``/v1/models`` (the union of the healthy replicas' models), ``/metrics``
(the gateway's counters), ``/v1/loads`` (every replica's state and last reported load).
Everything else is proxied (the pages at ``/`` and ``/docs`` too). With an API key, every route but
``/health`` and the static pages (``httpguard.PAGES``) needs it, checked
before the body is read (so an unauthenticated prompt is never routed or recorded); bodies
over ``max_request_bytes`` get 413 before they are read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Scope

from lockgate.gateway.keys import read_generation, request_key, request_max_tokens, request_model
from lockgate.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from lockgate.gateway.metrics import GatewayMetrics
from lockgate.gateway.policy import PREFIX_POLICIES, Route, Router
from lockgate.gateway.prefix_index import block_hashes
from lockgate.gateway.replicas import Fleet, Replica
from lockgate.httpguard import PAGES, BearerAuth, BodyLimit, InternalErrors, has_key
from lockgate.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("lockgate.gateway")

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length"}
_RESPONSE_DROP = (_HOP_BY_HOP - {"content-length"}) | {"date", "server"}  # uvicorn adds its own
_TGI_PATHS = ("/generate", "/generate_stream")
INLINE_KEY_BYTES = 8192  # bodies larger than this get their model-token routing key in a worker thread
USAGE_COMMENT = b": x-lockgate-usage "  # server/context.py: the stream's last line before [DONE]
USAGE_REQUEST_HEADER = (b"x-lockgate-usage-comment", b"1")
_USAGE_FIELDS = re.compile(rb"prompt_tokens=(\d+) cached_tokens=(\d+)")


@dataclass(frozen=True)
class Keyed:
    """A request's routing key as the router uses it: its block hashes, and its length in key
    elements (characters of a text key, token ids of a model key; 0: no key)."""

    hashes: list[bytes]
    length: int = 0
    text: bool = False
    max_tokens: int | None = None  # what the request may generate (forecast's decode estimate)


@dataclass
class Gateway:
    fleet: Fleet
    router: Router
    metrics: GatewayMetrics
    block_size: int
    tokenizer: Tokenizer | None = None
    http: httpx.AsyncClient | None = None
    api_key: dict[str, str | None] | None = None  # key -> name; one of them required on every route but /health
    max_request_bytes: int = 16 * 1024**2
    max_attempts: int = 3  # per request, each on a different replica

    def keyed(self, path: str, data: dict[str, Any] | None, adapter: str | None = None) -> Keyed:
        """``data``: the body as ``read_generation`` decoded it."""
        if self.router.policy not in PREFIX_POLICIES:
            return Keyed([])
        out = request_max_tokens(path, data) if self.router.policy == "forecast" else None
        key = request_key(path, data, self.tokenizer)
        if key is None:
            return Keyed([], max_tokens=out)
        return Keyed(block_hashes(key, self.block_size, adapter or ""), len(key), isinstance(key, str), out)

    def choose(self, loads: dict[str, int], keyed: Keyed) -> Route:
        if self.router.policy != "forecast":
            return self.router.choose(loads, keyed.hashes)
        per_key = self.router.tokens_per_key(keyed.text)
        return self.router.choose(loads, keyed.hashes, forecasts=self.fleet.forecasts(loads),
                                  prompt_tokens=keyed.length * per_key, block_tokens=self.block_size * per_key,
                                  output_tokens=keyed.max_tokens)

    def attribute(self, route: Route, keyed: Keyed, prompt_tokens: int, cached_tokens: int) -> None:
        """Count a replica's reported token counts with what ``route`` predicted (its matched blocks'
        share of the prompt, in the replica's tokens; the last prompt token is always computed)."""
        predicted = 0
        if keyed.length and route.matched_blocks:
            share = min(keyed.length, route.matched_blocks * self.block_size) / keyed.length
            predicted = max(0, min(prompt_tokens - 1, round(share * prompt_tokens)))
        self.metrics.attributed(route.replica, self.router.policy, predicted, cached_tokens, prompt_tokens)
        if keyed.text:
            self.router.learn_tokens(keyed.length, prompt_tokens)

    def adapter_of(self, path: str, data: dict[str, Any] | None) -> str | None:
        """The LoRA adapter a decoded request names, if some replica has it loaded (else the base
        model: other names are placeholders or the served model's own)."""
        name = request_model(path, data)
        return name if name is not None and name in self.fleet.known_adapters() else None


def _error(status: int, message: str, path: str) -> JSONResponse:
    if path in _TGI_PATHS:
        return JSONResponse({"error": message, "error_type": "gateway"}, status_code=status)
    return JSONResponse({"error": {"message": message, "type": "gateway_error", "param": None, "code": status}},
                        status_code=status)


def _sse_error(message: str, path: str) -> bytes:
    if path in _TGI_PATHS:
        body: object = {"error": message, "error_type": "gateway"}
    else:
        body = {"error": {"message": message, "type": "gateway_error", "param": None, "code": 502}}
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def create_gateway_app(gw: Gateway, cors: dict[str, Any] | None = None) -> FastAPI:
    """``cors``: Starlette ``CORSMiddleware`` options (``CorsConfig.middleware_options``), or None for none."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gw.http = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None),
                                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                                    trust_env=False)
        await gw.fleet.start()
        yield
        await gw.fleet.stop()
        await gw.http.aclose()

    app = FastAPI(title="lockgate gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def refuse(scope: Scope, status: int, message: str) -> Response:
        return _error(status, message, scope["path"])

    # Outermost first: the key is checked before anything is read, routed or recorded.
    app.add_middleware(InternalErrors, render=refuse, logger=log)
    app.add_middleware(BodyLimit, limit=lambda: gw.max_request_bytes, flag="--max-request-bytes", render=refuse)
    if gw.api_key is not None:
        app.add_middleware(BearerAuth, api_key=gw.api_key, render=refuse, pages=PAGES)
    if cors is not None:  # outermost: preflights answered before the key is asked for
        app.add_middleware(CORSMiddleware, **cors)

    @app.get("/health")
    async def health(request: Request) -> Response:
        replicas = [r.view() for r in gw.fleet.replicas.values()]
        healthy = sum(r["healthy"] for r in replicas)
        status = "ok" if healthy == len(replicas) else "degraded" if healthy else "no healthy replica"
        body: dict[str, object] = {"status": status, "healthy": healthy, "replicas": len(replicas)}
        if gw.api_key is None or has_key(request.headers.get("authorization", ""), gw.api_key):
            body["replicas"] = replicas  # the fleet's URLs, loads and errors: only for those with the key
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        loads = {u: r.load for u, r in gw.fleet.replicas.items()}
        etas = {u: f.queue_eta_s for u, f in gw.fleet.forecasts(loads).items()}
        texts = await gw.fleet.scrape_metrics()
        return Response(gw.metrics.render(loads, texts, etas), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/loads")
    async def loads() -> Response:
        return JSONResponse({"policy": gw.router.policy, "replicas": [r.view() for r in gw.fleet.replicas.values()]})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        healthy = [r for r in gw.fleet.replicas.values() if r.healthy]
        if not healthy:
            return _error(503, "no healthy replica: the gateway cannot list models", request.url.path)
        assert gw.http is not None
        headers = _forward_headers(request)
        answers = await asyncio.gather(*(gw.http.get(r.url + "/v1/models", headers=headers, timeout=5.0)
                                         for r in healthy), return_exceptions=True)
        data: dict[str, object] = {}
        for a in answers:
            if isinstance(a, httpx.Response) and a.status_code == 200:
                for m in a.json().get("data", []):
                    data.setdefault(m.get("id"), m)
            elif isinstance(a, httpx.Response) and a.status_code in (401, 403):
                return Response(a.content, status_code=a.status_code, media_type="application/json")
        return JSONResponse({"object": "list", "data": list(data.values())})

    @app.post("/v1/load_lora_adapter")
    @app.post("/v1/unload_lora_adapter")
    async def lora_change(request: Request) -> Response:
        return await _broadcast(gw, request)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def proxy(request: Request, path: str) -> Response:
        return await _proxy(gw, request)

    return app


async def _broadcast(gw: Gateway, request: Request) -> Response:
    """A LoRA load or unload goes to every healthy replica (each must serve the adapter for the
    gateway to route to it): 200 when all took it, else the first refusal's status and a message
    naming each replica that refused (those that took it keep it: unload there to undo)."""
    assert gw.http is not None
    path = request.url.path
    healthy = [r for r in gw.fleet.replicas.values() if r.healthy]
    if not healthy:
        return _error(503, "no healthy replica to load or unload the adapter on", path)
    body = await request.body()
    headers = _forward_headers(request)
    answers = await asyncio.gather(*(gw.http.post(r.url + path, content=body, headers=headers, timeout=180.0)
                                     for r in healthy), return_exceptions=True)
    failed: list[tuple[Replica, int, str]] = []
    for r, a in zip(healthy, answers, strict=True):
        if isinstance(a, httpx.Response) and a.status_code == 200:
            continue
        if isinstance(a, httpx.Response):
            try:
                text = str(a.json().get("error", {}).get("message", a.text))
            except ValueError:
                text = a.text
            failed.append((r, a.status_code, text[:300]))
        else:
            failed.append((r, 502, f"{type(a).__name__}: {a}"))
    with contextlib.suppress(httpx.HTTPError):
        await asyncio.gather(*(gw.fleet.poll(r) for r in healthy))  # their adapter lists, now
    if not failed:
        first = answers[0]
        assert isinstance(first, httpx.Response)
        return Response(first.content, status_code=200, media_type=first.headers.get("content-type"))
    status = failed[0][1]
    detail = "; ".join(f"{r.url}: {text}" for r, _, text in failed)
    took = len(healthy) - len(failed)
    return JSONResponse({"error": {"message": f"{len(failed)} of {len(healthy)} replicas refused ({detail})"
                                   + (f"; {took} took it" if took else ""),
                                   "type": "gateway_error", "param": None, "code": status}}, status_code=status)


def _forward_headers(request: Request) -> list[tuple[bytes, bytes]]:
    """The client's headers as sent (bytes, repeats kept), minus hop-by-hop ones."""
    return [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _HOP_BY_HOP]


def _generation_headers(request: Request) -> list[tuple[bytes, bytes]]:
    """The forwarded headers of a proxied request: asking streams for their usage comment."""
    name = USAGE_REQUEST_HEADER[0]
    return [*((k, v) for k, v in _forward_headers(request) if k.lower() != name), USAGE_REQUEST_HEADER]


async def _proxy(gw: Gateway, request: Request) -> Response:
    assert gw.http is not None
    path = request.url.path
    try:
        body = await request.body()
    except ClientDisconnect:
        return Response(status_code=499)  # the client left mid-body; nothing was routed
    data = read_generation(path, body)  # decoded once: adapter, key and max tokens all read it
    adapter = gw.adapter_of(path, data)
    if gw.tokenizer is not None and len(body) > INLINE_KEY_BYTES:  # tokenizing a long prompt takes seconds
        keyed = await asyncio.to_thread(gw.keyed, path, data, adapter)
    else:
        keyed = gw.keyed(path, data, adapter)
    headers = _generation_headers(request)
    target = path + (f"?{request.url.query}" if request.url.query else "")
    tried: list[str] = []
    first_error = ""
    refused = 0  # attempts a replica answered 429
    for attempt in range(max(1, gw.max_attempts)):
        loads = gw.fleet.candidates(exclude=tried, adapter=adapter)
        if not loads:
            break
        route = gw.choose(loads, keyed)
        if attempt:
            route = replace(route, reason="retry")
        gw.metrics.routed(route)
        replica = gw.fleet.replicas[route.replica]
        sent = replica.note_sent(route.est_prefill_s) if route.est_prefill_s is not None else None
        try:
            upstream = await _forward(gw.http, request, replica, replica.url + target, headers, body)
        except ClientLeft:
            replica.done_sent(sent)
            return Response(status_code=499)  # nobody is listening; the replica saw its request closed
        except httpx.TransportError as e:
            replica.done_sent(sent)
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if isinstance(e, httpx.ConnectError):
                gw.fleet.set_health(replica, False, f"connection failed: {why}")
            first_error = first_error or f"replica {replica.url} failed before answering ({why})"
            tried.append(replica.url)
            more = attempt + 1 < gw.max_attempts and bool(gw.fleet.candidates(exclude=tried, adapter=adapter))
            log.warning("%s %s on %s failed before the response (%s); %s", request.method, path, replica.url,
                        why, "retrying on another replica" if more else "giving up")
            gw.metrics.retries.labels(replica.url, type(e).__name__).inc()
            continue
        status = upstream.status_code
        if status in (429, 503):
            tried.append(replica.url)
            more = attempt + 1 < gw.max_attempts and bool(gw.fleet.candidates(exclude=tried, adapter=adapter))
            if status == 429:
                refused += 1
            if more or status == 429:  # a last 429 is answered from the fleet's forecast, below
                replica.done_sent(sent)
                replica.in_flight -= 1
                text = ""
                with contextlib.suppress(httpx.HTTPError):
                    text = (await upstream.aread())[:200].decode(errors="replace")
                await upstream.aclose()
                if status == 503:
                    gw.fleet.set_health(replica, False, f"answered 503: {text}")
                first_error = first_error or f"replica {replica.url} answered {status}"
                if more:
                    gw.metrics.retries.labels(replica.url, str(status)).inc()
                    log.warning("%s %s: replica %s answered %d; retrying on another replica", request.method,
                                path, replica.url, status)
                    continue
                break
        return _relay(gw, upstream, replica, route, path, keyed, sent)
    if refused:
        gw.metrics.errors.labels("refused").inc()
        wait = gw.fleet.retry_after()
        resp = _error(429, f"every replica tried ({len(tried)}) is full (429); retry after {wait}s", path)
        resp.headers["Retry-After"] = str(wait)
        return resp
    if not tried:
        gw.metrics.errors.labels("no_replica").inc()
        return _error(503, f"no healthy replica among {len(gw.fleet.replicas)}: see the gateway's /health", path)
    gw.metrics.errors.labels("upstream").inc()
    return _error(502, f"{first_error}; no other replica could take it", path)


class ClientLeft(Exception):
    """The client disconnected before the replica answered."""


async def _forward(http: httpx.AsyncClient, request: Request, replica: Replica, url: str,
                   headers: list[tuple[bytes, bytes]], body: bytes) -> httpx.Response:
    """One attempt: on return the caller holds one ``replica.in_flight`` count; on any exception, none."""
    replica.in_flight += 1
    try:
        req = http.build_request(request.method, url, headers=headers, content=body)
        return await _send_unless_client_leaves(http, req, request)
    except BaseException:
        replica.in_flight -= 1
        raise


async def _send_unless_client_leaves(http: httpx.AsyncClient, req: httpx.Request, client: Request) -> httpx.Response:
    """Send ``req``; if the client disconnects first, cancel it (closing the replica's connection)."""
    send = asyncio.ensure_future(http.send(req, stream=True))
    gone = asyncio.ensure_future(_disconnected(client))
    try:
        await asyncio.wait({send, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not gone.done():
            gone.cancel()
        if not send.done():
            send.cancel()
            await asyncio.gather(send, return_exceptions=True)
    if send.cancelled():
        raise ClientLeft()
    return send.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Relayed(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends (done, failed, client gone)."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(body, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


class UsageComment:
    """Takes the replica's usage comment (``: x-lockgate-usage prompt_tokens=N cached_tokens=M``) out
    of a relayed SSE body and keeps its counts (``found``).

    The replica writes the comment as a body chunk of its own, and a read from the replica never
    spans two chunks, so the comment starts a piece; it may be cut across pieces, so a piece that
    could be its beginning is held until it is known (at most ``HOLD`` bytes). Anything else passes
    at once and unchanged."""

    HOLD = 256

    def __init__(self) -> None:
        self.held = b""
        self.found: tuple[int, int] | None = None  # (prompt tokens, cached tokens)

    def feed(self, piece: bytes) -> bytes:
        """The bytes to relay now, given the next piece read from the replica."""
        data = self.held + piece if self.held else piece
        self.held = b""
        if self.found is not None or not data:
            return data
        if data.startswith(USAGE_COMMENT):
            end = data.find(b"\n\n")
            if end < 0:
                if len(data) <= self.HOLD:
                    self.held = data
                    return b""
                return data  # not ours after all: too long
            m = _USAGE_FIELDS.search(data, 0, end)
            if m is None:
                return data
            self.found = (int(m.group(1)), int(m.group(2)))
            return data[end + 2:]
        if len(data) < len(USAGE_COMMENT) and USAGE_COMMENT.startswith(data):
            self.held = data
            return b""
        return data

    def flush(self) -> bytes:
        out, self.held = self.held, b""
        return out


def _header_counts(headers: httpx.Headers) -> tuple[int, int] | None:
    try:
        return int(headers["x-lockgate-prompt-tokens"]), int(headers["x-lockgate-cached-tokens"])
    except (KeyError, ValueError):
        return None


def _relay(gw: Gateway, upstream: httpx.Response, replica: Replica, route: Route, path: str,
           keyed: Keyed = Keyed([]), sent: tuple[float, float] | None = None) -> Response:
    sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROP}
    headers["x-lockgate-replica"] = replica.url
    headers["x-lockgate-route"] = route.header()
    done = False
    comment = UsageComment() if sse and upstream.status_code == 200 else None
    if upstream.status_code == 200 and not sse and (counts := _header_counts(upstream.headers)) is not None:
        gw.attribute(route, keyed, *counts)

    def comment_done() -> None:  # the counts are in: pass the rest through untouched
        nonlocal comment
        comment = None

    def finish() -> None:  # exactly once, whether the body ended, failed or the client left
        nonlocal done
        if not done:
            done = True
            replica.in_flight -= 1
            replica.done_sent(sent)

    async def body() -> AsyncIterator[bytes]:
        began = False
        try:
            async for chunk in upstream.aiter_raw():
                if not began:  # the answer has begun: its prefill is no longer ahead there
                    began = True
                    replica.done_sent(sent)
                if comment is not None:
                    chunk = comment.feed(chunk)
                    if comment.found is not None:
                        gw.attribute(route, keyed, *comment.found)
                        comment_done()
                    if not chunk:
                        continue
                yield chunk
            if comment is not None and (rest := comment.flush()):
                yield rest
        except httpx.TransportError as e:
            gw.metrics.errors.labels("midstream").inc()
            message = f"replica {replica.url} failed mid-response: {type(e).__name__}"
            log.warning("%s", message)
            if not sse:
                raise  # abort the connection: a cut body must not look complete
            yield _sse_error(message, path)
        finally:
            finish()
            await upstream.aclose()

    async def close() -> None:
        finish()
        await upstream.aclose()

    return _Relayed(body(), close, status_code=upstream.status_code, headers=headers)
