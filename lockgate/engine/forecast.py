"""How long the engine's queue will take: step costs fitted to recent steps, applied to the backlog.

Owns ``StepRates`` (what recent steps cost) and ``estimate`` (a ``Forecast`` from a
``scheduler.backlog.Backlog`` and those costs). The server exports the result in ``/v1/loads``; the
gateway's ``forecast`` routing policy and its ``Retry-After`` read it.

The step cost model (what the sim runner does exactly, and what a CPU step does roughly): a step of
P prefill tokens and R decode rows takes ``overhead_s + P * prefill_s_per_token + R * row_s``. The
three costs are fitted by least squares over the engine's steps, each step's weight shrinking by
``FORGET`` per step after it (so the fit follows the last few dozen steps), with no cost below 0
(a coefficient the data would make negative is dropped and the rest refitted). Until the steps vary
enough to tell the costs apart, a small ridge on the overhead gives what cannot be told apart to the
per-token and per-row costs (one prefill step of 500 tokens in 0.27 s reads as 0.54 ms a token and no
overhead): right for steps like those seen, a guess for others.
A decode step now costs ``overhead_s + R * row_s`` for the R requests decoding now; ``decode_step_s``
reports it for at least one row (what a newcomer's decode steps would cost, about).

The estimates (``estimate``), with P = ``backlog.prefill_tokens`` (prompt tokens to compute, shared
spans and cached prefixes counted once) taking S = ceil(P / ``max_prefill_tokens``) steps:

* ``queue_eta_s``: how long before a request sent now would start its own prefill: P x
  ``prefill_s_per_token`` + S x ``decode_step_s`` (each of those steps also pays the overhead and the
  decode rows riding along), plus, when the queue is blocked (the last admission left requests waiting
  for room, not for prefill budget: the KV estimate or ``--max-running-requests`` is full), the
  shortest remaining decode of a running request x ``decode_step_s`` (the first finish frees room). A
  request's time to first token there is then about ``queue_eta_s`` + its own uncached prompt tokens /
  ``prefill_tokens_per_s`` (+ one step's overhead).
* ``drain_eta_s``: until everything queued and running now is done: the prefill part above +
  max(longest remaining decode, ceil(decode tokens / ``max_running``)) x ``decode_step_s``. An upper
  bound in one respect (``max_tokens`` is assumed; EOS ends requests sooner).

Before the first step nothing is known (None), and so is any ETA of a non-empty queue (an empty
queue is 0 s whatever the costs). Invariants: ETAs are >= 0 or None; costs are >= 0 or None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lockgate.scheduler.backlog import Backlog

FORGET = 0.97  # weight left to a step after each newer one (~33 steps make up most of the fit)
OVERHEAD_PRIOR = 0.01  # ridge on the overhead (in steps' worth of weight): decides only what the steps do not


class StepRates:
    def __init__(self, forget: float = FORGET) -> None:
        self.forget = forget
        # weighted sums of x x^T (upper triangle) and x y over the steps, x = (1, P / 1000, R / 100): scaled
        # so the three columns are of similar size and the solve is well conditioned
        self._xx = [0.0] * 6  # (0,0) (0,1) (0,2) (1,1) (1,2) (2,2)
        self._xy = [0.0] * 3
        self.steps = 0
        self._fit: tuple[float, float, float] | None = None  # (overhead_s, prefill_s_per_token, row_s)
        self._stale = False

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """One step's sizes and duration."""
        if seconds <= 0 or (prefill_tokens <= 0 and decode_rows <= 0):
            return
        f = self.forget
        x = (1.0, prefill_tokens / 1000.0, decode_rows / 100.0)
        xx, xy = self._xx, self._xy
        k = 0
        for i in range(3):
            xy[i] = f * xy[i] + x[i] * seconds
            for j in range(i, 3):
                xx[k] = f * xx[k] + x[i] * x[j]
                k += 1
        self.steps += 1
        self._stale = True

    def costs(self) -> tuple[float, float, float] | None:
        """(overhead_s, prefill_s_per_token, row_s), fitted (module docstring); None before any step."""
        if self._stale:
            self._fit = self._solve()
            self._stale = False
        return self._fit

    def _solve(self) -> tuple[float, float, float] | None:
        if self.steps == 0:
            return None
        a = np.array([[self._xx[0], self._xx[1], self._xx[2]], [self._xx[1], self._xx[3], self._xx[4]],
                      [self._xx[2], self._xx[4], self._xx[5]]])
        a[0, 0] += OVERHEAD_PRIOR  # steps that cannot tell overhead from token cost: the tokens get it
        y = np.array(self._xy)
        active = [0, 1, 2]
        theta = np.zeros(3)
        while active:
            sub = a[np.ix_(active, active)]
            sol = np.linalg.lstsq(sub, y[active], rcond=1e-10)[0]  # least-norm where the steps do not tell
            if (sol >= 0).all():
                theta[active] = sol
                break
            del active[int(np.argmin(sol))]  # a negative cost: drop it, refit the others
        scale = (1.0, 1000.0, 100.0)
        overhead, per_token, per_row = (float(theta[i] / scale[i]) for i in range(3))
        return overhead, per_token, per_row

    @property
    def prefill_s_per_token(self) -> float | None:
        c = self.costs()
        return c[1] if c is not None and c[1] > 0 else None

    @property
    def prefill_tokens_per_s(self) -> float | None:
        spt = self.prefill_s_per_token
        return None if spt is None else 1.0 / spt

    def decode_step_s(self, rows: int) -> float | None:
        """A step of ``rows`` decode rows (and no prefill), as fitted."""
        c = self.costs()
        return None if c is None else c[0] + c[2] * max(rows, 0)


@dataclass(frozen=True)
class Forecast:
    queue_eta_s: float | None  # before a request sent now starts its prefill
    drain_eta_s: float | None  # until everything here now is done
    prefill_backlog_tokens: int
    decode_backlog_tokens: int
    prefill_tokens_per_s: float | None
    decode_step_s: float | None  # a decode step of the batch decoding now (at least one row)
    blocked: bool  # requests wait for room (KV or --max-running-requests), not for prefill budget


def estimate(backlog: Backlog, rates: StepRates, *, max_prefill_tokens: int, max_running: int,
             blocked: bool) -> Forecast:
    """The queue forecast (module docstring) of ``backlog`` at ``rates``."""
    P = backlog.prefill_tokens
    spt = rates.prefill_s_per_token
    dstep = rates.decode_step_s(backlog.decoding)
    if P == 0:
        prefill: float | None = 0.0
    elif dstep is None:
        prefill = None
    else:
        prefill = (P * spt if spt is not None else 0.0) + math.ceil(P / max(1, max_prefill_tokens)) * dstep
    wait: float | None = 0.0
    if blocked and backlog.shortest_running_decode:
        wait = backlog.shortest_running_decode * dstep if dstep is not None else None
    queue = None if prefill is None or wait is None else prefill + wait
    decode_steps = max(backlog.longest_decode, math.ceil(backlog.decode_tokens / max(1, max_running)))
    decode_s: float | None = 0.0 if decode_steps == 0 else (decode_steps * dstep if dstep is not None else None)
    drain = None if prefill is None or decode_s is None else prefill + decode_s
    return Forecast(queue_eta_s=queue, drain_eta_s=drain, prefill_backlog_tokens=P,
                    decode_backlog_tokens=backlog.decode_tokens, prefill_tokens_per_s=rates.prefill_tokens_per_s,
                    decode_step_s=rates.decode_step_s(max(1, backlog.decoding)), blocked=blocked)
