"""The FastAPI application of the API process: routes, auth, error rendering, lifespan.

Owns wiring: the OpenAI routes (``openai_api``), the TGI routes (``tgi_api``), the pages (``pages``:
the chat page at GET /, the API reference at /docs) and the small ones here (/health, /metrics,
/v1/loads, /tokenize, /detokenize); the bearer-token check; CORS (``--allowed-origins``, outermost, so a
browser's preflight is answered before the key is asked for and refusals carry the CORS headers too);
turning ``APIError`` into OpenAI's error body (TGI's on TGI routes); and the lifespan, which
starts the engine client and, on shutdown, aborts what is still running and tells the
scheduler to stop.

``/v1/loads`` is what a gateway routes on: requests in flight (``in_flight``, ``queued_in_api``), the
engine's running / waiting counts, KV slots (``capacity`` in tokens; ``kv_cache_dtype``: what the pool
stores, the run dtype's name or int8 / fp8_e4m3) and admission ``headroom`` (tokens it could admit now),
and the queue forecast (engine/forecast.py, carried by every step batch): ``queue_eta_s`` (seconds
before a request sent now would start its prefill: the prompt tokens queued ahead of it, shared spans
and cached prefixes counted once, at the measured prefill rate, plus the decode steps riding along
and, when the queue is blocked on KV or on --max-running-requests, the shortest running decode),
``drain_eta_s`` (until all work here now is done), the backlog they come from
(``prefill_backlog_tokens``, ``decode_backlog_tokens``, ``queue_blocked``) and the rates used
(``prefill_tokens_per_s``, ``decode_step_s``: moving averages over recent steps; null until measured,
and an ETA that needs an unmeasured rate is null too). ETAs are reported less the time since the
engine made them (``forecast_age_s``).

Invariant: no route answers 500 for bad input. Every outside input is parsed by
``protocol`` models; what they reject becomes a 4xx naming the field and the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import Scope

from lockgate.httpguard import PAGES, BearerAuth, BodyLimit, InternalErrors
from lockgate.ipc.messages import EngineStats, Shutdown
from lockgate.server import lora_api, openai_api, pages, tgi_api
from lockgate.server.context import APIError, ClientGone, ServerContext, parse_body
from lockgate.server.errors import error_message, error_param, openai_error
from lockgate.server.frontend import EngineClient
from lockgate.server.metrics import CONTENT_TYPE, Metrics
from lockgate.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TGIGenerateRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    request_fields,
)
from lockgate.server.tenants import Tenants
from lockgate.server_config import CorsConfig, ServerConfig

# what a ValueError raised after parsing (SamplingParams' checks, output constraints) may name first
_OPENAI_FIELDS = request_fields(CompletionRequest, ChatCompletionRequest)

log = logging.getLogger("lockgate.api")


def create_app(client: EngineClient, cfg: ServerConfig, api_key: Mapping[str, str | None] | None, metrics: Metrics,
               on_stopping: Callable[[], None] | None = None, tenants: Tenants | None = None,
               cors: CorsConfig | None = None) -> FastAPI:
    """``on_stopping`` runs once the server starts shutting down, before the children are told to
    exit (so whoever watches them knows their exits are expected)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        announced = asyncio.create_task(announce_tool_parser())
        yield
        announced.cancel()
        await app.state.ctx.close()
        if on_stopping is not None:
            on_stopping()
        live = list(client.streams)
        if live:
            log.info("shutting down: aborting %d unfinished requests", len(live))
        for rid in live:
            client.abort(rid)
        if client.failed is None:
            client.to_scheduler.send_nowait(Shutdown())
        await client.close()

    async def announce_tool_parser() -> None:
        """The tool-call format in the start-up log, once the tokenizer (and its chat template) is loaded."""
        await client.ready.wait()
        with contextlib.suppress(Exception):  # a failed engine says so itself; the format is resolved again on use
            _ = app.state.ctx.tool_parser

    app = FastAPI(title="lockgate", lifespan=lifespan, docs_url=None, redoc_url=None)
    known = [n for n in (api_key or {}).values() if n]
    app.state.ctx = ServerContext(client=client, cfg=cfg, metrics=metrics, model_name=client.model, api_key=api_key,
                                  tenants=tenants or Tenants(known))
    app.include_router(openai_api.router)
    app.include_router(tgi_api.router)
    app.include_router(lora_api.router)
    app.include_router(_misc)
    app.include_router(pages.router)

    def refuse(scope: Scope, status: int, message: str) -> Response:
        return _render(Request(scope), APIError(status, message))

    def body_limit() -> int:
        info = client.info
        return cfg.request_bytes_limit(info.max_model_len if info is not None else None)

    # Added innermost first: the key is checked before a body is read; the body limit before a route runs.
    app.add_middleware(InternalErrors, render=refuse, logger=log)
    app.add_middleware(BodyLimit, limit=body_limit, flag="--max-request-bytes", render=refuse)
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key, render=refuse, pages=PAGES)
    cors_options = cors.middleware_options() if cors is not None else None
    if cors_options is not None:
        app.add_middleware(CORSMiddleware, **cors_options)

    app.openapi = lambda: _openapi(app, api_key is not None)  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return _render(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # Unknown routes and methods in the route's error format, not FastAPI's {"detail": ...}
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} on this server (see /openapi.json)"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return _render(request, APIError(exc.status_code, message, headers=dict(exc.headers) if exc.headers else None))

    @app.exception_handler(ClientGone)
    async def on_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> Response:
        return _render(request, APIError(400, "; ".join(str(e.get("msg")) for e in exc.errors())))

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError) -> Response:
        # SamplingParams validates its own ranges and raises ValueError with the limit.
        return _render(request, APIError(400, error_message(exc), param=error_param(exc, _OPENAI_FIELDS)))

    return app


