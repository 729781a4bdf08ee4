"""The API process's side of the engine: submit requests, stream their outputs, abort them.

Owns the two ZeroMQ channels of the API process (PUSH to the scheduler, PULL from the
detokenizer), one ``RequestStream`` per in-flight request, the engine's latest load figures,
readiness, and the latency metrics (observed here, as outputs arrive).

Invariants:

* Every submitted request ends: either its stream sees a finish (stop, length, abort, error)
  from the engine, or ``abort`` is called (client gone, server shutting down), which tells
  the scheduler to free its slots and ends the stream locally. ``abort`` is idempotent and
  safe after the finish.
* No torch is imported here (the tokenizer is a Hugging Face fast tokenizer).
* One receiver task dispatches every ``TextBatch`` to the streams' queues; routes only await
  their own queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from lockgate.config import HEARTBEAT_SECONDS, read_chat_template
from lockgate.ipc.channel import AsyncReceiver, AsyncSender
from lockgate.ipc.child import freeze_heap
from lockgate.ipc.messages import (
    AbortRequest,
    AdapterCard,
    AdapterReply,
    AddRequest,
    DetokenizerReady,
    EngineStats,
    Fatal,
    Heartbeat,
    LoadAdapter,
    Ready,
    TextBatch,
    TextOut,
    ToApi,
    UnloadAdapter,
)
from lockgate.sampling import SamplingParams
from lockgate.server.metrics import Metrics
from lockgate.tokenizer.tokenizer import Tokenizer, import_renderer, load_tokenizer, warm_up

log = logging.getLogger("lockgate.api")


def process_state(pid: int | None) -> str:
    """", stopped" / ", zombie" ... as Linux reports the process, or "" if it cannot be read."""
    names = {"T": "stopped", "t": "stopped by a tracer", "Z": "zombie", "D": "in uninterruptible sleep",
             "R": "running", "S": "sleeping"}
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return f", {names.get(state, 'state ' + state)}"


class EngineUnavailable(RuntimeError):
    """The engine is not ready yet or has failed."""


class AdapterGone(LookupError):
    """A request names a LoRA adapter that is not loaded, or is being unloaded."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


@dataclass(eq=False)
class SampleGroup:
    """The n engine requests of one prompt (a parallel sampling group), for the per-group metrics."""

    n: int
    max_tokens: int
    pending: int = 0
    most_generated: int = 0


@dataclass(eq=False)
class RequestStream:
    rid: str
    num_prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue[TextOut] = field(default_factory=asyncio.Queue)
    first_token: float | None = None
    last_token: float | None = None
    queue_seconds: float | None = None  # arrival -> admitted, as the scheduler measured it
    generated: int = 0
    group: SampleGroup | None = None
    finished: bool = False
    tenant: str = "default"  # whom it is served for (server/tenants.py)
    label: str = "default"  # the tenant's metrics label (bounded cardinality)

    async def outputs(self) -> AsyncIterator[TextOut]:
        """Every output of the request, the last one carrying its finish reason."""
        while True:
            out = await self.queue.get()
            yield out
            if out.finish_reason is not None:
                return


