"""The gateway's HTTP app: route each request to a replica, retry once, stream the answer through.

Owns the request path through the gateway:

1. read the body, compute the routing key and its block hashes (``keys``, ``prefix_index``);
2. ask the ``Router`` for a replica among the healthy ones (``Fleet.candidates``);
3. forward method, path, query, headers (minus hop-by-hop ones) and body; relay status, headers
   and body bytes as they arrive (no buffering, so SSE streams keep their pace), adding
   ``x-lockgate-replica`` and ``x-lockgate-route``.

Failure rules:

* Before the first response byte, a transport error (refused connection, connection dropped
  without an answer: the replica died while the request queued or ran) or a 503 from the replica
  is retried once on another healthy replica (route reason ``retry``); a refused connection or a
  503 also marks the replica unhealthy until its next good check.
  Generation has no side effects, so a retried request loses nothing.
* After the first byte, a replica dying ends that response: an SSE stream gets a final
  ``data: {"error": ...}`` event naming the replica; any other body is cut by aborting the
  connection (so it cannot look complete); other requests are untouched.
* No healthy replica: 503 with a message; the retry failing too: 502 naming both errors.
* A client that goes away closes the upstream request, so the replica aborts it and frees its KV.

Invariant: ``Replica.in_flight`` is incremented exactly once per forwarded attempt and
decremented exactly once when that attempt's response ends, however it ends.

The gateway's own routes: ``/health`` (200 while any replica is healthy, status ``degraded``
while some are not), ``/v1/models`` (the union of the healthy replicas' models), ``/metrics``
(the gateway's counters), ``/v1/loads`` (every replica's state and last reported load).
Everything else is proxied. With an API key, every route but ``/health`` needs it, checked
before the body is read (so an unauthenticated prompt is never routed or recorded); bodies
over ``max_request_bytes`` get 413 before they are read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Scope

from lockgate.gateway.keys import request_key, request_model
from lockgate.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from lockgate.gateway.metrics import GatewayMetrics
from lockgate.gateway.policy import Route, Router
from lockgate.gateway.prefix_index import block_hashes
from lockgate.gateway.replicas import Fleet, Replica
from lockgate.httpguard import BearerAuth, BodyLimit, has_key
from lockgate.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("lockgate.gateway")

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length"}
_RESPONSE_DROP = (_HOP_BY_HOP - {"content-length"}) | {"date", "server"}  # uvicorn adds its own
_TGI_PATHS = ("/generate", "/generate_stream")
INLINE_KEY_BYTES = 8192  # bodies larger than this get their model-token routing key in a worker thread


@dataclass
class Gateway:
    fleet: Fleet
    router: Router
    metrics: GatewayMetrics
    block_size: int
    tokenizer: Tokenizer | None = None
    http: httpx.AsyncClient | None = None
    api_key: str | None = None  # required on every route but /health when set
    max_request_bytes: int = 16 * 1024**2

    def hashes(self, path: str, body: bytes, adapter: str | None = None) -> list[bytes]:
        if self.router.policy != "prefix-cache":
            return []
        key = request_key(path, body, self.tokenizer)
        return block_hashes(key, self.block_size, adapter or "") if key is not None else []

    def adapter_of(self, path: str, body: bytes) -> str | None:
        """The LoRA adapter a request names, if some replica has it loaded (else the base model:
        other names are placeholders or the served model's own)."""
        name = request_model(path, body)
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


def create_gateway_app(gw: Gateway) -> FastAPI:
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
    app.add_middleware(BodyLimit, limit=lambda: gw.max_request_bytes, flag="--max-request-bytes", render=refuse)
    if gw.api_key is not None:
        app.add_middleware(BearerAuth, api_key=gw.api_key, render=refuse)

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
        texts = await gw.fleet.scrape_metrics()
        return Response(gw.metrics.render(loads, texts), media_type=METRICS_CONTENT_TYPE)

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


async def _proxy(gw: Gateway, request: Request) -> Response:
    assert gw.http is not None
    path = request.url.path
    try:
        body = await request.body()
    except ClientDisconnect:
        return Response(status_code=499)  # the client left mid-body; nothing was routed
    adapter = gw.adapter_of(path, body)
    if gw.tokenizer is not None and len(body) > INLINE_KEY_BYTES:  # tokenizing a long prompt takes seconds
        hashes = await asyncio.to_thread(gw.hashes, path, body, adapter)
    else:
        hashes = gw.hashes(path, body, adapter)
    headers = _forward_headers(request)
    target = path + (f"?{request.url.query}" if request.url.query else "")
    tried: list[str] = []
    first_error = ""
    for attempt in range(2):
        loads = gw.fleet.candidates(exclude=tried, adapter=adapter)
        if not loads:
            break
        route = gw.router.choose(loads, hashes)
        if attempt:
            route = replace(route, reason="retry")
        gw.metrics.routed(route)
        replica = gw.fleet.replicas[route.replica]
        try:
            upstream = await _forward(gw.http, request, replica, replica.url + target, headers, body)
        except ClientLeft:
            return Response(status_code=499)  # nobody is listening; the replica saw its request closed
        except httpx.TransportError as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if isinstance(e, httpx.ConnectError):
                gw.fleet.set_health(replica, False, f"connection failed: {why}")
            first_error = first_error or f"replica {replica.url} failed before answering ({why})"
            log.warning("%s %s on %s failed before the response (%s); %s", request.method, path, replica.url,
                        why, "retrying on another replica" if attempt == 0 else "giving up")
            gw.metrics.retries.labels(replica.url, type(e).__name__).inc()
            tried.append(replica.url)
            continue
        if upstream.status_code == 503 and attempt == 0 and gw.fleet.candidates(exclude=[replica.url]):
            replica.in_flight -= 1
            text = ""
            with contextlib.suppress(httpx.HTTPError):
                text = (await upstream.aread())[:200].decode(errors="replace")
            await upstream.aclose()
            gw.fleet.set_health(replica, False, f"answered 503: {text}")
            first_error = f"replica {replica.url} answered 503"
            gw.metrics.retries.labels(replica.url, "503").inc()
            log.warning("%s %s: replica %s answered 503; retrying on another replica", request.method, path,
                        replica.url)
            tried.append(replica.url)
            continue
        return _relay(gw, upstream, replica, route, path)
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


def _relay(gw: Gateway, upstream: httpx.Response, replica: Replica, route: Route, path: str) -> Response:
    sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROP}
    headers["x-lockgate-replica"] = replica.url
    headers["x-lockgate-route"] = route.header()
    done = False

    def finish() -> None:  # exactly once, whether the body ended, failed or the client left
        nonlocal done
        if not done:
            done = True
            replica.in_flight -= 1

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
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
