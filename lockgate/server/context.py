"""What every route needs: the engine client, the limits, and the checks that guard submission.

Owns ``APIError`` (status + message + optional headers, rendered by the app in the route's
error format) and ``ServerContext``: readiness, the served model name, prompt length limits,
the queue limit, and the shared "submit n choices and collect / stream them" helpers.

Invariants: a request is validated completely (model name, lengths against the context and
the KV pool, token ids against the vocabulary, the queue limit) before anything is submitted,
so a rejected request never reaches the engine; and the ids of every choice submitted for
one HTTP request are aborted together if the client goes away.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from lockgate import jsonsafe
from lockgate.config import parse_size
from lockgate.grammar import GrammarBusy, GrammarError
from lockgate.grammar.sandbox import STACK_BYTES as SANDBOX_STACK_BYTES
from lockgate.grammar.sandbox import GrammarSandbox
from lockgate.ipc.child import GrammarWorkerArgs
from lockgate.ipc.messages import Ready, TextOut
from lockgate.sampling import SamplingParams, StructuredOutput
from lockgate.server.errors import error_message, error_param
from lockgate.server.frontend import AdapterGone, EngineClient, EngineUnavailable, RequestStream, SampleGroup
from lockgate.server.metrics import Metrics
from lockgate.server.protocol import request_fields
from lockgate.server.tenants import TENANT_HEADER, TenantError, Tenants
from lockgate.server.tool_parsers import ToolParser, resolve
from lockgate.server_config import ServerConfig
from lockgate.tokenizer.tokenizer import Tokenizer

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
log = logging.getLogger("lockgate.api")


# ---- cached-token attribution (the gateway joins it with its own prediction) ---------------------
# Whole responses carry the prompt's real token count and the tokens reused from the prefix cache as
# headers. A stream's headers leave before anything is known, so a stream whose request asked for it
# (``USAGE_COMMENT_REQUEST: 1``, which the gateway sends) ends with one SSE comment line before its
# ``[DONE]`` (or after its last event, TGI): ``: x-lockgate-usage prompt_tokens=N cached_tokens=M``.
# SSE parsers skip comment lines by the spec; the gateway also strips it before relaying.
PROMPT_TOKENS_HEADER = "x-lockgate-prompt-tokens"
CACHED_TOKENS_HEADER = "x-lockgate-cached-tokens"
USAGE_COMMENT_REQUEST = "x-lockgate-usage-comment"
USAGE_COMMENT_PREFIX = ": x-lockgate-usage "


def usage_headers(prompt_tokens: int, cached_tokens: int) -> dict[str, str]:
    return {PROMPT_TOKENS_HEADER: str(prompt_tokens), CACHED_TOKENS_HEADER: str(cached_tokens)}


def usage_comment(prompt_tokens: int, cached_tokens: int) -> str:
    return f"{USAGE_COMMENT_PREFIX}prompt_tokens={prompt_tokens} cached_tokens={cached_tokens}\n\n"


def wants_usage_comment(request: Request) -> bool:
    return request.headers.get(USAGE_COMMENT_REQUEST) == "1"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body validated as ``model``; APIError 400 saying what is wrong otherwise.

    Before the schema sees it, the body must be a JSON object nested at most ``MAX_JSON_DEPTH``
    deep whose strings are valid Unicode (JSON's ``\\ud800`` escapes can spell a lone surrogate,
    which no tokenizer, stop matcher or serializer accepts) and whose integers fit in 64 bits."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientGone from None
    if len(raw) > INLINE_BODY_BYTES:  # decoding and validating megabytes takes a while: off the event loop
        return await asyncio.to_thread(_decode_body, raw, model)
    return _decode_body(raw, model)


def _decode_body(raw: bytes, model: type[M]) -> M:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the request body is nested too deeply: at most {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    problem = jsonsafe.problem(data)
    if problem is not None:
        path, what = problem
        raise APIError(400, f"{path}: {what}" if path else what, param=path.split(".")[0].split("[")[0] or None)
    try:
        return model.model_validate(data)
    except (ValidationError, ValueError) as e:
        raise APIError(400, error_message(e), param=error_param(e, request_fields(model))) from None


MAX_JSON_DEPTH = jsonsafe.MAX_DEPTH
INLINE_BODY_BYTES = 256 * 1024  # larger bodies are decoded and validated in a worker thread
INLINE_TEXT_CHARS = 8192  # longer texts are tokenized in a worker thread (about 10 ms of work and up)
INLINE_MESSAGES = 64  # so are chats with more messages (the template's loop costs even when they are empty)


class ClientGone(Exception):
    """The HTTP client disconnected; its requests were aborted."""


@dataclass
class ServerContext:
    client: EngineClient
    cfg: ServerConfig
    metrics: Metrics
    model_name: str
    api_key: Mapping[str, str | None] | None  # key -> its tenant name; None: no key required
    tenants: Tenants = field(default_factory=Tenants)
    _sandbox: GrammarSandbox | None = field(default=None, init=False)  # made on the first constrained request
    _tool_parser: ToolParser | None = field(default=None, init=False)  # resolved once the tokenizer is loaded

    # ---- readiness and limits ------------------------------------------------------------
    @property
    def info(self) -> Ready:
        info = self.client.info
        if self.client.failed is not None:
            raise APIError(503, f"the engine has failed: {self.client.failed}")
        if info is None or not self.client.ready.is_set():
            raise APIError(503, "the model is still loading; retry when /health answers 200",
                           headers={"Retry-After": "5"})
        return info

    @property
    def tokenizer(self) -> Tokenizer:
        _ = self.info
        assert self.client.tokenizer is not None
        return self.client.tokenizer

    @property
    def tool_parser(self) -> ToolParser:
        """The tool-call format of this server (``--tool-call-parser``; ``auto``: the chat template's),
        resolved and logged once the model is loaded."""
        if self._tool_parser is None:
            self._tool_parser, why = resolve(self.cfg.tool_call_parser, self.tokenizer.chat_template)
            log.info("%s", why)
        return self._tool_parser

    # ---- text -> ids, off the event loop when large ----------------------------------------
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a long text is tokenized in a worker thread so that /health and
        every other request keep being answered meanwhile (a 2 MB text takes seconds)."""
        return (await self.encode_all([text], add_special_tokens))[0]

    async def encode_all(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text; in one worker thread when they are long together (many short
        prompts cost as much as one long one)."""
        tok = self.tokenizer

        def run() -> list[list[int]]:
            return [tok.encode(t, add_special_tokens=add_special_tokens) for t in texts]

        if sum(len(t) for t in texts) <= INLINE_TEXT_CHARS:
            return run()
        return await asyncio.to_thread(run)

    async def chat_ids(self, conversation: list[dict[str, Any]], add_generation_prompt: bool,
                       tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat template applied to ``conversation``, then tokenized (in a thread when large).
        A template that fails on these messages is a 400 naming ``messages``."""
        tok = self.tokenizer

        def run() -> list[int]:
            try:
                text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tools=tools)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            except Exception as e:  # a template that fails on these messages (jinja raise_exception, ...)
                raise APIError(400, f"the chat template failed on these messages: {e}", param="messages") from None
            return tok.encode(text, add_special_tokens=False)

        if len(conversation) <= INLINE_MESSAGES and sum(len(m["content"]) for m in conversation) <= INLINE_TEXT_CHARS:
            return run()
        return await asyncio.to_thread(run)

    # ---- output constraints ----------------------------------------------------------------
    def grammar_sandbox(self) -> GrammarSandbox:
        """The worker processes that compile clients' constraints (made on the first constrained request)."""
        if self._sandbox is None:
            info, cfg = self.info, self.cfg
            spec = GrammarWorkerArgs(model=self.client.model_spec, model_dir=info.model_dir,
                                     vocab_size=info.vocab_size, eos_token_ids=list(info.eos_token_ids),
                                     stack_bytes=SANDBOX_STACK_BYTES, memory_bytes=parse_size(cfg.grammar_memory))
            counter = self.metrics.grammar_compiles
            self._sandbox = GrammarSandbox(spec, workers=cfg.grammar_workers, queue_limit=cfg.grammar_queue_size,
                                           timeout=cfg.grammar_compile_timeout,
                                           on_outcome=lambda o: counter.labels(*self.metrics.key, o).inc())
        return self._sandbox

    async def compiled(self, request: Request, so: StructuredOutput | None, param: str | None,
                       status: int = 400) -> StructuredOutput | None:
        """``so`` compiled in the grammar sandbox, as the constraint to submit; before anything is
        queued. An invalid schema, regex or grammar, one that crashes the compiler or does not compile
        within ``--grammar-compile-timeout``, is a ``status`` naming ``param``; a full sandbox queue a
        429 with Retry-After. Nothing but this request waits for the compile, and it stops waiting when
        its client leaves (``ClientGone``): a compile nobody waits for is dropped before it starts."""
        if so is None:
            return None
        try:
            return await until_gone(request, self.grammar_sandbox().compile(so))
        except GrammarBusy as e:
            raise APIError(429, str(e), param=param, headers={"Retry-After": str(e.retry_after)}) from None
        except GrammarError as e:
            raise APIError(status, str(e), param=param) from None

    async def close(self) -> None:
        if self._sandbox is not None:
            await self._sandbox.close()

    @property
    def base_names(self) -> tuple[str, ...]:
        """Names of the base model: every --served-model-name (the first is ``model_name``), the --model spec."""
        return (self.model_name, *self.cfg.served_model_name, self.client.model_spec)

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names, or None for the base model. A request may
        name a loaded adapter, the served model (any of its ``--served-model-name`` names), its ``--model`` spec or, unless
        ``--strict-model-name`` or adapters are loaded, anything: with one model served and no
        adapters, a name can only mean it (clients such as huggingface_hub send placeholders like
        "dummy" or "tgi"). With adapters loaded an unknown name is a 404 naming it."""
        adapters = self.client.adapters
        if model is not None and model in adapters:
            return model
        if model is None or model in self.base_names:
            return None
        if model in self.client.unloaded:
            raise APIError(404, f"The model `{model}` does not exist: the LoRA adapter {model!r} was unloaded",
                           param="model")
        if self.cfg.strict_model_name or adapters:
            served = " / ".join(map(repr, dict.fromkeys(self.base_names[:-1]))) + (f" and the LoRA adapters {', '.join(map(repr, sorted(adapters)))}"
                                              if adapters else "")
            raise APIError(404, f"The model `{model}` does not exist: this server serves {served}", param="model")
        return None

    def check_adapter(self, name: str | None, param: str) -> None:
        """A LoRA adapter named by a request field other than ``model`` (TGI's ``adapter_id``)."""
        if name is not None and (name in self.client.unloaded or name not in self.client.adapters
                                 and name not in self.base_names):
            loaded = ", ".join(map(repr, sorted(self.client.adapters))) or "none"
            raise APIError(404, f"the LoRA adapter {name!r} is not loaded (loaded: {loaded})", param=param)

    def check_prompt(self, ids: list[int], max_tokens: int | None) -> int:
        """Validate a tokenized prompt; return the max_tokens to use (filled in when None)."""
        info = self.info
        n = len(ids)
        if n == 0:
            raise APIError(400, "the prompt is empty: at least one token is needed", param="prompt")
        bad = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range: the vocabulary has {info.vocab_size} tokens",
                           param="prompt")
        limit = min(info.max_model_len, info.capacity)
        what = "maximum context length" if info.max_model_len <= info.capacity else "KV cache capacity"
        if max_tokens is None:
            if n >= limit:
                raise APIError(400, f"this model's {what} is {limit} tokens, but the prompt has {n} tokens; "
                               "reduce the prompt", param="messages")
            return min(limit - n, self.cfg.default_max_tokens)
        if n + max_tokens > limit:
            raise APIError(400, f"this model's {what} is {limit} tokens, but you requested {n + max_tokens} "
                           f"tokens ({n} in the prompt, {max_tokens} for the completion); reduce the prompt "
                           "or max_tokens", param="max_tokens")
        return max_tokens

    def check_batch(self, num_prompts: int, n: int) -> None:
        """A request of ``num_prompts`` x ``n`` engine requests that can never be queued at once: 400
        (checked before anything is tokenized)."""
        limit = self.cfg.max_queued_requests
        if num_prompts * n > limit:
            raise APIError(400, f"this request needs {num_prompts * n} engine requests ({num_prompts} prompts x n={n}), "
                           f"more than can ever be queued at once: --max-queued-requests {limit}; split it",
                           param="prompt" if num_prompts > 1 else "n")

    def check_queue(self, n_new: int, tenant: str = "default") -> None:
        self.check_batch(n_new, 1)
        limit = self.cfg.max_queued_requests
        queued = self.client.num_queued
        if queued + n_new > limit:
            raise APIError(429, f"too many requests waiting: {queued} are queued and the limit is "
                           f"--max-queued-requests {limit}; retry later",
                           headers={"Retry-After": str(self.retry_after())})
        per = self.cfg.max_queued_per_tenant
        if per is not None:
            if n_new > per:
                raise APIError(400, f"this request needs {n_new} engine requests, more than tenant {tenant!r} may "
                               f"ever have queued: --max-queued-per-tenant {per}; split it", param="n")
            mine = self.client.num_queued_for(tenant)
            if mine + n_new > per:
                raise APIError(429, f"too many requests waiting for tenant {tenant!r}: {mine} are queued and the "
                               f"limit is --max-queued-per-tenant {per}; retry later",
                               headers={"Retry-After": str(self.retry_after())})

    def tenant_of(self, request: Request, user: str | None = None) -> str:
        """The request's tenant: its API key's name, else the x-lockgate-tenant header, else ``user``
        (server/tenants.py); 400 naming the header or field when it is too long."""
        try:
            return self.tenants.resolve(request.scope.get("state", {}).get("api_key_name"),
                                        request.headers.get(TENANT_HEADER), user)
        except TenantError as e:
            raise APIError(400, str(e), param=e.param) from None

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the engine's queue ETA (less its age), rounded up,
        at least 1 (1 while no forecast is known)."""
        s = self.client.stats
        if s is None or s.queue_eta_s is None:
            return 1
        age = max(0.0, time.monotonic() - s.forecast_time) if s.forecast_time else 0.0
        return max(1, math.ceil(s.queue_eta_s - age))

    # ---- submission ----------------------------------------------------------------------
    def submit(self, kind: str, jobs: list[tuple[list[int], SamplingParams]],
               tenant: str = "default") -> list[RequestStream]:
        """Submit one engine request per (prompt ids, params) for ``tenant``; all or nothing."""
        self.check_queue(len(jobs), tenant)
        label = self.tenants.label(tenant)
        streams: list[RequestStream] = []
        # the n copies of one prompt share its ids list: one sampling group each (for the metrics)
        sizes = collections.Counter(id(ids) for ids, _ in jobs)
        groups: dict[int, SampleGroup] = {}
        try:
            for ids, params in jobs:
                group = groups.setdefault(id(ids), SampleGroup(sizes[id(ids)], params.max_tokens or 0))
                streams.append(self.client.submit(self.client.new_id(kind), ids, params, group, tenant, label))
        except EngineUnavailable as e:
            self.abort(streams)
            raise APIError(503, str(e)) from None
        except AdapterGone as e:
            self.abort(streams)
            raise APIError(404, f"The model `{e.name}` does not exist: the LoRA adapter {e.name!r} is not loaded "
                                "(it was unloaded)", param="model") from None
        except BaseException:
            self.abort(streams)  # the ones already sent; the failing one was never registered
            raise
        return streams

    def abort(self, streams: list[RequestStream]) -> None:
        for s in streams:
            self.client.abort(s.rid)

    async def collect(self, request: Request, streams: list[RequestStream]) -> list[list[TextOut]]:
        """Wait for every stream to finish; abort them all if the client disconnects first."""

        async def gather_one(s: RequestStream) -> list[TextOut]:
            return [o async for o in s.outputs()]

        try:
            return list(await until_gone(request, asyncio.gather(*(gather_one(s) for s in streams))))
        except ClientGone:
            self.abort(streams)
            raise

    async def merge(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, TextOut]]:
        """Outputs of several streams as they come, tagged with the stream's index."""
        if len(streams) == 1:
            async for o in streams[0].outputs():
                yield 0, o
            return
        q: asyncio.Queue[tuple[int, TextOut]] = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            async for o in s.outputs():
                q.put_nowait((i, o))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        left = len(streams)
        try:
            while left:
                i, o = await q.get()
                if o.finish_reason is not None:
                    left -= 1
                yield i, o
        finally:
            for t in tasks:
                t.cancel()


async def until_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled and ``ClientGone``
    raised (the body has been read already)."""
    task = asyncio.ensure_future(work)
    gone: asyncio.Future[None] = asyncio.ensure_future(wait_disconnect(request))
    try:
        waiting: list[asyncio.Future[Any]] = [task, gone]
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task not in done:
        raise ClientGone
    return task.result()


async def wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
