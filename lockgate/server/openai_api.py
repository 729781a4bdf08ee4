"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Owns turning validated requests into engine submissions (one per prompt x choice) and the
engine's ``TextOut`` stream back into OpenAI response bodies: whole responses, or SSE
chunks ending with ``data: [DONE]`` (plus a usage chunk when ``stream_options.include_usage``).

Conventions: choice index = prompt index * n + choice; ``usage.prompt_tokens`` counts each
prompt once; ``completion_tokens`` counts every choice's tokens; ``prompt_tokens_details.
cached_tokens`` is what the engine reused from its prefix cache. Finish reasons are the
engine's (stop, length, abort); an engine error ends a stream with an ``error`` event.
Whole responses also carry the prompt and cached token counts as ``x-lockgate-prompt-tokens`` /
``x-lockgate-cached-tokens`` headers, and a stream asked with ``x-lockgate-usage-comment: 1`` (the
gateway does) ends with one SSE comment line carrying them (context.py), for the gateway's hit
attribution.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lockgate.ipc.messages import TextOut
from lockgate.sampling import SamplingParams, StructuredOutput, per_choice_params
from lockgate.server.context import APIError, ServerContext, usage_comment, usage_headers, wants_usage_comment
from lockgate.server.context import parse_body as parse
from lockgate.server.errors import openai_error
from lockgate.server.frontend import RequestStream
from lockgate.server.protocol import ChatCompletionRequest, CompletionRequest
from lockgate.server.tools import render_conversation, tool_grammar
from lockgate.tokenizer.tokenizer import Tokenizer

router = APIRouter()
log = logging.getLogger("lockgate.api")


def ctx_of(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx


def sse(obj: Any) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


# ---- logprobs ---------------------------------------------------------------------------
def _piece(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tok: Tokenizer, outs: list[TextOut], offset: int) -> dict[str, Any] | None:
    if not outs or outs[0].logprobs is None and all(o.logprobs is None for o in outs):
        return None
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offs: list[int] = []
    for o in outs:
        for j, t in enumerate(o.ids):
            s = _piece(tok, t)
            tokens.append(s)
            lps.append(o.logprobs[j] if o.logprobs else None)
            tops.append({_piece(tok, i): lp for i, lp in (o.top[j] if o.top else [])} if o.top else None)
            offs.append(offset)
            offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps,
            "top_logprobs": tops if any(t is not None for t in tops) else None, "text_offset": offs}


def chat_logprobs(tok: Tokenizer, outs: list[TextOut]) -> dict[str, Any] | None:
    if all(o.logprobs is None for o in outs):
        return None
    content = []
    for o in outs:
        for j, t in enumerate(o.ids):
            s = _piece(tok, t)
            top = o.top[j] if o.top else []
            content.append({"token": s, "logprob": (o.logprobs or [0.0] * len(o.ids))[j],
                            "bytes": list(s.encode()),
                            "top_logprobs": [{"token": (p := _piece(tok, i)), "logprob": lp, "bytes": list(p.encode())}
                                             for i, lp in top]})
    return {"content": content}


def usage(prompt_lens: list[int], outs_by_choice: list[list[TextOut]], cached: list[int]) -> dict[str, Any]:
    completion = sum(len(o.ids) for outs in outs_by_choice for o in outs)
    prompt = sum(prompt_lens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached)}}


def error_param(status: int, constraint: str | None) -> str | None:
    """The request field an engine error names: the adapter (404: it was unloaded) or the output
    constraint (400: it failed while decoding)."""
    return "model" if status == 404 else constraint if status == 400 else None


def finished_ok(results: list[list[TextOut]], constraint: str | None = None) -> list[list[TextOut]]:
    """The collected outputs of every choice; an engine error becomes a 500 (a constraint that failed
    while decoding a 400 naming ``constraint``, its field), a request cut by the server (shutdown,
    an unresponsive engine) a 503."""
    for outs in results:
        if outs and outs[-1].error is not None:
            code = 503 if outs[-1].finish_reason == "abort" else outs[-1].status or 500
            raise APIError(code, outs[-1].error, param=error_param(code, constraint))
        if outs and outs[-1].finish_reason == "error":
            raise APIError(500, "internal error")
    return results


