"""TGI-native routes: POST /generate and POST /generate_stream (and POST / by ``stream``).

Owns mapping TGI's request shape (``inputs`` + ``parameters``) onto one engine request and
the engine's outputs back onto TGI's response shapes:

* /generate -> ``{"generated_text", "details"?}``; details has ``finish_reason`` (``length``,
  ``eos_token`` or ``stop_sequence``), ``generated_tokens``, ``seed`` and per-token
  ``tokens`` [{id, text, logprob, special}].
* /generate_stream -> SSE, one event per token ``{"index", "token", "generated_text": null,
  "details": null}``; the last event carries the full ``generated_text`` and ``details``.

The prompt and cached token counts travel as in openai_api (headers on /generate, an SSE comment
on a stream that asked for it). Errors use TGI's body ``{"error", "error_type"}`` (the app renders APIError that way on these
routes); validation errors are 422 as in TGI.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lockgate.ipc.messages import TextOut
from lockgate.server.context import (
    APIError,
    ServerContext,
    parse_body,
    usage_comment,
    usage_headers,
    wants_usage_comment,
)
from lockgate.server.protocol import TGIGenerateRequest

router = APIRouter()
log = logging.getLogger("lockgate.api")

TGI_PATHS = ("/generate", "/generate_stream", "/")


def _reason(o: TextOut) -> str:
    if o.finish_reason == "stop":
        return "stop_sequence" if o.stop_matched is not None else "eos_token"
    return o.finish_reason or "length"


def _tokens(ctx: ServerContext, o: TextOut) -> list[dict[str, Any]]:
    tok, eos = ctx.tokenizer, set(ctx.info.eos_token_ids)
    lps: list[float | None] = list(o.logprobs) if o.logprobs else [None] * len(o.ids)
    return [{"id": t, "text": tok.decode([t], skip_special_tokens=False), "logprob": lp, "special": t in eos}
            for t, lp in zip(o.ids, lps, strict=True)]


def _top_tokens(ctx: ServerContext, o: TextOut) -> list[list[dict[str, Any]]] | None:
    """TGI's ``top_tokens`` (``top_n_tokens``): per generated token, its best alternatives."""
    if not o.top:
        return None
    tok, eos = ctx.tokenizer, set(ctx.info.eos_token_ids)
    return [[{"id": i, "text": tok.decode([i], skip_special_tokens=False), "logprob": lp, "special": i in eos}
             for i, lp in alternatives] for alternatives in o.top]


async def _start(request: Request) -> tuple[ServerContext, TGIGenerateRequest, Any]:
    ctx: ServerContext = request.app.state.ctx
    body = await parse_body(request, TGIGenerateRequest)
    ctx.check_adapter(body.parameters.adapter_id or None, "adapter_id")
    ids = await ctx.encode(body.inputs)
    ctx.check_prompt(ids, body.parameters.max_new_tokens)
    try:
        params = body.sampling_params()
    except ValueError as e:
        raise APIError(422, str(e)) from None
    structured = await ctx.compiled(request, params.structured, "grammar", status=422)
    params = dataclasses.replace(params, structured=structured)
    return ctx, body, ctx.submit("tgi", [(ids, params)], ctx.tenant_of(request))


@router.post("/generate")
async def generate(request: Request) -> Response:
    ctx, body, streams = await _start(request)
    return await _whole(request, ctx, body, streams)


async def _whole(request: Request, ctx: ServerContext, body: TGIGenerateRequest, streams: Any) -> Response:
    outs = (await ctx.collect(request, streams))[0]
    last = outs[-1]
    if last.finish_reason == "error" or last.error is not None:
        raise APIError(503 if last.finish_reason == "abort" else last.status or 500, last.error or "internal error")
    text = "".join(o.text for o in outs)
    if body.parameters.return_full_text:
        text = body.inputs + text
    result: dict[str, Any] = {"generated_text": text}
    if body.parameters.details:
        result["details"] = {"finish_reason": _reason(last), "generated_tokens": sum(len(o.ids) for o in outs),
                             "seed": body.parameters.seed, "prefill": [],
                             "tokens": [t for o in outs for t in _tokens(ctx, o)]}
        if body.parameters.top_n_tokens:
            result["details"]["top_tokens"] = [alts for o in outs for alts in (_top_tokens(ctx, o) or [])]
    return JSONResponse(result, headers=usage_headers(last.num_prompt_tokens, last.cached_tokens))


