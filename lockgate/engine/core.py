"""EngineCore: the one place where the scheduler meets a runner.

Owns one scheduler and one runner and turns them into a step function:
schedule -> execute -> update. Callers (the scheduler process, the offline ``LLM``) use only
this object's methods, never the scheduler behind it. The offline ``LLM`` drives it in-process; the server's
scheduler process drives the very same object from its event loop (docs/design.md, habit 12).

Step statistics for the operator's log lines (prefill: #new-seq, #new-token, token usage,
#queue-req; decode: #running-req, #token, gen throughput) are kept here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from lockgate.config import EngineConfig
from lockgate.grammar import GrammarCompiler, GrammarError
from lockgate.runner import Runner, make_runner
from lockgate.sampling import SamplingParams
from lockgate.scheduler.request import Request
from lockgate.scheduler.scheduler import RequestRejected, Scheduler, SchedulerStats, StepOutput
from lockgate.tokenizer.tokenizer import load_tokenizer

log = logging.getLogger("lockgate.engine")


@dataclass
class StepInfo:
    num_seqs: int  # plan rows (a speculating request counts once per guess row)
    num_new_seqs: int
    num_prefill_tokens: int
    num_decode: int
    seconds: float
    num_cached_tokens: int = 0
    num_generated: int = 0  # tokens appended to outputs (several per request when guesses were accepted)


class EngineCore:
    def __init__(self, cfg: EngineConfig, runner: Runner | None = None, check_invariants: bool = False) -> None:
        self.cfg = cfg
        self.runner = runner if runner is not None else make_runner(cfg.model, cfg.cache)
        self.scheduler = Scheduler(cfg.scheduler, capacity=self.runner.capacity,
                                   max_model_len=self.runner.max_model_len, vocab_size=self.runner.vocab_size,
                                   eos_token_ids=self.runner.eos_token_ids, seed=cfg.model.seed)
        self.check = check_invariants
        self._grammars: GrammarCompiler | None = None
        # constrained decoding's own cost: steps with grammar rows, those rows, seconds filling their masks
        self.grammar_steps = self.grammar_rows = 0
        self.grammar_seconds = 0.0
        self.last_step: StepInfo | None = None
        self.num_steps = 0
        sc = cfg.scheduler
        log.info("engine ready: KV capacity %d tokens, context %d, max running %d, prefill budget %d, "
                 "admission %s, policy %s, prefix cache %s", self.runner.capacity, self.runner.max_model_len,
                 sc.max_running_requests, sc.max_prefill_tokens, sc.admission, sc.schedule_policy,
                 "off" if sc.disable_prefix_cache else "on")

    def add_request(self, prompt_ids: list[int] | np.ndarray, params: SamplingParams,
                    rid: str | None = None) -> Request:
        req = Request(rid or self.scheduler.new_request_id(), np.asarray(prompt_ids, dtype=np.int64), params)
        if params.structured is not None:
            try:
                req.grammar = self.grammars.matcher(params.structured)
            except GrammarError as e:
                raise RequestRejected(str(e)) from None
        self.scheduler.submit(req)
        return req

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer (made on the first constrained request)."""
        if self._grammars is None:
            runner = self.runner
            model, model_dir = self.cfg.model.model, getattr(runner, "model_dir", None)
            self._grammars = GrammarCompiler(lambda: load_tokenizer(model, model_dir), runner.vocab_size,
                                             runner.eos_token_ids)
        return self._grammars

    def validate(self, prompt_ids: list[int] | np.ndarray, max_tokens: int) -> None:
        """Raise ``RequestRejected`` (a ValueError) if a request of this shape can never run here."""
        self.scheduler.validate(np.asarray(prompt_ids, dtype=np.int64), max_tokens)

    def abort(self, rid: str) -> Request | None:
        return self.scheduler.abort(rid)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

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
        """Abort every running request (their slots return to the pool); their ids."""
        victims = [r.rid for r in self.scheduler.running]
        for rid in victims:
            self.scheduler.abort(rid)
        return victims

    def step(self) -> list[StepOutput]:
        """Run one step; returns the per-request events it produced."""
        t0 = time.perf_counter()
        step = self.scheduler.schedule()
        if step is None:
            return []
        result = self.runner.execute(step.plan)
        outs = self.scheduler.update(step, result)
        self.num_steps += 1
        sb = step.plan.sampling
        if sb.allowed_rows.size:
            self.grammar_steps += 1
            self.grammar_rows += int(sb.allowed_rows.size)
            self.grammar_seconds += sb.allowed_seconds
        self.last_step = StepInfo(len(step.rows), step.num_new_seqs, step.num_prefill_tokens, step.num_decode,
                                  time.perf_counter() - t0, step.num_cached_tokens, step.num_generated)
        if self.check:
            self.scheduler.check_invariants()
        return outs
