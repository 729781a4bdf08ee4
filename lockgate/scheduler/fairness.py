"""Fair share between tenants: the virtual token counter (``--fairness vtc``).

Owns each tenant's counter of weighted service and the order in which tenants' waiting requests
are offered to admission. The scheduler tells it what happens (a request of a tenant joins or
leaves the waiting queue, a prompt is admitted, tokens are generated); the queue policy asks it to
interleave the requests it ranked (``interleave``). Pure Python and ints/floats; no request state
is changed here.

The algorithm (VTC, "Fairness in Serving Large Language Models", Sheng et al., OSDI 2024)
-----------------------------------------------------------------------------------------
Every tenant ``u`` has a counter ``c_u`` of the service it received, in weighted tokens:

* a request's prompt is charged ``wp * prompt_tokens / w_u`` when it is admitted (once: a request
  resuming after a retraction is not charged again);
* every generated token is charged ``wq / w_u`` when it is sampled;

with ``wp``, ``wq`` = ``--fairness-prompt-weight`` (1) and ``--fairness-output-weight`` (2) (an
output token costs a decode step of its own, a prompt token a share of a prefill) and ``w_u`` the
tenant's ``--tenant-weight`` (1 unless given). Admission serves the *backlogged* tenant (one with
a waiting request) whose counter is least; within a tenant, requests go in the queue policy's
order. Since the counters only move when the scheduler admits or decodes, the whole order of one
step is computed up front: take the least tenant, append its next request, add that request's
prompt charge to the tenant's counter (a copy), repeat; ties go to the tenant whose next request
the policy ranked first, so with one tenant the order is the policy's own.

Lifting: a tenant that becomes backlogged (a request joins the waiting queue while it had none)
has its counter raised to the least counter of the tenants backlogged now (kept if higher), or,
when none is, to the counter of the tenant that left the backlog last. An idle tenant thus
banks no credit, and one that was served heavily keeps its debt.

The bound (tested in ``tests/test_fairness.py``)
------------------------------------------------
For two tenants ``f``, ``g`` backlogged at the same time, ``|c_f - c_g| <= D`` with
``D = max_u (wp * L + wq * U) / w_u``, where ``L`` is the longest prompt and ``U`` the most
output the tenant's running requests can still generate (at most ``--max-running-requests``
times the largest ``max_tokens``). Why: consider the one ahead, ``h``, at its last admission: it
was the least then, so it was at most the other's counter; since then it gained that prompt
(``wp * L / w_h``) and the output of requests already running (``wq * U / w_h``), while the other's
counter only grew. Lifting keeps the bound (a tenant leaves the backlog within ``D`` of the least
counter, which never decreases, and rejoins at or above it). Over any interval in which both are
backlogged, their weighted service therefore differs by at most ``2 * D``: the paper's bound
``2 * max(wp * L_input, wq * M)`` with ``M`` read as the batch's outstanding output (a sum rather
than a max here, because a request's prompt and its output are charged at different times).

The bound holds while admission follows this order. The ``--max-queue-delay`` bound orders each
tenant's own requests (its overdue ones first), never the tenants: under overload a flooding
tenant's requests go overdue first, and serving them ahead of everyone (as without fairness) gave
the light tenant of ``benchmarks/tenant_fairness.py`` 0.36 of the service instead of 0.5 on the
default model. A request waiting for a prefix in flight or for an adapter slot (set aside, the
next one goes) and retraction (``--admission ratio``) step outside the order, each for a bounded
time.

Memory: a counter is kept per tenant ever seen; past ``MAX_TENANTS`` the counters of tenants that
have nothing waiting and are at or below the lifting reference are dropped (a returning tenant is
lifted to that reference anyway, so nothing changes).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

DEFAULT_TENANT = "default"
MAX_TENANTS = 4096


class Tenanted(Protocol):
    @property
    def tenant(self) -> str: ...

    @property
    def num_prompt(self) -> int: ...

    @property
    def num_retractions(self) -> int: ...


T = TypeVar("T", bound=Tenanted)


class TenantShare:
    """The tenants' virtual token counters (see the module docstring)."""

    def __init__(self, weights: Mapping[str, float] | None = None, prompt_weight: float = 1.0,
                 output_weight: float = 2.0) -> None:
        self.weights = dict(weights or {})
        self.wp, self.wq = prompt_weight, output_weight
        self.counters: dict[str, float] = {}
        self.waiting: dict[str, int] = {}  # tenant -> requests in the waiting queue (backlogged: > 0)
        self._floor = 0.0  # the counter of the tenant that left the backlog last

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def reference(self) -> float:
        """The counter a tenant joining the backlog now is lifted to (at least)."""
        if self.waiting:
            return min(self.counters.get(t, 0.0) for t in self.waiting)
        return self._floor

    # ---- what the scheduler reports ----------------------------------------------------
    def joined(self, tenant: str) -> None:
        """A request of ``tenant`` entered the waiting queue."""
        n = self.waiting.get(tenant, 0)
        if n == 0:
            ref = self.reference()
            if self.counters.get(tenant, 0.0) < ref:
                self.counters[tenant] = ref
            else:
                self.counters.setdefault(tenant, 0.0)
            if len(self.counters) > MAX_TENANTS:
                self._forget(ref)
        self.waiting[tenant] = n + 1

    def left(self, tenant: str) -> None:
        """A request of ``tenant`` left the waiting queue (admitted or aborted)."""
        n = self.waiting.get(tenant, 0) - 1
        if n > 0:
            self.waiting[tenant] = n
            return
        self.waiting.pop(tenant, None)
        if not self.waiting:
            self._floor = max(self._floor, self.counters.get(tenant, 0.0))

    def admitted(self, r: Tenanted) -> None:
        """``r`` joined the running set: its prompt is charged (not again after a retraction)."""
        if r.num_retractions == 0:
            t = r.tenant
            self.counters[t] = self.counters.get(t, 0.0) + self.wp * r.num_prompt / self.weight(t)

    def generated(self, tenant: str, n: int) -> None:
        """``n`` tokens were sampled for a request of ``tenant``."""
        self.counters[tenant] = self.counters.get(tenant, 0.0) + self.wq * n / self.weight(tenant)

    # ---- the order ---------------------------------------------------------------------
    def interleave(self, reqs: Sequence[T]) -> list[T]:
        """``reqs`` (in the policy's order) reordered so that each next request is the least-served
        tenant's next one, as admission in this order would charge them."""
        queues: dict[str, list[int]] = {}
        for i, r in enumerate(reqs):
            queues.setdefault(r.tenant, []).append(i)
        if len(queues) <= 1:
            return list(reqs)
        heap = [(self.counters.get(t, 0.0), idx[0], t) for t, idx in queues.items()]
        heapq.heapify(heap)
        pos = dict.fromkeys(queues, 0)
        out: list[T] = []
        while heap:
            c, _, t = heapq.heappop(heap)
            i = queues[t][pos[t]]
            r = reqs[i]
            out.append(r)
            pos[t] += 1
            if pos[t] < len(queues[t]):
                charge = self.wp * r.num_prompt / self.weight(t) if r.num_retractions == 0 else 0.0
                heapq.heappush(heap, (c + charge, queues[t][pos[t]], t))
        return out

    def _forget(self, ref: float) -> None:
        for t in [t for t, c in self.counters.items() if c <= ref and t not in self.waiting]:
            del self.counters[t]