# ---- the OpenAPI document --------------------------------------------------------------------
# Routes read their bodies themselves (parse_body: our error messages, our limits), so FastAPI
# cannot see the schemas; they are declared here, with the error responses every route can give.
_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
    "/generate": TGIGenerateRequest, "/generate_stream": TGIGenerateRequest, "/": TGIGenerateRequest,
    "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoraAdapterRequest, "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
}
_ERRORS = {
    "400": "invalid request: the message names the field and the limit it broke",
    "404": "the model or LoRA adapter named is not served",
    "413": "the body is larger than --max-request-bytes",
    "429": "more requests are waiting than --max-queued-requests; retry after Retry-After seconds",
    "500": "the engine failed while running the request",
    "503": "the model is loading, the engine has failed, or the server is shutting down",
}


def _openapi(app: FastAPI, keyed: bool) -> dict[str, Any]:
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    models = list(dict.fromkeys(_BODIES.values()))
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs.get("$defs", {}))
    components["Error"] = {"type": "object", "properties": {"error": {}}, "required": ["error"]}
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            if path in _BODIES and method == "post":
                schema = refs[(_BODIES[path], "validation")]
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
                codes = [*_ERRORS, "422"] if path in tgi_api.TGI_PATHS else list(_ERRORS)
                responses.update({c: {"description": _ERRORS.get(c, "invalid request (TGI's code)"), **error}
                                  for c in codes})
            elif path != "/health":
                responses["503"] = {"description": _ERRORS["503"], **error}
            if keyed and path != "/health":
                responses["401"] = {"description": "missing or wrong API key", **error}
    app.openapi_schema = doc
    return doc


def _render(request: Request, exc: APIError) -> Response:
    if request.url.path in tgi_api.TGI_PATHS:
        status = 422 if exc.status == 400 else exc.status
        kind = "validation" if status in (400, 422) else "overloaded" if status in (429, 503) else "error"
        return JSONResponse({"error": exc.message, "error_type": kind}, status_code=status, headers=exc.headers)
    return JSONResponse(openai_error(exc.message, exc.status, exc.param), status_code=exc.status, headers=exc.headers)


# ---- small routes -------------------------------------------------------------------------
_misc = APIRouter()