class EngineClient:
    def __init__(self, model: str, model_spec: str, scheduler_endpoint: str, api_endpoint: str,
                 metrics: Metrics, heartbeat_timeout: float = 30.0,
                 on_unresponsive: Callable[[str, str], None] | None = None, chat_template: str | None = None) -> None:
        self.model = model  # the name clients use
        self.model_spec = model_spec  # the --model value; "sim" selects the byte tokenizer
        self.chat_template = chat_template  # --chat-template (a file or the text), None: the model's own
        self.ctx = zmq.asyncio.Context()
        self.to_scheduler = AsyncSender(self.ctx, scheduler_endpoint)
        self.inbox: AsyncReceiver[ToApi] = AsyncReceiver(self.ctx, api_endpoint, ToApi)
        self.metrics = metrics
        self.streams: dict[str, RequestStream] = {}
        self.info: Ready | None = None
        self.tokenizer: Tokenizer | None = None
        self.stats: EngineStats | None = None
        self.ready = asyncio.Event()
        self.failed: str | None = None
        self.child_pids: dict[str, int] = {}
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}-{int(time.time()):x}"
        self._task: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self.heartbeat_timeout = heartbeat_timeout
        self.on_unresponsive = on_unresponsive  # (process, message): the server's way out (launch.serve)
        self.last_heard: dict[str, float] = {}  # process -> monotonic time of its last sign of life
        self.adapters: dict[str, AdapterCard] = {}  # LoRA adapters loaded in the engine, by name
        self.unloaded: set[str] = set()  # names of adapters unloaded since (a request naming one is a 404)
        self._adapter_replies: dict[str, asyncio.Future[AdapterReply]] = {}
        self._unloading: dict[str, str] = {}  # adapter name -> ticket of its unload, sent and not yet answered

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self.model_spec != "sim" or self.chat_template is not None:  # (sim: its own format, no Jinja)
            threading.Thread(target=import_renderer, name="renderer-import", daemon=True).start()
        self._task = asyncio.create_task(self._receive(), name="engine-receiver")
        self._monitor = asyncio.create_task(self._watch_heartbeats(), name="heartbeat-monitor")

    async def close(self) -> None:
        for task in (self._task, self._monitor):
            if task is not None:
                task.cancel()
        self.to_scheduler.close()
        self.inbox.close()
        self.ctx.term()

    def fail(self, message: str) -> None:
        """The engine is gone: end every stream with an error."""
        self.failed = message
        self.ready.clear()
        for rid in list(self.streams):
            self._deliver(TextOut(rid=rid, text="", ids=[], finish_reason="error", error=message))

    def cut_all(self, message: str) -> int:
        """End every unfinished request now with finish reason ``abort`` and ``message`` as its error
        (streams get a last event saying so), and tell the scheduler to free them. Returns how many."""
        live = [rid for rid, st in self.streams.items() if not st.finished]
        for rid in live:
            self._deliver(TextOut(rid=rid, text="", ids=[], finish_reason="abort", error=message))
            if self.failed is None:
                self.to_scheduler.send_nowait(AbortRequest(rid))
        return len(live)

    # ---- requests ------------------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        """Requests accepted that have not received their first token yet."""
        return sum(1 for s in self.streams.values() if s.first_token is None)

    def tenant_load(self) -> dict[str, tuple[int, int]]:
        """Per tenant metrics label: (requests waiting for their first token, requests in flight)."""
        out: dict[str, tuple[int, int]] = {}
        for s in self.streams.values():
            q, f = out.get(s.label, (0, 0))
            out[s.label] = (q + (s.first_token is None), f + 1)
        return out

    def num_queued_for(self, tenant: str) -> int:
        """Requests of ``tenant`` accepted that have not received their first token yet."""
        return sum(1 for s in self.streams.values() if s.first_token is None and s.tenant == tenant)

    def new_id(self, kind: str) -> str:
        return f"{kind}-{self._prefix}-{next(self._ids)}"

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams,
               group: SampleGroup | None = None, tenant: str = "default", label: str = "default") -> RequestStream:
        """Send one request. ``AdapterGone`` if its LoRA adapter is not loaded (any more): checked
        here, in the same event-loop turn as the send, so no request for an adapter leaves after the
        adapter's unload did (the channel is FIFO: one sent before it keeps its adapter to the end)."""
        if self.failed is not None or self.info is None:
            raise EngineUnavailable(self.failed or "the model is still loading")
        if params.lora is not None and params.lora not in self.adapters:
            raise AdapterGone(params.lora)
        stream = RequestStream(rid, len(prompt_ids), group=group, tenant=tenant, label=label)
        if group is not None:
            group.pending += 1
        self.streams[rid] = stream
        try:
            self.to_scheduler.send_nowait(AddRequest(rid, list(prompt_ids), params, time.time(), tenant))
        except BaseException:
            del self.streams[rid]  # never sent: it holds no queue place and no engine state
            raise
        return stream

    async def change_adapter(self, msg: LoadAdapter | UnloadAdapter, timeout: float) -> AdapterReply:
        """Send a LoRA load/unload to the scheduler and wait for its answer (``msg.ticket`` is
        set here); EngineUnavailable if the engine is down or does not answer within ``timeout``.
        An unload takes the adapter out of ``adapters`` at once: from here on a request naming it is
        a 404, and every one sent before keeps it (the scheduler unloads after them)."""
        if self.failed is not None or self.info is None:
            raise EngineUnavailable(self.failed or "the model is still loading")
        msg.ticket = self.new_id("lora")
        if isinstance(msg, UnloadAdapter):
            self._unloading[msg.name] = msg.ticket
            if msg.name in self.adapters:
                del self.adapters[msg.name]
                self.unloaded.add(msg.name)
        reply: asyncio.Future[AdapterReply] = asyncio.get_running_loop().create_future()
        self._adapter_replies[msg.ticket] = reply
        try:
            self.to_scheduler.send_nowait(msg)
            return await asyncio.wait_for(reply, timeout)
        except TimeoutError:
            raise EngineUnavailable(f"the engine did not answer the adapter change within {timeout:g}s") from None
        finally:
            self._adapter_replies.pop(msg.ticket, None)

    def _group_done(self, stream: RequestStream) -> None:
        g = stream.group
        if g is None:
            return
        g.pending -= 1
        g.most_generated = max(g.most_generated, stream.generated)
        if g.pending == 0:
            self.metrics.group_finished(g.n, g.max_tokens, g.most_generated)

    def abort(self, rid: str) -> None:
        stream = self.streams.pop(rid, None)
        if stream is None or stream.finished:
            return
        stream.finished = True
        if self.failed is None:
            self.to_scheduler.send_nowait(AbortRequest(rid))
        self.metrics.requests.labels(*self.metrics.key, "abort").inc()

    # ---- receiving -----------------------------------------------------------------------
    async def _watch_heartbeats(self) -> None:
        """Once ready, fail the engine if the scheduler or the detokenizer falls silent for longer than
        ``heartbeat_timeout`` (stopped, hung, or its process frozen): every in-flight request gets an
        error, /health answers 503 naming the process, and ``on_unresponsive`` stops the server."""
        while True:
            before = time.monotonic()
            await asyncio.sleep(HEARTBEAT_SECONDS)
            now = time.monotonic()
            if now - before > 2 * HEARTBEAT_SECONDS:
                continue  # this loop itself was held up: let the receiver read what queued meanwhile
            if self.failed is not None or not self.ready.is_set():
                continue
            # The detokenizer carries the scheduler's beats: if it is silent, it is the one to name.
            for process in ("detokenizer", "scheduler"):
                silent = now - self.last_heard.get(process, now)
                if silent > self.heartbeat_timeout:
                    pid = self.child_pids.get(process)
                    message = (f"the {process} process (pid {pid}{process_state(pid)}) has not answered for "
                               f"{silent:.0f}s (--heartbeat-timeout {self.heartbeat_timeout:g}); the server is "
                               "shutting down for its supervisor to restart it")
                    log.error("%s", message)
                    self.fail(message)
                    if self.on_unresponsive is not None:
                        self.on_unresponsive(process, message)
                    break

    async def _receive(self) -> None:
        while True:
            msg = await self.inbox.recv()
            if isinstance(msg, Heartbeat):
                self.last_heard[msg.process] = time.monotonic()
                if msg.process == "scheduler":
                    self.last_heard["detokenizer"] = self.last_heard["scheduler"]  # it forwarded the beat
                continue
            self.last_heard["scheduler"] = self.last_heard["detokenizer"] = time.monotonic()
            if isinstance(msg, TextBatch):
                self.stats = msg.stats
                self.metrics.update_stats(msg.stats)
                for out in msg.outs:
                    self._deliver(out)
            elif isinstance(msg, DetokenizerReady):
                await self._on_ready(msg)
            elif isinstance(msg, AdapterReply):
                for name, ticket in list(self._unloading.items()):
                    if ticket == msg.ticket:
                        del self._unloading[name]
                # a reply made before an unload the API already sent must not bring that adapter back
                now = {a.name: a for a in msg.adapters if a.name not in self._unloading}
                self.unloaded = (self.unloaded | (set(self.adapters) - set(now))) - set(now)
                self.adapters = now
                self.metrics.keep_adapters(set(self.adapters))
                waiter = self._adapter_replies.get(msg.ticket)
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)
            elif isinstance(msg, Fatal):
                log.error("%s process reported a fatal error: %s", msg.process, msg.message)
                self.fail(f"{msg.process}: {msg.message}")

    async def _on_ready(self, msg: DetokenizerReady) -> None:
        info = msg.ready
        self.child_pids = {"scheduler": info.scheduler_pid, "detokenizer": msg.detokenizer_pid}
        template = None if self.chat_template is None else read_chat_template(self.chat_template)
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.model_spec, info.model_dir, template)
        await asyncio.to_thread(warm_up, self.tokenizer)  # the first chat request renders at once
        self.info = info
        self.adapters = {a.name: a for a in info.adapters}
        self.metrics.on_ready(info.max_model_len, info.capacity, info.dtype, info.kv_cache_dtype)
        self.last_heard = {"scheduler": time.monotonic(), "detokenizer": time.monotonic()}
        freeze_heap()
        self.ready.set()  # /health answers 200 from here; lockgate.server.launch logs the ready line

    def _deliver(self, out: TextOut) -> None:
        stream = self.streams.get(out.rid)
        if stream is None:
            return  # aborted here already
        now = time.monotonic()
        m, key = self.metrics, self.metrics.key
        if out.queue_seconds is not None:
            stream.queue_seconds = out.queue_seconds
            m.queue.labels(*key).observe(out.queue_seconds)
        if out.ids:
            if stream.first_token is None:
                stream.first_token = now
                m.ttft.labels(*key).observe(now - stream.arrival)
                m.tenant_ttft.labels(*key, stream.label).observe(now - stream.arrival)
            elif stream.last_token is not None:
                gap = (now - stream.last_token) / len(out.ids)
                for _ in out.ids:  # one observation per token (a step can bring several)
                    m.itl.labels(*key).observe(gap)
            stream.last_token = now
            stream.generated += len(out.ids)
            m.generation_tokens.labels(*key).inc(len(out.ids))
            m.tenant_generation_tokens.labels(*key, stream.label).inc(len(out.ids))
        if out.finish_reason is not None:
            stream.finished = True
            del self.streams[out.rid]
            prompt = out.num_prompt_tokens or stream.num_prompt_tokens
            first = None if stream.first_token is None else stream.first_token - stream.arrival
            m.finished(prompt, stream.generated, out.cached_tokens, now - stream.arrival, stream.queue_seconds, first)
            m.requests.labels(*key, out.finish_reason).inc()
            m.tenant_prompt_tokens.labels(*key, stream.label).inc(prompt)
            self._group_done(stream)
        stream.queue.put_nowait(out)
