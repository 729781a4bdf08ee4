"""How long the engine's queue will take: step rates measured from recent steps, applied to the backlog.

Owns ``StepRates`` (what recent steps cost) and ``estimate`` (a ``Forecast`` from a
``scheduler.backlog.Backlog`` and those rates). The server exports the result in ``/v1/loads``; the
gateway's ``forecast`` routing policy and its ``Retry-After`` read it.

The step cost model (what the sim runner does exactly, and what a CPU step does roughly): a step
costs ``prefill tokens x prefill_s_per_token + decode_step_s`` when it has decode rows. Both figures
are exponentially weighted moving averages (weight ``ALPHA`` on the newest step) over the steps the
engine ran:

* a step with decode rows and no prefill: one ``decode_step_s`` sample (its duration: the decode
  batch as it is now, speculation rows included);
* a step with prefill and no decode rows: one ``prefill_s_per_token`` sample (duration / tokens);
* a mixed step: one ``prefill_s_per_token`` sample from its duration minus the current
  ``decode_step_s`` (not below a quarter of the step), divided by its prefill tokens.

The estimates (``estimate``), with P = ``backlog.prefill_tokens`` (prompt tokens to compute, shared
spans and cached prefixes counted once):

* ``queue_eta_s``: how long before a request sent now would start its own prefill: P x
  ``prefill_s_per_token``, plus one ``decode_step_s`` for each of the ceil(P / ``max_prefill_tokens``)
  steps that prefill takes while requests are decoding (decodes ride along in every step), plus,
  when the queue is blocked (the last admission left requests waiting for room, not for prefill
  budget: the KV estimate or ``--max-running-requests`` is full), the shortest remaining decode of a
  running request x ``decode_step_s`` (the first finish frees room). A request's time to first token on this replica
  is then about ``queue_eta_s`` + its own uncached prompt tokens / ``prefill_tokens_per_s``.
* ``drain_eta_s``: until everything queued and running now is done: P x ``prefill_s_per_token`` +
  max(longest remaining decode, ceil(decode tokens / ``max_running``)) x ``decode_step_s``. An
  upper bound in one respect (``max_tokens`` is assumed; EOS ends requests sooner).

Before the first step of a kind has been measured its rate is unknown (None) and so is any ETA
that needs it (an empty queue is 0 s whatever the rates). Invariants: ETAs are >= 0 or None; rates
are > 0 or None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lockgate.scheduler.backlog import Backlog

ALPHA = 0.2  # weight of the newest step in the moving averages


class StepRates:
    def __init__(self, alpha: float = ALPHA) -> None:
        self.alpha = alpha
        self.prefill_s_per_token: float | None = None
        self.decode_step_s: float | None = None

    def _mix(self, old: float | None, sample: float) -> float:
        return sample if old is None else old + self.alpha * (sample - old)

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """One step's sizes and duration."""
        if seconds <= 0 or (prefill_tokens <= 0 and decode_rows <= 0):
            return
        if prefill_tokens <= 0:
            self.decode_step_s = self._mix(self.decode_step_s, seconds)
            return
        prefill_seconds = seconds
        if decode_rows > 0 and self.decode_step_s is not None:
            prefill_seconds = max(seconds - self.decode_step_s, 0.25 * seconds)
        self.prefill_s_per_token = self._mix(self.prefill_s_per_token, prefill_seconds / prefill_tokens)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return None if not self.prefill_s_per_token else 1.0 / self.prefill_s_per_token


@dataclass(frozen=True)
class Forecast:
    queue_eta_s: float | None  # before a request sent now starts its prefill
    drain_eta_s: float | None  # until everything here now is done
    prefill_backlog_tokens: int
    decode_backlog_tokens: int
    prefill_tokens_per_s: float | None
    decode_step_s: float | None
    blocked: bool  # requests wait for room (KV or --max-running-requests), not for prefill budget


def estimate(backlog: Backlog, rates: StepRates, *, max_prefill_tokens: int, max_running: int,
             blocked: bool) -> Forecast:
    """The queue forecast (module docstring) of ``backlog`` at ``rates``."""
    P = backlog.prefill_tokens
    spt, dstep = rates.prefill_s_per_token, rates.decode_step_s
    prefill_s: float | None = 0.0 if P == 0 else (P * spt if spt is not None else None)
    # decode rows ride along in each prefill step while some request decodes
    steps = math.ceil(P / max(1, max_prefill_tokens)) if backlog.decoding else 0
    interleave: float | None = 0.0 if steps == 0 else (steps * dstep if dstep is not None else None)
    wait: float | None = 0.0
    if blocked and backlog.shortest_running_decode:
        wait = backlog.shortest_running_decode * dstep if dstep is not None else None
    queue = None if prefill_s is None or interleave is None or wait is None else prefill_s + interleave + wait
    decode_steps = max(backlog.longest_decode, math.ceil(backlog.decode_tokens / max(1, max_running)))
    decode_s: float | None = 0.0 if decode_steps == 0 else (decode_steps * dstep if dstep is not None else None)
    drain = None if prefill_s is None or decode_s is None else prefill_s + decode_s
    return Forecast(queue_eta_s=queue, drain_eta_s=drain, prefill_backlog_tokens=P,
                    decode_backlog_tokens=backlog.decode_tokens, prefill_tokens_per_s=rates.prefill_tokens_per_s,
                    decode_step_s=dstep, blocked=blocked)