@router.post("/generate_stream")
async def generate_stream(request: Request) -> Response:
    ctx, body, streams = await _start(request)
    return _stream(ctx, body, streams, wants_usage_comment(request))


@router.post("/")
async def compat(request: Request) -> Response:
    """TGI's root route: /generate_stream by the body's ``stream`` flag, else /generate's answer as a
    one-element list (what TGI answers there, and what its Python client indexes)."""
    ctx, body, streams = await _start(request)
    if body.stream:
        return _stream(ctx, body, streams, wants_usage_comment(request))
    whole = await _whole(request, ctx, body, streams)
    return Response(b"[" + bytes(whole.body) + b"]", media_type="application/json",
                    headers={k: v for k, v in whole.headers.items() if k.startswith("x-lockgate-")})


@router.get("/info")
async def info(request: Request) -> Response:
    """TGI's ``/info``: what is served and its limits (the fields TGI's clients read)."""
    from lockgate.version import __version__

    ctx: ServerContext = request.app.state.ctx
    i = ctx.info
    limit = min(i.max_model_len, i.capacity)
    return JSONResponse({
        "model_id": ctx.model_name, "model_sha": None, "model_dtype": i.dtype, "model_device_type": "cpu",
        "model_pipeline_tag": "text-generation", "max_concurrent_requests": ctx.cfg.max_queued_requests,
        "max_best_of": 1, "max_stop_sequences": 16, "max_input_tokens": limit - 1, "max_input_length": limit - 1,
        "max_total_tokens": limit, "validation_workers": 1, "max_client_batch_size": 1, "router": "lockgate",
        "version": __version__, "sha": None, "docker_label": None,
    })


def _stream(ctx: ServerContext, body: TGIGenerateRequest, streams: Any, attribution: bool = False) -> Response:
    async def events() -> AsyncIterator[str]:
        text, n = [], 0
        try:
            async for _, o in ctx.merge(streams):
                if o.finish_reason == "error" or o.error is not None:
                    yield f"data:{json.dumps({'error': o.error or 'internal error', 'error_type': 'generation'})}\n\n"
                    return
                text.append(o.text)
                toks = _tokens(ctx, o)
                tops = _top_tokens(ctx, o)
                # each token's own share of the text (a step with accepted guesses brings several)
                pieces = o.pieces if o.pieces else [o.text] if toks else []
                for j, t in enumerate(toks):
                    n += 1
                    last = o.finish_reason is not None and j == len(toks) - 1
                    event: dict[str, Any] = {"index": n, "token": {**t, "text": pieces[j]},
                                             "top_tokens": tops[j] if tops else None, "generated_text": None,
                                             "details": None}
                    if last:
                        full = "".join(text)
                        event["generated_text"] = body.inputs + full if body.parameters.return_full_text else full
                        event["details"] = {"finish_reason": _reason(o), "generated_tokens": n,
                                            "seed": body.parameters.seed, "input_length": o.num_prompt_tokens}
                    yield f"data:{json.dumps(event, ensure_ascii=False)}\n\n"
                if o.finish_reason is not None and attribution:
                    yield usage_comment(o.num_prompt_tokens, o.cached_tokens)
        except Exception as e:  # noqa: BLE001  (a stream that fails still ends with an error event)
            log.exception("a TGI stream failed while rendering its events")
            yield f"data:{json.dumps({'error': f'internal error while streaming: {type(e).__name__}', 'error_type': 'generation'})}\n\n"
        finally:
            ctx.abort(streams)

    return StreamingResponse(events(), media_type="text/event-stream")
