"""EngineCore: the one place where the scheduler meets a runner.

Owns one scheduler and one runner and turns them into a step function:
schedule -> execute -> update. Callers (the scheduler process, the offline ``LLM``) use only
this object's methods, never the scheduler behind it. The offline ``LLM`` drives it in-process; the server's
scheduler process drives the very same object from its event loop (docs/design.md, habit 12).

LoRA adapters (``load_adapter`` / ``unload_adapter``, ``--lora-modules`` at start): the engine's
``AdapterRegistry`` (engine/adapters.py) names them (a fresh number per load: the prefix-cache
namespace, so a name loaded again never reuses KV computed under its old weights), the runner reads
and keeps their weights, the scheduler puts them into the runner's ``--max-loras`` slots (the
registry's ``AdapterSlots``, given to the scheduler at construction). An unloaded adapter takes no
new requests; its weights go once no request that named it is left (checked after every step).

Overlap scheduling (``--overlap-schedule``): the runner computes on its own thread, and ``step``
launches the next step before it returns, so while the model computes step N the caller handles
its messages and sends step N-1's tokens, and the next ``step`` call builds step N+1 (admission,
prefix cache, plan) before it waits for N's result (SGLang's overlap event loop). Step N is
committed when launched (``overlap.commit``: its rows count as computed, each request it
samples for holds a placeholder token). N+1 is launched before N's result is in: the runner thread
copies N's tokens into N+1's decode rows (``overlap.feed`` says which go where) when N ends and
starts N+1 at once, so no hand-off between threads separates the two steps (SGLang resolves its
future token ids on the device the same way). Each ``step`` call returns the previous step's
events. What needs a token's value to plan the next step (guesses to verify, a grammar's
mask, penalties, an adapter's slot) makes that call wait for the result first
(``overlap.needs_result``). Invariant: between calls at most one step is in flight, committed
unless it has guesses; only its own thread touches the runner while it runs, and slots freed
meanwhile are written only by steps launched after it (the runner runs steps in order).
Both threads run Python under one interpreter lock: torch releases it inside every op, so the
scheduling runs while the model's kernels do, and the scheduler process shortens the interpreter's
switch interval (``OVERLAP_SWITCH_INTERVAL``) so a launched step is not kept waiting for the lock
by the engine's own Python (CPython's default lets a waiting thread wait 5 ms).

Step statistics for the operator's log lines (prefill: #new-seq, #new-token, token usage,
#queue-req; decode: #running-req, #token, gen throughput) are kept here, and so is the queue
forecast (``forecast()``: the step rates measured on every step, engine/forecast.py, applied to the
scheduler's backlog; recomputed when a request arrived or left since, else at most every
``FORECAST_EVERY`` seconds, so a step of a deep queue does not pay for it each time).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from lockgate.checkpoint.peft import AdapterInfo
from lockgate.config import EngineConfig
from lockgate.engine.adapters import AdapterRegistry
from lockgate.engine.forecast import Forecast, StepRates, estimate
from lockgate.engine.grammar_wait import GrammarWait
from lockgate.grammar import GrammarCompiler, GrammarError
from lockgate.plan import ForwardPlan, ForwardResult
from lockgate.runner import Runner, make_runner
from lockgate.sampling import SamplingParams
from lockgate.scheduler import overlap
from lockgate.scheduler.fairness import DEFAULT_TENANT
from lockgate.scheduler.plan_builder import ScheduledStep
from lockgate.scheduler.request import Request
from lockgate.scheduler.scheduler import RequestRejected, Scheduler, SchedulerStats, StepOutput
from lockgate.tokenizer.tokenizer import load_tokenizer

log = logging.getLogger("lockgate.engine")

T = TypeVar("T")
OVERLAP_SWITCH_INTERVAL = 0.0005  # seconds (sys.setswitchinterval) in a process that overlaps steps
FORECAST_EVERY = 0.05  # seconds a forecast is reused while no request arrives or leaves
GRAMMAR_CACHE = 32  # compiled grammars kept (a large schema's matcher holds tens of MB)


@dataclass
class StepInfo:
    num_seqs: int  # plan rows (a speculating request counts once per guess row)
    num_new_seqs: int
    num_prefill_tokens: int
    num_decode: int
    seconds: float
    num_cached_tokens: int = 0
    num_generated: int = 0  # tokens appended to outputs (several per request when guesses were accepted)

    @property
    def tokens(self) -> int:
        """vLLM's iteration tokens: prompt tokens prefilled plus tokens generated."""
        return self.num_prefill_tokens + self.num_generated