def error_event(o: TextOut, constraint: str | None = None) -> str:
    """The SSE event that ends a stream whose request failed in the engine or was cut by the server."""
    code = 503 if o.finish_reason == "abort" else o.status or 500
    return sse(openai_error(o.error or "internal error", code, error_param(code, constraint)))


def sse_response(ctx: ServerContext, streams: list[RequestStream], opening: list[str],
                 render: Callable[[int, TextOut], str | None],
                 closing: Callable[[list[list[TextOut]]], str | None],
                 attribution: Callable[[list[list[TextOut]]], str] | None = None,
                 constraint: str | None = None) -> StreamingResponse:
    """The SSE body shared by both endpoints: opening events, one event per output (``render``
    may skip one), an error event for an engine failure, an optional closing (usage) event, the
    gateway's usage comment when asked (``attribution``), then ``[DONE]`` (``constraint``: the field of
    the request's output constraint, named by a 400 when it fails while decoding). However it ends (client
    gone included), unfinished choices are aborted."""

    async def events() -> AsyncIterator[str]:
        by_choice: list[list[TextOut]] = [[] for _ in streams]
        try:
            for e in opening:
                yield e
            async for i, o in ctx.merge(streams):
                by_choice[i].append(o)
                ev = error_event(o, constraint) if o.finish_reason == "error" else render(i, o)
                if ev is not None:
                    yield ev
                if o.error is not None and o.finish_reason != "error":  # cut: its finish reason, then why
                    yield error_event(o, constraint)
            last = closing(by_choice)
            if last is not None:
                yield last
            if attribution is not None:
                yield attribution(by_choice)
        except Exception as e:  # noqa: BLE001  (a stream that fails still ends as a stream: error, then [DONE])
            log.exception("a stream failed while rendering its events")
            yield sse({"error": {"message": f"internal error while streaming: {type(e).__name__}",
                                 "type": "server_error", "code": 500}})
        finally:
            ctx.abort(streams)  # no-op for finished ones
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


