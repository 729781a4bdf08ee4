"""Scheduler: continuous batching over a token-granular KV pool, with a prefix cache.

Owns the policy of a step: the waiting queue, the running set, admission and retraction, and
applying a step's result. What it delegates, each behind one call:

* ``SlotLedger`` (ledger.py): the allocator, the radix tree and every slot a request holds;
* ``Speculator`` (speculate.py): whether and what a decoding request guesses, how many of the
  sampled tokens its guesses let it keep, and the counters;
* ``finish_after`` (finish.py): whether a token just appended ends its request, and why;
* ``build_step`` (plan_builder.py): the ``ForwardPlan`` layout of the rows it chose;
* the admission mode and ``Charges`` (admission.py), the queue policy (policy.py);
* ``TenantShare`` (fairness.py): each tenant's weighted service (told of every join, leave,
  admission and generated token); with ``--fairness vtc`` the policy interleaves tenants by it.

Each call to ``schedule()`` builds one step:

0. (``ratio`` admission only) **Retract** the most recently admitted requests while the
   decoding requests would not get a slot each; their KV goes to the prefix cache and they
   are re-queued first.
1. **Prefill** prompts already admitted (oldest first) under the ``max_prefill_tokens``
   budget; a prompt longer than what is left of the budget is cut into chunks over
   several steps.
2. **Order** the waiting queue by the policy (fcfs, lpm, dfs-weight, lof, random, with a
   starvation bound; with ``--fairness vtc`` the least-served tenant's next request first), then **admit** in that order while the running set has room, prefill
   budget is left and the admission mode's estimate of the batch's future KV need fits the
   pool (cache slots shared by several requests are charged once, to the one that holds them
   longest). A candidate first matches its longest cached prefix: those tokens are not
   recomputed, their slots are locked in the tree and not counted again. The first candidate
   that does not fit blocks the rest. Admitted requests get their first chunk in this same step.
   **In-flight sharing**: a candidate whose prompt shares at least ``SHARE_MIN_TOKENS`` more tokens
   with a running request that is still prefilling than the cache holds for it waits (keeping its
   place at the front): that request's chunks enter the tree as they are computed, so the
   candidate later reuses them instead of computing the same prefix again beside it (requests of
   a shared-prefix burst arrive together, before any of them is cached).
   **Adapters**: a candidate with a LoRA adapter is admitted only once its adapter has one of
   the runner's slots (``AdapterSlots.acquire``, pinned while it runs); when every slot is pinned
   by other adapters it waits in the queue, keeping its place, and the others go on. Its cached
   prefix is matched in its adapter's own namespace of the tree.
3. **Decode** every running request whose prefill is done: one token each, in the same
   step as the prefill chunks, so a long prompt never stalls running decodes. **Except in a
   burst**: when requests still wait for admission only because this step's prefill budget is
   spent (not for KV, a running or adapter slot, or a prefix in flight), a decoding request sits
   the step out unless its newest token is ``max_decode_stall`` seconds old. Every decode row in
   a prefill step delays the waiting prompts by what it costs (at a few hundred tokens of context
   a row costs about two prompt tokens: its attention reads the whole context), so a burst's last
   first token comes sooner (0.5-1.3 s of ~10 s at 128 prompts, Zen 5 class CPU); the deferred
   rows run later. A running request waits at most the bound plus a step or two.
4. **Speculate**: a greedy request is fed its newest token and up to ``speculative_tokens``
   guesses from its own history, one plan row each (freely while the step's decode rows are few,
   beyond that where its guesses have been taken often enough: speculate.py).
   ``update`` keeps the sampled tokens while they agree with the guesses (plus the first one
   that does not) and gives back the slots of the guesses the model did not take. Greedy
   results are the same tokens as without speculation where a row's logits do not depend on the
   other rows (bitwise on the float32 integer-kernel path; up to rounding where the row count
   changes the numerics, as batching does).

``update()`` applies the runner's ``ForwardResult``: appends tokens (as many per request as
``Speculator.verify`` keeps), inserts freshly prefilled KV into the tree (so concurrent requests
can share it), finishes requests (``finish_after``, finish.py: grammar, stop token, EOS,
max_tokens) and hands their KV to the tree (or frees it) at once.

Invariants (``check_invariants``, after every step in tests): the ledger's slot accounting
(ledger.py), and, for ``peak`` and ``reserve`` admission, the running batch's estimate within
capacity, so no ``alloc`` ever fails. Speculation keeps that promise by running only while
every running request could grow to its full ``prompt + max_tokens`` at once (speculate.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from lockgate.config import SchedulerConfig
from lockgate.plan import PLACEHOLDER, ForwardResult
from lockgate.scheduler.admission import Charges, make_admission
from lockgate.scheduler.backlog import Backlog, measure
from lockgate.scheduler.fairness import TenantShare
from lockgate.scheduler.finish import finish_after
from lockgate.scheduler.ledger import SlotLedger
from lockgate.scheduler.lora_slots import AdapterSlots
from lockgate.scheduler.plan_builder import ScheduledStep, build_step
from lockgate.scheduler.policy import QueueDelayBound, make_policy
from lockgate.scheduler.request import FinishReason, Request
from lockgate.scheduler.speculate import Speculator

log = logging.getLogger("lockgate.scheduler")
I64 = np.int64


class RequestRejected(ValueError):
    """The request can never run here (too long for the context or the pool, bad ids, an adapter
    not loaded); ``status`` is the HTTP status it means (400, or 404 for a missing adapter)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class StepOutput:
    """What one step produced for one request (the scheduler's outbound event)."""

    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_top: list[list[tuple[int, float]]]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    cached_tokens: int = 0
    error: str | None = None  # with FinishReason.ERROR: what went wrong

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    running: int
    waiting: int
    slots_used: int  # held by running requests (their own + locked cache nodes)
    slots_free: int
    slots_evictable: int  # cached, unlocked: reclaimable on demand
    capacity: int
    headroom: int  # capacity - (admission estimate of the running batch + locked cache slots)
    retractions: int = 0  # running requests that gave their KV back (--admission ratio)
    recomputed_tokens: int = 0  # tokens retracted requests computed again on resumption
    draft_tokens: int = 0  # speculation: guesses fed to the model so far
    accepted_tokens: int = 0  # of those, the ones it agreed with
    drafts: int = 0  # (request, step) pairs fed at least one guess
    accepted_per_pos: tuple[int, ...] = ()  # accepted guesses by position in their draft


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, capacity: int, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], seed: int = 0, cache_generated: bool = True,
                 lora: AdapterSlots | None = None) -> None:
        """``cache_generated``: the prefix cache may keep the KV of generated tokens (False when the
        runner computes decode rows on other forms than prompt rows: ``SlotLedger.cache``).
        ``lora``: the runner's adapter slots, with LoRA on (the engine's ``AdapterRegistry`` makes them)."""
        self.cfg = cfg
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.ledger = SlotLedger(capacity, prefix_cache=not cfg.disable_prefix_cache, cache_generated=cache_generated)
        self.tree = self.ledger.tree  # read by the queue policies (lpm, dfs-weight)
        self.speculator = Speculator(cfg)
        self.admission = make_admission(cfg.admission, cfg.init_new_token_ratio, cfg.min_new_token_ratio,
                                        cfg.new_token_ratio_decay_steps)
        steps, seconds = cfg.queue_delay_bound
        # the tenants' service counters are kept whatever --fairness says; vtc orders admission by them
        self.share = TenantShare(cfg.tenant_weights, cfg.fairness_prompt_weight, cfg.fairness_output_weight)
        self.policy = make_policy(cfg.schedule_policy, QueueDelayBound(steps, seconds), seed=seed,
                                  fair=self.share if cfg.fairness == "vtc" else None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self._by_id: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_retractions = 0
        self.num_recomputed_tokens = 0  # tokens retracted requests computed again on resumption
        self._step_cached = 0  # prompt tokens new requests took from the cache in the step being built
        # the last admission left requests waiting for room (the KV estimate or --max-running-requests),
        # not for prefill budget: the queue moves only when a running request finishes
        self.admission_blocked = False
        self.budget_bound = False  # this step's admission stopped only for want of prefill budget
        self.lora = lora  # the runner's adapter slots (None: LoRA off)

    # ---- intake ----------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def validate(self, prompt_ids: np.ndarray, max_tokens: int) -> None:
        """Raise RequestRejected if a request of this shape can never run here."""
        n = int(len(prompt_ids))
        if n == 0:
            raise RequestRejected("the prompt is empty: at least one token is needed")
        if n + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} tokens exceeds the "
                f"model's context length of {self.max_model_len} tokens")
        if n + max_tokens > self.capacity:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} tokens exceeds the KV "
                f"cache capacity of {self.capacity} tokens (--max-total-tokens / --kv-cache-memory)")
        lo, hi = int(np.min(prompt_ids)), int(np.max(prompt_ids))
        if lo < 0 or hi >= self.vocab_size:
            raise RequestRejected(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.vocab_size})")

    def submit(self, req: Request) -> None:
        if req.rid in self._by_id:
            raise RequestRejected(f"duplicate request id {req.rid!r}")
        self.validate(req.prompt_ids, req.params.max_tokens)
        eos = frozenset() if req.params.ignore_eos else self.eos_token_ids
        req.stop_token_ids = eos | frozenset(req.params.stop_token_ids)
        req.enqueue_step = self.num_steps
        self.waiting.append(req)
        self.share.joined(req.tenant)
        self._by_id[req.rid] = req

    def abort(self, rid: str) -> Request | None:
        """Cancel a request wherever it is; its slots return to the pool (or cache) at once."""
        req = self._by_id.get(rid)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT)
        return req

    # ---- queries ---------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, rid: str) -> Request | None:
        return self._by_id.get(rid)

    def stats(self) -> SchedulerStats:
        free, evictable = self.ledger.num_free, self.ledger.evictable
        spec = self.speculator
        return SchedulerStats(running=len(self.running), waiting=len(self.waiting),
                              slots_used=self.capacity - free - evictable, slots_free=free,
                              slots_evictable=evictable, capacity=self.capacity,
                              headroom=self.capacity - self.usage_estimate(), retractions=self.num_retractions,
                              recomputed_tokens=self.num_recomputed_tokens,
                              draft_tokens=spec.num_draft_tokens, accepted_tokens=spec.num_accepted_tokens,
                              drafts=spec.num_drafts, accepted_per_pos=tuple(spec.accepted_per_pos))

    def backlog(self) -> Backlog:
        """The work queued and running here not done yet (backlog.py), for the engine's queue forecast."""
        return measure(self.waiting, self.running, self.tree)

    def usage_estimate(self) -> int:
        """The admission mode's estimate of the running batch's future KV need (cache slots
        the batch locks included, each counted once)."""
        return self._charges().estimate(self.admission)

    def check_invariants(self) -> None:
        self.ledger.check(self.running, self.waiting)
        if self.lora is not None:
            self.lora.check(sum(1 for r in self.running if r.lora_slot >= 0))
        assert all(r.lora_slot < 0 for r in self.waiting), "a waiting request pins an adapter slot"
        assert Counter(r.tenant for r in self.waiting) == self.share.waiting, "tenants' waiting counts drifted"
        if not self.admission.can_run_out:
            est = self.usage_estimate()
            assert est <= self.capacity, f"running batch's estimate {est} exceeds capacity {self.capacity}"

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        self.num_steps += 1
        if self.admission.can_run_out:
            self._retract_if_short()
        budget = self.cfg.max_prefill_tokens
        prefill: list[tuple[Request, int]] = []
        for r in self.running:  # prompts already admitted continue first, oldest first
            if budget <= 0:
                break
            if r.is_prefilling:
                n = min(r.prefill_len - r.num_computed, budget)
                prefill.append((r, n))
                budget -= n
        n_old = len(prefill)
        self._step_cached = 0
        budget = self._admit(budget, prefill)
        if not self.running:
            return None
        chosen = {id(r) for r, _ in prefill}
        # (left 0: its last token is being sampled by the step in flight, overlap scheduling)
        decode = [r for r in self.running if not r.is_prefilling and id(r) not in chosen and r.left > 0]
        if decode and self.budget_bound and self.cfg.max_decode_stall > 0:
            decode = self._due(decode)  # a burst: its prompts first, within the stall bound
        if not decode and not prefill:
            return None
        drafts = self.speculator.propose(decode, self.running, self.ledger.protected, self.capacity,
                                         waiting=bool(self.waiting))
        step = build_step(decode, drafts, prefill, self.ledger)
        step.num_new_seqs = len(prefill) - n_old
        step.num_cached_tokens = self._step_cached
        if decode:
            self.admission.on_decode_step()
        return step

    def update(self, step: ScheduledStep, result: ForwardResult) -> list[StepOutput]:
        """Apply a step's result; returns one StepOutput per request that got a token or finished."""
        now = time.monotonic()
        tokens, lps = result.tokens.tolist(), result.logprobs.tolist()
        if step.committed:  # its tokens first: the prefix cache below takes the rows the next step computes
            for r, at, tok in zip(step.sampled, step.out_index, tokens, strict=True):
                if not r.finished:
                    r.output_ids[at] = tok
        for b, (r, q) in enumerate(zip(step.rows, step.plan.query_lens.tolist(), strict=True)):
            if not r.finished:
                if not step.committed:
                    r.num_computed += q
                    r.pending = 0
                if b >= step.num_decode_rows and self.ledger.tree is not None:
                    self.ledger.cache(r, keep_lock=True)  # share freshly prefilled KV with later requests
        outs: list[StepOutput] = []
        k = result.top_ids.shape[1] if result.top_ids.ndim == 2 else 0
        row = 0
        for s, (r, guesses) in enumerate(zip(step.sampled, step.drafts, strict=True)):
            first, row = row, row + 1 + len(guesses)
            if r.finished:  # aborted while the step ran
                continue
            made = r.num_output  # its output tokens so far (committed: up to this step's placeholder)
            new: list[int] = []
            new_lps: list[float] = []
            new_top: list[list[tuple[int, float]]] = []
            n_top = min(r.params.logprobs or 0, k)
            # the tokens the rows give: the first, and one more per guess the model agreed with (speculate.py)
            keep = self.speculator.verify(guesses, tokens[first:row]) if guesses else 1
            end = None
            for i in range(first, first + keep):  # until a token finishes the request (finish.py)
                tok = tokens[i]
                top = [(int(a), float(b)) for a, b in zip(result.top_ids[i, :n_top], result.top_logprobs[i, :n_top],
                                                          strict=True)] if n_top else []
                if step.committed:  # its place was taken at launch, and filled above
                    at = step.out_index[s]
                    made = at + 1
                else:
                    r.output_ids.append(tok)
                    made += 1
                r.output_logprobs.append(lps[i])
                r.output_top.append(top)
                new.append(tok)
                new_lps.append(lps[i])
                new_top.append(top)
                end = finish_after(r, tok, made)
                if end is not None:
                    break
            reason, error = end if end is not None else (None, None)
            if guesses:  # the rows of guesses the model did not take give their slots back
                self.ledger.drop_tail(r, self.speculator.accept(r, guesses, len(new)))
            if r.first_token_time is None:
                r.first_token_time = now
            r.last_token_time = now
            step.num_generated += len(new)
            self.share.generated(r.tenant, len(new))
            if reason is not None:
                del r.output_ids[made:]  # the placeholder of a step launched after this one: its row is wasted
                self._finish(r, reason)
            outs.append(StepOutput(r.rid, new, new_lps, new_top, reason, r.num_prompt, made,
                                   r.cached_tokens, error))
        return outs

    # ---- decode stall ----------------------------------------------------------------
    def _due(self, decode: list[Request]) -> list[Request]:
        """The decoding requests whose newest token is at least ``max_decode_stall`` seconds old."""
        now = time.monotonic()
        stall = self.cfg.max_decode_stall
        return [r for r in decode if r.last_token_time is None or now - r.last_token_time >= stall]

    # ---- admission -------------------------------------------------------------------
    def _admit(self, budget: int, prefill: list[tuple[Request, int]]) -> int:
        """Move waiting requests (policy order) into the running set while they fit.

        A candidate whose whole remaining prefill runs this step advances in lockstep with
        the decoders from now on; one whose prompt must be chunked is charged as a stalled
        block until it decodes (see admission.py). A candidate's cached prefix is locked
        before the check (``Charges`` then counts those slots once) and unlocked if it does
        not fit. Appends the admitted requests' prefill chunks to ``prefill``; returns the
        budget left.
        """
        self.admission_blocked = bool(self.waiting) and len(self.running) >= self.cfg.max_running_requests
        # Requests wait only because this step's prefill budget is spent (not for KV, a running
        # slot, an adapter slot or a prefix another request is computing): a burst.
        self.budget_bound = bool(self.waiting) and budget <= 0 and not self.admission_blocked
        if not self.waiting or budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
            return budget
        if len(self.waiting) > 1:
            self.waiting = deque(self.policy.order(list(self.waiting), self.tree, self.num_steps, time.monotonic()))
        charges = self._charges()
        now = time.monotonic()
        deferred: list[Request] = []  # sharing a prefix with a prefill in flight: back to the front after
        no_slot: set[int] = set()  # adapters that found every slot pinned this step
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            cand = self.waiting[0]
            if cand.output_ids[-1:] == [PLACEHOLDER]:  # retracted while its token is sampled: resumes after
                deferred.append(self.waiting.popleft())
                continue
            if cand.adapter and cand.adapter in no_slot:
                deferred.append(self.waiting.popleft())
                continue
            matched, node, slots = self.ledger.match(cand)
            if self._shares_inflight(cand, matched):
                if node is not None:
                    self.ledger.unlock(node)
                deferred.append(self.waiting.popleft())
                if len(deferred) >= self.SHARE_MAX_DEFERRED:  # a burst on one prefix: look no further this step
                    break
                continue
            n = min(cand.prefill_len - matched, budget)
            trial = charges.copy()
            trial.add(cand.num_tokens - matched, cand.left, stalled=n < cand.prefill_len - matched, node=node)
            if trial.estimate(self.admission) > self.capacity:
                if node is not None:
                    self.ledger.unlock(node)
                self.admission_blocked = True
                break
            if cand.adapter:
                slot = self.lora.acquire(cand.adapter) if self.lora is not None else None
                if slot is None:  # every adapter slot is pinned: wait for one, let the others by
                    if node is not None:
                        self.ledger.unlock(node)
                    no_slot.add(cand.adapter)
                    deferred.append(self.waiting.popleft())
                    continue
                cand.lora_slot = slot
            charges = trial
            self.waiting.popleft()
            self.share.left(cand.tenant)
            self.share.admitted(cand)
            cand.tree_node, cand.tree_len, cand.num_computed = node, matched, matched
            cand.slots[:matched] = slots
            if cand.num_retractions == 0:
                cand.cached_tokens = matched
            else:  # a retracted request resumes: what the cache no longer holds is computed again
                self.num_recomputed_tokens += cand.prefill_len - matched
            self._step_cached += matched
            cand.admit_time = cand.admit_time or now
            self.running.append(cand)
            prefill.append((cand, n))
            budget -= n
        # the next candidate would have been tried with more budget (and not set aside for a prefix in flight)
        self.budget_bound = (budget <= 0 and bool(self.waiting) and len(self.running) < self.cfg.max_running_requests
                             and not self._shares_inflight(self.waiting[0], 0))
        self.waiting.extendleft(reversed(deferred))
        if self.waiting and len(self.running) >= self.cfg.max_running_requests:
            self.admission_blocked = True
        return budget

    SHARE_MIN_TOKENS = 64
    SHARE_MAX_DEFERRED = 64  # candidates set aside per step before admission stops looking

    def _shares_inflight(self, cand: Request, matched: int) -> bool:
        """True if a running request still prefilling will put at least ``SHARE_MIN_TOKENS`` of
        ``cand``'s prompt beyond ``matched`` (what the cache holds for it now) into the tree."""
        if self.ledger.tree is None or cand.num_prompt - matched <= self.SHARE_MIN_TOKENS:
            return False
        mine = cand.prompt_ids
        for r in self.running:
            if not r.is_prefilling or r.adapter != cand.adapter:
                continue
            n = min(mine.shape[0], r.num_prompt)
            if n - matched <= self.SHARE_MIN_TOKENS:
                continue
            same = mine[:n] == r.prompt_ids[:n]
            common = n if same.all() else int(np.argmin(same))
            if common - matched >= self.SHARE_MIN_TOKENS:
                return True
        return False

    def _charges(self) -> Charges:
        """The running batch as admission rows, longest-living first (stalled ones count as
        longest), so each shared cache node is charged to the request that holds it longest."""
        ch = Charges()
        for r in sorted(self.running, key=lambda r: (r.is_prefilling, r.left), reverse=True):
            ch.add(r.num_tokens - r.tree_len, r.left, stalled=r.is_prefilling, node=r.tree_node)
        return ch


    # ---- retraction and finishing ----------------------------------------------------
    def _retract_if_short(self) -> None:
        """Ratio admission: while this step's decodes (one slot each) and the prefill chunks of
        admitted prompts would not fit, retract a running request (``_victim``: by default the
        cheapest to recompute; its KV stays in the prefix cache, evictable) and re-queue it first."""
        while len(self.running) > 1:
            decode = sum(1 for r in self.running if not r.is_prefilling)
            chunks = min(self.cfg.max_prefill_tokens,
                         sum(r.prefill_len - r.num_computed for r in self.running if r.is_prefilling))
            if decode + chunks <= self.ledger.num_free + self.ledger.evictable:
                return
            victim = self.running.pop(self._victim())
            self._leave(victim)
            victim.prefill_len = victim.num_tokens  # resume: recompute prompt + output, then sample
            victim.num_retractions += 1
            victim.enqueue_step = self.num_steps
            self.waiting.appendleft(victim)
            self.share.joined(victim.tenant)
            self.num_retractions += 1
            self.admission.on_retract(sum(r.num_output for r in self.running), len(self.running),
                                      sum(r.params.max_tokens for r in self.running))
            log.info("retracted request %s (%d tokens) to free KV slots; %d running, new-token ratio now %.2f",
                     victim.rid, victim.num_tokens, len(self.running), getattr(self.admission, "ratio", 1.0))

    def exclusive_tokens(self, r: Request) -> int:
        """Tokens of ``r``'s KV no other running request holds: its own slots and the cached nodes
        only its lock keeps (``lock_ref`` 1 on its path). Retracting ``r`` makes them reclaimable,
        and they are what it recomputes on resumption if the cache evicts them meanwhile."""
        own = r.num_computed - r.tree_len
        node = r.tree_node
        while node is not None and node.parent is not None and node.lock_ref == 1:
            own += node.size
            node = node.parent
        return own

    def _victim(self) -> int:
        """Index in ``running`` of the request to retract (``--retract-victim``): the last admitted,
        or the cheapest to recompute (``exclusive_tokens``, above 0: one that frees nothing is no use),
        ties to the tenant furthest over its share (the highest service counter per weight), then
        the last admitted."""
        if self.cfg.retract_victim == "last":
            return len(self.running) - 1
        best, key = len(self.running) - 1, None
        for i, r in enumerate(self.running):
            cost = self.exclusive_tokens(r)
            if cost == 0:
                continue
            k = (cost, -self.share.counter(r.tenant), -i)
            if key is None or k < key:
                best, key = i, k
        return best

    def _leave(self, r: Request) -> None:
        """``r`` leaves the running set: its KV to the tree (or pool), its adapter slot unpinned."""
        self.ledger.release(r)
        if r.lora_slot >= 0:
            assert self.lora is not None
            self.lora.release(r.lora_slot)
            r.lora_slot = -1

    def _finish(self, r: Request, reason: FinishReason) -> None:
        r.finish_reason = reason
        self._by_id.pop(r.rid, None)
        if r in self.running:
            self.running.remove(r)
            self._leave(r)
        else:
            try:
                self.waiting.remove(r)
            except ValueError:
                return
            self.share.left(r.tenant)