@dataclass
class _InFlight:
    """A step launched on the runner's thread: its result arrives as (result, seconds it ran)."""

    step: ScheduledStep
    future: Future[tuple[ForwardResult, float]]


@dataclass
class _Feed:
    """Tokens a launched step waits for: its plan's ``rows`` take ``before``'s sampled tokens at ``src``."""

    rows: np.ndarray
    src: np.ndarray
    before: Future[tuple[ForwardResult, float]]


class EngineCore:
    def __init__(self, cfg: EngineConfig, runner: Runner | None = None, check_invariants: bool = False,
                 wake: Callable[[], None] | None = None) -> None:
        """``wake``: called from another thread when a request's grammar has compiled off the loop
        (the scheduler process wakes its idle loop with it); see ``engine.grammar_wait``."""
        self.cfg = cfg
        self.runner = runner if runner is not None else make_runner(cfg.model, cfg.cache)
        self.adapter_registry = AdapterRegistry(cfg.lora, self.runner, wake)
        self.scheduler = Scheduler(cfg.scheduler, capacity=self.runner.capacity,
                                   max_model_len=self.runner.max_model_len, vocab_size=self.runner.vocab_size,
                                   eos_token_ids=self.runner.eos_token_ids, seed=cfg.model.seed,
                                   cache_generated=self.runner.generated_kv_exact,
                                   lora=self.adapter_registry.slots)
        self.check = check_invariants
        self._grammars: GrammarCompiler | None = None
        self.grammar_wait = GrammarWait(lambda: self.grammars, wake)
        for name, path in cfg.lora.modules:  # (none unless LoRA is on: LoraConfig checks)
            self.load_adapter(name, path)
        self.rejected: list[tuple[str, str]] = []  # (rid, why): parked requests refused after add_request returned
        # constrained decoding's own cost: steps with grammar rows, those rows, seconds filling their masks
        self.grammar_steps = self.grammar_rows = 0
        self.grammar_seconds = 0.0
        self.last_step: StepInfo | None = None
        self.num_steps = 0
        self.rates = StepRates()
        self._forecast: tuple[float, Forecast] | None = None  # (time.monotonic() made, forecast)
        # overlap scheduling: the runner's own thread and the step it computes
        self._runner_thread = (ThreadPoolExecutor(1, thread_name_prefix="runner")
                               if cfg.scheduler.overlap_schedule else None)
        self._inflight: _InFlight | None = None
        self._failed_committed = False  # a committed step failed: the prefix cache may hold KV never computed
        self._warn_if_overlap_has_no_cpu()
        sc = cfg.scheduler
        log.info("engine ready: KV capacity %d tokens, context %d, max running %d, prefill budget %d, "
                 "admission %s, policy %s, prefix cache %s, overlap schedule %s", self.runner.capacity,
                 self.runner.max_model_len, sc.max_running_requests, sc.max_prefill_tokens, sc.admission,
                 sc.schedule_policy, "off" if sc.disable_prefix_cache else "on",
                 "on" if sc.overlap_schedule else "off")

    def _warn_if_overlap_has_no_cpu(self) -> None:
        """Overlap scheduling where torch's threads take every CPU: the scheduler's thread then
        runs on their cores, and there it was measured slower than no overlap (docs/serving.md)."""
        if not self.cfg.scheduler.overlap_schedule or self.runner.model_dir is None:  # (sim: no torch threads)
            return
        import torch

        cpus, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
        if threads >= cpus:
            log.warning("overlap schedule on, but torch's %d threads take all %d CPUs: the scheduler's thread has "
                        "none of its own, and on such hosts overlap measured slower than without (docs/serving.md, "
                        "'Overlap scheduling')%s", threads, cpus,
                        f"; --num-threads {cpus - 1} leaves it one" if cpus > 1 else "")

    def on_runner_thread(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the thread that runs the steps (warm-up, pinning torch's threads: an OpenMP
        thread team belongs to the thread that starts it) and return what it returns."""
        if self._runner_thread is None:
            return fn()
        return self._runner_thread.submit(fn).result()

    def add_request(self, prompt_ids: list[int] | np.ndarray, params: SamplingParams,
                    rid: str | None = None, tenant: str = DEFAULT_TENANT) -> Request:
        """Queue a request; ``RequestRejected`` if it can never run here. A constrained request whose
        grammar is not compiled yet waits in ``grammar_wait`` (its compile runs off this thread) and
        joins the scheduler's queue at a later ``step``; if its grammar fails, its id and the reason
        land in ``rejected`` instead."""
        req = Request(rid or self.scheduler.new_request_id(), np.asarray(prompt_ids, dtype=np.int64), params,
                      tenant=tenant or DEFAULT_TENANT)
        if params.lora is not None:
            uid = self.adapter_registry.uid(params.lora)
            if uid is None:
                raise RequestRejected(f"the LoRA adapter {params.lora!r} is not loaded (loaded: "
                                      f"{', '.join(sorted(self.adapters)) or 'none'})", status=404)
            req.adapter = uid
        if self.scheduler.get(req.rid) is not None or req.rid in self.grammar_wait:
            raise RequestRejected(f"duplicate request id {req.rid!r}")
        self.scheduler.validate(req.prompt_ids, params.max_tokens)
        so = params.structured
        if so is not None and not self.grammars.cached(so):
            self.grammar_wait.park(req, so)
            return req
        if so is not None:
            try:
                req.grammar = self.grammars.matcher(so)
            except GrammarError as e:
                raise RequestRejected(str(e)) from None
        self.scheduler.submit(req)
        self._forecast = None
        return req

    def _take_compiled(self) -> None:
        """Requests whose grammar compiled join the scheduler's queue; refused ones go to ``rejected``."""
        for c in self.grammar_wait.take():
            if c.grammar is None:
                self.rejected.append((c.req.rid, c.error or "the constraint could not be compiled"))
                continue
            c.req.grammar = c.grammar
            try:
                self.scheduler.submit(c.req)
            except RequestRejected as e:
                self.rejected.append((c.req.rid, str(e)))
            self._forecast = None

    # ---- LoRA adapters (engine/adapters.py) --------------------------------------------
    @property
    def adapters(self) -> dict[str, tuple[int, AdapterInfo]]:
        """The loaded LoRA adapters: name -> (number, what was loaded). Read-only use."""
        return self.adapter_registry.names

    def load_adapter(self, name: str, path: str, replace: bool = False) -> AdapterInfo:
        """Read, check and register the PEFT adapter at ``path`` as ``name``, now; ValueError saying
        why not (LoRA off, the name taken, or what is wrong with the files). Other adapters and the
        requests in flight are not affected either way. ``replace``: an adapter already named so
        is swapped for this one once it loaded (its running requests finish on the old weights)."""
        info = self.adapter_registry.load(name, path, replace)
        self._reap_adapters()
        return info

    def read_adapter_aside(self, ticket: str, name: str, path: str, replace: bool = False) -> None:
        """``load_adapter`` with the files read and checked on a side thread while steps go on; the
        adapter is registered by the ``take_adapter_reads`` after the read ends. ValueError now if the
        name cannot be taken (LoRA off, the name taken or being read)."""
        self.adapter_registry.read_aside(ticket, name, path, replace)

    def take_adapter_reads(self) -> list[tuple[str, str, str | None]]:
        """Adapters whose side-thread read ended since the last call, registered now if they are
        good: (ticket, name, error or None), each once."""
        out = self.adapter_registry.take_reads()
        if out:
            self._reap_adapters()
        return out

    def unload_adapter(self, name: str) -> None:
        """Stop taking requests for ``name`` (KeyError if it is not loaded); its weights go once
        no request that named it is left."""
        self.adapter_registry.unload(name)
        self._reap_adapters()

    def _reap_adapters(self) -> None:
        if self.adapter_registry.unloading:
            sched = self.scheduler
            self.adapter_registry.reap(r.adapter for r in itertools.chain(sched.running, sched.waiting,
                                                                           self.grammar_wait.requests()))

    def adapter_load(self) -> dict[str, tuple[int, int]]:
        """Per loaded adapter: (running, waiting) requests."""
        names = {uid: name for name, (uid, _) in self.adapters.items()}
        running = Counter(names.get(r.adapter) for r in self.scheduler.running if r.adapter)
        waiting = Counter(names.get(r.adapter) for r in [*self.scheduler.waiting, *self.grammar_wait.requests()]
                          if r.adapter)
        return {name: (running.get(name, 0), waiting.get(name, 0)) for name in self.adapters}

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer (made on the first constrained request)."""
        if self._grammars is None:
            runner = self.runner
            model, model_dir = self.cfg.model.model, runner.model_dir
            self._grammars = GrammarCompiler(lambda: load_tokenizer(model, model_dir), runner.vocab_size,
                                             runner.eos_token_ids, cache_size=GRAMMAR_CACHE)
        return self._grammars

    def validate(self, prompt_ids: list[int] | np.ndarray, max_tokens: int) -> None:
        """Raise ``RequestRejected`` (a ValueError) if a request of this shape can never run here."""
        self.scheduler.validate(np.asarray(prompt_ids, dtype=np.int64), max_tokens)

    def abort(self, rid: str) -> Request | None:
        self._forecast = None
        parked = self.grammar_wait.abort(rid)
        return parked if parked is not None else self.scheduler.abort(rid)

    def forecast(self) -> Forecast:
        """How long the queue here will take (engine/forecast.py), made at most every ``FORECAST_EVERY``
        seconds unless a request arrived or was aborted since."""
        now = time.monotonic()
        if self._forecast is not None and now - self._forecast[0] < FORECAST_EVERY:
            return self._forecast[1]
        sched, sc = self.scheduler, self.cfg.scheduler
        fc = estimate(sched.backlog(), self.rates, max_prefill_tokens=sc.max_prefill_tokens,
                      max_running=sc.max_running_requests, blocked=bool(sched.waiting) and sched.admission_blocked)
        self._forecast = (now, fc)
        return fc

    @property
    def has_work(self) -> bool:
        """A step would do something: the scheduler has requests, a compiled grammar's request
        waits to join it, or a step's result is still to be taken in (overlap scheduling).
        (Requests whose grammar is still compiling are ``num_compiling``.)"""
        return self.scheduler.has_work or self.grammar_wait.has_ready or self._inflight is not None

    @property
    def num_compiling(self) -> int:
        return len(self.grammar_wait)

    def stats(self) -> SchedulerStats:
        """Load figures: running / waiting counts, slots, admission headroom, speculation counters."""
        return self.scheduler.stats()

    @property
    def running(self) -> list[Request]:
        """The running batch (read-only use: describing it, failing it)."""
        return list(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def fail_running(self) -> list[str]:
        """Abort every running request (their slots return to the pool); their ids. After a
        committed step failed, the prefix cache's unlocked KV goes too (some was never computed)."""
        victims = [r.rid for r in self.scheduler.running]
        for rid in victims:
            self.scheduler.abort(rid)
        if self._failed_committed:
            self.scheduler.ledger.drop_cache()
            self._failed_committed = False
        return victims

    def step(self) -> list[StepOutput]:
        """Run one step; returns the per-request events it produced. With overlap scheduling:
        take in the step in flight and launch the next one; returns the events of the one taken in."""
        if self._runner_thread is not None:
            return self._step_overlapped()
        t0 = time.perf_counter()
        self._take_compiled()
        step = self.scheduler.schedule()
        if step is None:
            return []
        result = self.runner.execute(step.plan)
        return self._apply(step, result, time.perf_counter() - t0)

    def _step_overlapped(self) -> list[StepOutput]:
        sched = self.scheduler
        outs: list[StepOutput] = []
        if self._inflight is not None and overlap.needs_result(self._inflight.step,
                                                                   self.cfg.scheduler.speculative_tokens > 0):
            outs = self._take_result()
        self._take_compiled()
        nxt = sched.schedule()  # while the step in flight computes
        prev, self._inflight = self._inflight, None
        if nxt is not None:
            feed = None
            if prev is not None:  # the runner thread feeds nxt prev's tokens when prev ends
                rows, src = overlap.feed(nxt, prev.step)
                feed = _Feed(rows, src, prev.future)
            if not any(nxt.drafts):
                overlap.commit(nxt)
            self._inflight = _InFlight(nxt, self._runner_thread.submit(self._execute, nxt.plan, feed))  # type: ignore[union-attr]
        if prev is not None:
            if prev.future.exception() is not None:  # (waits for it) nxt needed its tokens: it failed too,
                self._drop_inflight()  # and its commit is undone first, the later one
            result, seconds = self._wait(prev)
            outs = self._apply(prev.step, result, seconds, check=False)  # while the next step computes
        if self.check:
            sched.check_invariants()
        return outs

    def _execute(self, plan: ForwardPlan, feed: _Feed | None = None) -> tuple[ForwardResult, float]:
        """Run ``plan`` (on the runner thread with overlap scheduling), first filling in the tokens
        its rows wait for from the step before, whose result exists by now: the runner thread runs
        steps in the order they were launched. If that step failed, so does this one."""
        if feed is not None:
            before, _ = feed.before.result()
            if feed.rows.size:
                plan.input_ids[feed.rows] = before.tokens[feed.src]
        t0 = time.perf_counter()
        result = self.runner.execute(plan)
        return result, time.perf_counter() - t0

    def _take_result(self) -> list[StepOutput]:
        """Wait for the step in flight and apply its result."""
        fl, self._inflight = self._inflight, None
        assert fl is not None
        result, seconds = self._wait(fl)
        return self._apply(fl.step, result, seconds, check=False)

    def _drop_inflight(self) -> None:
        """The step before the one in flight failed: wait for this one to end (it fails too, never
        having run) and undo its commit."""
        fl, self._inflight = self._inflight, None
        if fl is not None:
            try:
                self._wait(fl)
            except BaseException:  # noqa: S110 - the error the caller raises is the earlier step's
                pass

    def _wait(self, fl: _InFlight) -> tuple[ForwardResult, float]:
        """The result of ``fl`` and the seconds it ran. If it failed, its commit is undone and the
        error raised (the caller fails the running requests: ``fail_running``)."""
        try:
            return fl.future.result()
        except BaseException:
            if fl.step.committed:
                overlap.uncommit(fl.step, self.scheduler.running, self.scheduler.waiting)
                self._failed_committed = True
            raise

    def _apply(self, step: ScheduledStep, result: ForwardResult, seconds: float, check: bool = True) -> list[StepOutput]:
        """Apply a step's result (the scheduler's ``update``) and count it."""
        outs = self.scheduler.update(step, result)
        self.num_steps += 1
        sb = step.plan.sampling
        if sb.allowed_rows.size:
            self.grammar_steps += 1
            self.grammar_rows += int(sb.allowed_rows.size)
            self.grammar_seconds += sb.allowed_seconds
        self.last_step = StepInfo(len(step.rows), step.num_new_seqs, step.num_prefill_tokens, step.num_decode,
                                  seconds, step.num_cached_tokens, step.num_generated)
        self.rates.observe(step.num_prefill_tokens, step.num_decode, self.last_step.seconds)
        if any(o.finish_reason is not None for o in outs):
            self._forecast = None
        self._reap_adapters()
        if self.check and check:
            self.scheduler.check_invariants()
        return outs