# ---- /v1/completions ----------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    ctx = ctx_of(request)
    body: CompletionRequest = await parse(request, CompletionRequest)
    lora = ctx.check_model(body.model)
    tok = ctx.tokenizer
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported (prompt logprobs are not computed)",
                       param="echo")
    prompts = body.prompts()
    ctx.check_batch(len(prompts), body.n)  # before any tokenizing
    texts_in = [p for p in prompts if isinstance(p, str)]
    encoded = iter(await ctx.encode_all(texts_in)) if texts_in else iter([])
    ids = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
    structured = await ctx.compiled(request, body.structured, body.structured_field)
    jobs: list[tuple[list[int], SamplingParams]] = []
    for p_ids in ids:  # every prompt checked (ids against the vocabulary too) before any is decoded or sent
        max_tokens = ctx.check_prompt(p_ids, body.max_tokens if body.max_tokens is not None else 16)
        params = dataclasses.replace(body.sampling_params(max_tokens), lora=lora, structured=structured)
        jobs += [(p_ids, sp) for sp in per_choice_params(params, body.n)]
    texts = [p if isinstance(p, str) else tok.decode(p) for p in prompts] if body.echo else []
    streams = ctx.submit("cmpl", jobs, ctx.tenant_of(request, body.user))
    rid, created, n = streams[0].rid, int(time.time()), body.n
    prompt_lens = [len(p) for p in ids]

    def prompt_of(choice: int) -> int:
        return choice // n

    if not body.stream:
        results = finished_ok(await ctx.collect(request, streams), body.structured_field)
        choices = []
        for i, outs in enumerate(results):
            text = "".join(o.text for o in outs)
            prefix = texts[prompt_of(i)] if body.echo else ""
            choices.append({"index": i, "text": prefix + text,
                            "logprobs": completion_logprobs(tok, outs, len(prefix)),
                            "finish_reason": outs[-1].finish_reason, "stop_reason": outs[-1].stop_matched})
        cached = [results[k * n][-1].cached_tokens for k in range(len(prompts))]
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": lora or ctx.model_name,
                             "choices": choices, "usage": usage(prompt_lens, results, cached)},
                            headers=usage_headers(sum(prompt_lens), sum(cached)))

    def chunk(i: int, text: str, lp: Any = None, o: TextOut | None = None) -> str:
        return sse({"id": rid, "object": "text_completion", "created": created, "model": lora or ctx.model_name,
                    "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": o and o.finish_reason,
                                 "stop_reason": o and o.stop_matched}]})

    offsets = [len(texts[prompt_of(i)]) if body.echo else 0 for i in range(len(streams))]

    def render(i: int, o: TextOut) -> str | None:
        if not o.text and o.finish_reason is None and body.logprobs is None:
            return None
        lp = completion_logprobs(tok, [o], offsets[i]) if body.logprobs is not None else None
        offsets[i] += len(o.text)
        return chunk(i, o.text, lp, o)

    def cached_of(by_choice: list[list[TextOut]]) -> list[int]:
        return [by_choice[k * n][-1].cached_tokens if by_choice[k * n] else 0 for k in range(len(prompts))]

    def closing(by_choice: list[list[TextOut]]) -> str | None:
        if not body.include_usage:
            return None
        return sse({"id": rid, "object": "text_completion", "created": created, "model": lora or ctx.model_name,
                    "choices": [], "usage": usage(prompt_lens, by_choice, cached_of(by_choice))})

    def attribution(by_choice: list[list[TextOut]]) -> str:
        return usage_comment(sum(prompt_lens), sum(cached_of(by_choice)))

    opening = [chunk(i, texts[prompt_of(i)]) for i in range(len(streams))] if body.echo else []
    return sse_response(ctx, streams, opening, render, closing,
                        attribution if wants_usage_comment(request) else None, body.structured_field)