def _ctx(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx


@_misc.get("/health")
async def health(request: Request) -> Response:
    c = _ctx(request).client
    if c.failed is not None:
        return JSONResponse({"status": "failed", "error": c.failed}, status_code=503)
    if not c.ready.is_set():
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ok"})


@_misc.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx = _ctx(request)
    ctx.metrics.set_tenant_queues({t: q for t, (q, _) in ctx.client.tenant_load().items()}, ctx.tenants.labels())
    return PlainTextResponse(ctx.metrics.render(), media_type=CONTENT_TYPE)


@_misc.get("/v1/loads")
async def loads(request: Request) -> Response:
    ctx = _ctx(request)
    s, c = ctx.client.stats, ctx.client
    body: dict[str, object] = {"ready": c.ready.is_set(), "queued_in_api": c.num_queued, "in_flight": len(c.streams)}
    if s is not None:
        body.update(running=s.running, waiting=s.waiting, slots_used=s.slots_used, slots_free=s.slots_free,
                    slots_evictable=s.slots_evictable, capacity=s.capacity, headroom=s.headroom, num_steps=s.num_steps)
        body.update(forecast(s))
    elif c.info is not None:
        body.update(running=0, waiting=0, slots_used=0, slots_free=c.info.capacity, slots_evictable=0,
                    capacity=c.info.capacity, headroom=c.info.capacity, num_steps=0, queue_eta_s=0.0, drain_eta_s=0.0,
                    prefill_backlog_tokens=0, decode_backlog_tokens=0, prefill_tokens_per_s=None, decode_step_s=None,
                    queue_blocked=False, forecast_age_s=0.0)
    # per tenant (metrics label): waiting for a first token, in flight
    if c.info is not None:  # what the pool stores (its capacity in tokens is counted at those bytes)
        body["kv_cache_dtype"] = c.info.kv_cache_dtype
    body["tenants"] = {t: {"queued": q, "in_flight": f} for t, (q, f) in sorted(c.tenant_load().items())}
    body["adapters"] = sorted(c.adapters)  # LoRA adapters loaded (the gateway prefers a replica that has one)
    return JSONResponse(body)


def forecast(s: EngineStats) -> dict[str, object]:
    """The engine's queue forecast as ``/v1/loads`` reports it: its ETAs less the time since it was
    made (the queue has been worked on meanwhile), rounded."""
    age = max(0.0, time.monotonic() - s.forecast_time) if s.forecast_time else 0.0

    def aged(eta: float | None) -> float | None:
        return None if eta is None else round(max(0.0, eta - age), 4)

    return {"queue_eta_s": aged(s.queue_eta_s), "drain_eta_s": aged(s.drain_eta_s),
            "prefill_backlog_tokens": s.prefill_backlog_tokens, "decode_backlog_tokens": s.decode_backlog_tokens,
            "prefill_tokens_per_s": None if s.prefill_tokens_per_s is None else round(s.prefill_tokens_per_s, 1),
            "decode_step_s": None if s.decode_step_s is None else round(s.decode_step_s, 5),
            "queue_blocked": s.queue_blocked, "forecast_age_s": round(age, 4)}


@_misc.post("/tokenize")
async def tokenize(request: Request) -> Response:
    ctx = _ctx(request)
    body = await parse_body(request, TokenizeRequest)
    ctx.check_model(body.model)
    conv = body.conversation()
    if conv is not None:
        ids = await ctx.chat_ids(conv, body.add_generation_prompt)
    else:
        assert body.prompt is not None
        ids = await ctx.encode(body.prompt, body.add_special_tokens)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": ctx.info.max_model_len})


@_misc.post("/detokenize")
async def detokenize(request: Request) -> Response:
    ctx = _ctx(request)
    body = await parse_body(request, DetokenizeRequest)
    ctx.check_model(body.model)
    vocab = ctx.info.vocab_size
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is out of range: the vocabulary has {vocab} tokens", param="tokens")
    return JSONResponse({"prompt": ctx.tokenizer.decode(body.tokens)})
