"""The scheduler process: receive, schedule, run, update, send (docs/design.md, habit 6).

Owns one ``EngineCore`` (scheduler + runner) and the process around it: it loads the model,
warms it up, announces ``Ready``, then loops over

    receive  AddRequest / AbortRequest / Shutdown from the API and the detokenizer
    step     one engine step (schedule -> execute -> update) while there is work
    send     one StepBatch per step (every request's new tokens + the engine's load figures and queue
             forecast), and one more, before the step, when requests arrived (so the forecast
             counts them even while a long step runs)

It blocks on its socket when idle (no polling sleeps) and wakes once a second to check that
its parent is alive, so it never outlives the server.

Invariants:

* Every request the API sends ends with exactly one ``TokenOut`` carrying a finish reason
  (stop, length, abort or error), so the API and detokenizer never wait for a dead request.
* ``Register`` for a request reaches the detokenizer before its first token (same channel).
* A step that raises fails the requests in that step's batch with ``error`` (their slots
  return to the pool) and the process goes on serving.
* Watchdog: a step running longer than ``--watchdog-timeout`` makes a side thread log the
  running batch and exit the process with ``WATCHDOG_EXIT_CODE``; the API process sees the
  death and shuts the server down.

Started by ``lockgate.server.launch`` as ``python -m lockgate.engine.process ARGS_JSON``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import zmq

from lockgate.config import HEARTBEAT_SECONDS
from lockgate.engine.core import OVERLAP_SWITCH_INTERVAL, EngineCore
from lockgate.ipc.channel import Receiver, Sender
from lockgate.ipc.child import (
    TENSOR_PARALLEL_EXIT_CODE,
    WATCHDOG_EXIT_CODE,
    SchedulerProcArgs,
    child_startup,
    freeze_heap,
)
from lockgate.ipc.messages import (
    AbortRequest,
    AdapterCard,
    AdapterReply,
    AddRequest,
    EngineStats,
    Fatal,
    Heartbeat,
    LoadAdapter,
    Ready,
    Register,
    Shutdown,
    StepBatch,
    TokenOut,
    ToScheduler,
    UnloadAdapter,
    Wake,
)
from lockgate.runner.threads import PIN_ENV, cpus_to_pin, pin_opted_out, pin_torch_threads  # noqa: F401  (re-exported)
from lockgate.scheduler.request import FinishReason, Request
from lockgate.scheduler.scheduler import RequestRejected, StepOutput

log = logging.getLogger("lockgate.scheduler")

PARENT_CHECK_MS = 1000


class Watchdog:
    """Exits the process if an armed step is not disarmed within ``timeout`` seconds.

    Arming and disarming are two attribute writes (atomic under the GIL), called around every
    engine step; the side thread polls every ``timeout / 4`` seconds (at most 1 s), so a stuck
    step is caught between ``timeout`` and ``1.25 * timeout`` after it began. (Waking the thread
    through a condition variable on every arm cost two thread switches per step: 0.2-0.3 ms of a
    10 ms batch-1 decode step on an Emerald Rapids CPU, py-spy on the scheduler.)"""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._armed: tuple[float, Callable[[], str]] | None = None  # (deadline, describe the batch)
        self._poll = min(1.0, timeout / 4)
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def arm(self, describe: Callable[[], str]) -> None:
        self._armed = (time.monotonic() + self.timeout, describe)

    def disarm(self) -> None:
        self._armed = None

    def _watch(self) -> None:
        while True:
            time.sleep(self._poll)
            armed = self._armed
            if armed is None or time.monotonic() < armed[0]:
                continue
            log.critical("watchdog: an engine step has run for more than --watchdog-timeout %.1fs; "
                         "exiting. Running batch: %s", self.timeout, armed[1]())
            logging.shutdown()
            os._exit(WATCHDOG_EXIT_CODE)


class SchedulerProcess:
    def __init__(self, args: SchedulerProcArgs) -> None:
        self.args = args
        self.ctx = zmq.Context()
        self.inbox: Receiver[ToScheduler] = Receiver(self.ctx, args.in_endpoint, ToScheduler)
        self.out = Sender(self.ctx, args.detok_endpoint)
        try:
            pin_opted_out(os.environ.get(PIN_ENV))  # a bad value stops the start, before the model loads
            self._wake_lock = threading.Lock()
            self._wake_out = Sender(self.ctx, args.in_endpoint)  # side threads -> this loop (Wake)
            self.engine = EngineCore(args.engine, wake=self._wake)
            if args.warmup:
                self.engine.on_runner_thread(self.engine.runner.warmup)
            if args.engine.scheduler.overlap_schedule:  # hand the interpreter lock to a launched step quickly
                sys.setswitchinterval(OVERLAP_SWITCH_INTERVAL)
        except Exception as e:
            if isinstance(e, ValueError | OSError):  # bad model, flags or files: the message says it all
                log.error("failed to start the engine: %s", e)
            else:
                log.exception("failed to start the engine")
            self.out.send(Fatal("scheduler", f"failed to start the engine: {e}"))
            raise
        self.watchdog = Watchdog(args.watchdog_timeout)
        self.requests: dict[str, tuple[Request, float]] = {}  # rid -> (request, seconds in API + IPC)
        self.first_sent: set[str] = set()
        self.pending: list[TokenOut] = []  # outputs produced outside a step (aborts, rejections)
        self.decode_steps = 0
        self.decode_tokens = 0
        self.decode_t0 = time.monotonic()
        r = self.engine.runner
        self.tensor_parallel = r.tensor_parallel
        if self.tensor_parallel is not None:
            self.tensor_parallel.on_death = self._rank_died
        self._heartbeats()
        self.engine.on_runner_thread(pin_torch_threads)  # the thread that runs the steps, and its team
        freeze_heap()
        self.out.send(Ready(model=args.model_name, model_dir=None if r.model_dir is None else str(r.model_dir),
                            max_model_len=r.max_model_len, capacity=r.capacity, vocab_size=r.vocab_size,
                            eos_token_ids=list(r.eos_token_ids), dtype=str(r.dtype),
                            scheduler_pid=os.getpid(), adapters=self._adapter_cards(),
                            kv_cache_dtype=r.kv_cache_dtype_name))

    def _heartbeats(self) -> None:
        """A side thread with its own socket tells the detokenizer (and so the API) every second that
        this process runs. It needs the GIL only briefly, which torch releases inside every op, so a
        long step does not silence it; a stopped or hung process does."""
        beat = Sender(self.ctx, self.args.detok_endpoint)
        msg = Heartbeat("scheduler", os.getpid())

        def run() -> None:
            while True:
                beat.try_send(msg)  # a detokenizer that stopped reading is the API's to notice
                time.sleep(HEARTBEAT_SECONDS)

        threading.Thread(target=run, name="heartbeat", daemon=True).start()

    def _rank_died(self, message: str) -> None:
        """A tensor-parallel rank is gone (called on its watcher thread): the model cannot run, so
        the server ends, with a message naming the rank (``Fatal``, then the exit code)."""
        assert self.tensor_parallel is not None
        self.tensor_parallel.kill()  # the other ranks too: nothing is left running
        log.critical("%s; ending the server", message)
        Sender(self.ctx, self.args.detok_endpoint).send(Fatal("scheduler", message))  # this thread's own socket
        time.sleep(0.5)  # let it leave: os._exit does not flush ZeroMQ's queues
        logging.shutdown()
        os._exit(TENSOR_PARALLEL_EXIT_CODE)

    def _wake(self) -> None:
        """Called from side threads (a grammar compiled, an adapter read): wake the loop if it is
        blocked on its socket."""
        with self._wake_lock:
            self._wake_out.try_send(Wake())

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            msgs = self.inbox.drain() if self.engine.has_work else self._wait()
            if not self.handle(msgs):
                self.out.send(Shutdown())  # the detokenizer goes too
                return
            self.adapter_reads()
            if any(isinstance(m, AddRequest) for m in msgs):
                self.send([])  # the forecast with the new arrivals, before a step that may take long
            if self.engine.has_work:
                self.step()
            self._rejected()
            if self.pending:
                self.send([])
            if os.getppid() != self.args.parent_pid:
                log.error("parent process %d is gone; exiting", self.args.parent_pid)
                self.out.send(Shutdown())
                return

    def _wait(self) -> list[ToScheduler]:
        """Idle: block on the socket, waking every second to check the parent."""
        while True:
            msg = self.inbox.recv(timeout_ms=PARENT_CHECK_MS)
            if msg is not None:
                return [msg, *self.inbox.drain()]
            if os.getppid() != self.args.parent_pid:
                return [Shutdown()]

    def handle(self, msgs: list[ToScheduler]) -> bool:
        """Apply incoming messages; False on Shutdown."""
        for m in msgs:
            if isinstance(m, AddRequest):
                self.add(m)
            elif isinstance(m, AbortRequest):
                if self.engine.abort(m.rid) is not None:
                    self.pending.append(self._token_out(m.rid, None, FinishReason.ABORT))
            elif isinstance(m, LoadAdapter | UnloadAdapter):
                self.adapter_change(m)
            elif isinstance(m, Wake):
                pass  # what finished off the loop is taken in below (adapter reads) or by the next step
            else:
                log.info("shutdown requested; aborting %d running and %d waiting requests",
                         len(self.engine.running), self.engine.num_waiting)
                return False
        return True

    def _adapter_cards(self) -> list[AdapterCard]:
        return [AdapterCard(name, info.path, info.rank, info.modules) for name, (_, info) in self.engine.adapters.items()]

    def adapter_change(self, m: LoadAdapter | UnloadAdapter) -> None:
        """Load or unload a LoRA adapter; the answer goes back to the API (an error there changes
        nothing and leaves every request running). A load's files are read and checked on a side
        thread (``EngineCore.read_adapter_aside``) and answered by ``adapter_reads`` once done."""
        error, status = None, 200
        try:
            if isinstance(m, LoadAdapter):
                self.engine.read_adapter_aside(m.ticket, m.name, m.path, replace=m.replace)
                return
            if m.name not in self.engine.adapters:
                error, status = f"no LoRA adapter named {m.name!r} is loaded", 404
            else:
                self.engine.unload_adapter(m.name)
                log.info("LoRA adapter %r unloaded", m.name)
        except (ValueError, OSError) as e:
            error, status = str(e), 400
            log.warning("LoRA adapter %r not loaded: %s", m.name, e)
        self.out.send(AdapterReply(m.ticket, self._adapter_cards(), error, status))

    def adapter_reads(self) -> None:
        """Answer the loads whose side-thread read ended (the adapter is registered if it was good)."""
        for ticket, name, error in self.engine.take_adapter_reads():
            if error is not None:
                log.warning("LoRA adapter %r not loaded: %s", name, error)
            self.out.send(AdapterReply(ticket, self._adapter_cards(), error, 400 if error is not None else 200))

    def add(self, m: AddRequest) -> None:
        self.out.send(Register(m.rid, list(m.params.stop), m.params.skip_special_tokens))
        try:
            req = self.engine.add_request(m.prompt_ids, m.params, rid=m.rid, tenant=m.tenant)
        except RequestRejected as e:
            self.pending.append(TokenOut(m.rid, [], finish_reason="error", error=str(e), status=e.status,
                                         num_prompt_tokens=len(m.prompt_ids)))
            return
        self.requests[m.rid] = (req, max(0.0, time.time() - m.arrival_time))

    def _rejected(self) -> None:
        """Requests refused after they were queued (a grammar that failed to compile off the loop)."""
        while self.engine.rejected:
            rid, why = self.engine.rejected.pop()
            out = self._token_out(rid, None, None)
            out.finish_reason, out.error, out.status = "error", why, 400
            self.pending.append(out)

    def step(self) -> None:
        eng = self.engine
        self.watchdog.arm(self._describe_batch)
        try:
            events = eng.step()
        except Exception as e:
            self.watchdog.disarm()
            self._fail_running(e)
            return
        self.watchdog.disarm()
        self.pending.extend(self._token_out(ev.rid, ev, ev.finish_reason) for ev in events)
        self.send(events)

    def send(self, events: list[StepOutput]) -> None:
        st = self.engine.stats()
        fc = self.engine.forecast()
        stats = EngineStats(running=st.running, waiting=st.waiting, slots_used=st.slots_used,
                            slots_free=st.slots_free, slots_evictable=st.slots_evictable, capacity=st.capacity,
                            headroom=st.headroom, num_steps=self.engine.num_steps,
                            draft_tokens=st.draft_tokens, accepted_tokens=st.accepted_tokens,
                            retractions=st.retractions, recomputed_tokens=st.recomputed_tokens, drafts=st.drafts, accepted_per_pos=list(st.accepted_per_pos),
                            step_tokens=0 if self.engine.last_step is None else self.engine.last_step.tokens,
                            queue_eta_s=fc.queue_eta_s, drain_eta_s=fc.drain_eta_s,
                            prefill_backlog_tokens=fc.prefill_backlog_tokens,
                            decode_backlog_tokens=fc.decode_backlog_tokens,
                            prefill_tokens_per_s=fc.prefill_tokens_per_s, decode_step_s=fc.decode_step_s,
                            queue_blocked=fc.blocked, forecast_time=time.monotonic())
        lora = self.engine.scheduler.lora
        if lora is not None:
            load = self.engine.adapter_load()
            stats.lora_running = {n: r for n, (r, _) in load.items()}
            stats.lora_waiting = {n: w for n, (_, w) in load.items()}
            stats.lora_loads, stats.lora_evictions = lora.counters.loads, lora.counters.evictions
            stats.max_loras = lora.size
        self.out.send(StepBatch(self.pending, stats))
        self.pending = []
        if events:
            self._log_step(stats)

    # ---- helpers -------------------------------------------------------------------------
    def _token_out(self, rid: str, ev: StepOutput | None, reason: FinishReason | None) -> TokenOut:
        req, api_delay = self.requests.get(rid, (None, 0.0))
        out = TokenOut(rid, ev.new_token_ids if ev else [], finish_reason=reason.value if reason else None)
        if ev is not None and ev.error is not None:  # the request's own failure (its constraint): a 400
            out.error, out.status = ev.error, 400
        if req is not None:
            out.num_prompt_tokens, out.num_output_tokens = req.num_prompt, req.num_output
            if ev is not None:  # as of that step (with overlap scheduling the next one is already launched)
                out.num_output_tokens = ev.num_output_tokens
            out.cached_tokens = req.cached_tokens
            if req.params.logprobs is not None and ev is not None:
                out.logprobs = ev.new_logprobs
                out.top = ev.new_top if req.params.logprobs else None
            if rid not in self.first_sent and req.admit_time is not None:
                out.queue_seconds = api_delay + req.admit_time - req.arrival_time
                self.first_sent.add(rid)
        if reason is not None:
            self.requests.pop(rid, None)
            self.first_sent.discard(rid)
        return out

    def _fail_running(self, e: Exception) -> None:
        victims = self.engine.fail_running()
        log.exception("engine step failed; failing the %d requests of the running batch", len(victims))
        for rid in victims:
            out = self._token_out(rid, None, None)
            out.finish_reason, out.error = "error", f"internal error in the engine step: {type(e).__name__}: {e}"
            self.pending.append(out)

    def _describe_batch(self) -> str:
        rows = [f"{r.rid}(prompt={r.num_prompt}, computed={r.num_computed}, out={r.num_output})"
                for r in self.engine.running]
        tp = "" if self.tensor_parallel is None else f"; tensor-parallel {self.tensor_parallel.describe()}"
        return f"{len(rows)} running: " + ", ".join(rows[:64]) + (" ..." if len(rows) > 64 else "") + tp

    def _log_step(self, st: EngineStats) -> None:
        info = self.engine.last_step
        if info is None:
            return
        usage = st.slots_used / max(st.capacity, 1)
        if info.num_prefill_tokens:
            log.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                     "#running-req: %d, #queue-req: %d", info.num_new_seqs, info.num_prefill_tokens, info.num_cached_tokens, usage,
                     st.running, st.waiting)
        if info.num_decode:
            self.decode_steps += 1
            self.decode_tokens += info.num_generated  # accepted guesses included
            if self.decode_steps % self.args.decode_log_interval == 0:
                now = time.monotonic()
                tput = self.decode_tokens / max(now - self.decode_t0, 1e-9)
                spec = (f", accepted guesses: {st.accepted_tokens}/{st.draft_tokens}" if st.draft_tokens else "")
                log.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                         "gen throughput (token/s): %.2f, #queue-req: %d%s", st.running, st.slots_used, usage, tput,
                         st.waiting, spec)
                self.decode_tokens, self.decode_t0 = 0, now


def main(argv: list[str] | None = None) -> int:
    args = child_startup(argv, SchedulerProcArgs, "scheduler")
    try:
        proc = SchedulerProcess(args)
    except Exception:
        return 1
    proc.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