# ---- /v1/chat/completions ----------------------------------------------------------------
@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    ctx = ctx_of(request)
    body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
    lora = ctx.check_model(body.model)
    tok = ctx.tokenizer
    ctx.check_batch(1, body.n)
    mode = body.tool_mode  # none, auto, required, named
    choice = "required" if mode == "required" else \
        {"function": {"name": body.tool_choice.name}} if mode == "named" else mode  # type: ignore[union-attr]
    parser = ctx.tool_parser

    def prepare() -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]], list[dict[str, Any]] | None,
                           StructuredOutput | None]:
        tools = body.tool_dicts() if mode != "none" else None
        conversation, template_tools = render_conversation(body.conversation(), tools, tok.supports_tools, parser)
        forced = tool_grammar(tools, choice, parser) if tools and mode in ("required", "named") else None
        return tools, conversation, template_tools, forced

    # tool definitions can be megabytes: rendered off the event loop
    tools, conversation, template_tools, forced = await asyncio.to_thread(prepare) if body.tools else prepare()
    # function name -> its parameters' schema; a forced call is read in the format its grammar wrote
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}
    reader = parser.forced if forced is not None else parser
    ids = await ctx.chat_ids(conversation, body.add_generation_prompt, template_tools)
    max_tokens = ctx.check_prompt(ids, body.requested_max_tokens())
    params, constraint_field = dataclasses.replace(body.sampling_params(max_tokens), lora=lora), body.structured_field
    if forced is not None and tools:  # one call, its arguments following the function's schema
        # each schema compiled alone first: the call grammar reaches it only after its first tokens,
        # so a schema the engine cannot compile would otherwise surface mid-answer
        for t in tools:
            if mode == "required" or t["function"]["name"] == choice["function"]["name"]:  # type: ignore[index]
                schema = t["function"].get("parameters") or {"type": "object"}
                await ctx.compiled(request, StructuredOutput("json", json.dumps(schema)), "tools")
        params = dataclasses.replace(params, structured=forced)
        constraint_field = "tool_choice"
    params = dataclasses.replace(params, structured=await ctx.compiled(request, params.structured, constraint_field))
    streams = ctx.submit("chatcmpl", [(ids, sp) for sp in per_choice_params(params, body.n)],
                         ctx.tenant_of(request, body.user))
    rid, created = streams[0].rid, int(time.time())

    if not body.stream:
        results = finished_ok(await ctx.collect(request, streams), constraint_field)
        choices = []
        for i, outs in enumerate(results):
            text, reason = "".join(o.text for o in outs), outs[-1].finish_reason
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if schemas:
                content, calls = reader.parse(text, schemas)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": [c.wire() for c in calls]}
                    reason = "tool_calls"
            choices.append({"index": i, "message": message,
                            "logprobs": chat_logprobs(tok, outs) if body.logprobs else None,
                            "finish_reason": reason, "stop_reason": outs[-1].stop_matched})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": lora or ctx.model_name,
                             "choices": choices,
                             "usage": usage([len(ids)], results, [results[0][-1].cached_tokens])},
                            headers=usage_headers(len(ids), results[0][-1].cached_tokens))

    def chunk(i: int, delta: dict[str, Any], reason: str | None = None, lp: Any = None) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": lora or ctx.model_name,
                    "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}]})

    parsers = [reader.stream(schemas) for _ in streams] if schemas else []
    num_calls = [0] * len(streams)

    def render(i: int, o: TextOut) -> str | None:
        if not parsers:
            if not o.text and o.finish_reason is None and not body.logprobs:
                return None
            return chunk(i, {"content": o.text} if o.text else {}, o.finish_reason,
                         chat_logprobs(tok, [o]) if body.logprobs else None)
        # With tools: text that may begin a call is held back until it is one (or is not)
        content, calls = parsers[i].feed(o.text)
        if o.finish_reason is not None:
            rest, more = parsers[i].finish()
            content += rest
            calls += more
        events = []
        if content or (body.logprobs and o.text):
            events.append(chunk(i, {"content": content} if content else {}, None,
                                chat_logprobs(tok, [o]) if body.logprobs else None))
        for c in calls:
            events.append(chunk(i, {"tool_calls": [c.wire(index=num_calls[i])]}))
            num_calls[i] += 1
        if o.finish_reason is not None:
            reason = "tool_calls" if num_calls[i] else o.finish_reason
            events.append(chunk(i, {}, reason))
        return "".join(events) or None

    def closing(by_choice: list[list[TextOut]]) -> str | None:
        if not body.include_usage:
            return None
        cached = by_choice[0][-1].cached_tokens if by_choice[0] else 0
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": lora or ctx.model_name,
                    "choices": [], "usage": usage([len(ids)], by_choice, [cached])})

    def attribution(by_choice: list[list[TextOut]]) -> str:
        return usage_comment(len(ids), by_choice[0][-1].cached_tokens if by_choice[0] else 0)

    opening = [chunk(i, {"role": "assistant", "content": ""}) for i in range(len(streams))]
    return sse_response(ctx, streams, opening, render, closing,
                        attribution if wants_usage_comment(request) else None, constraint_field)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    ctx = ctx_of(request)
    info = ctx.client.info
    card: dict[str, Any] = {"id": ctx.model_name, "object": "model", "created": int(time.time()),
                            "owned_by": "lockgate", "root": ctx.client.model_spec}
    if info is not None:
        card["max_model_len"] = info.max_model_len
    cards = [card] + [{**card, "id": alias} for alias in ctx.cfg.served_model_name[1:]]  # vLLM lists each name
    for a in sorted(ctx.client.adapters.values(), key=lambda a: a.name):  # vLLM's shape: root = path, parent = base
        cards.append({"id": a.name, "object": "model", "created": card["created"], "owned_by": "lockgate",
                      "root": a.path, "parent": ctx.model_name, "lora_rank": a.rank, "lora_modules": a.modules,
                      **({"max_model_len": info.max_model_len} if info is not None else {})})
    return JSONResponse({"object": "list", "data": cards})
