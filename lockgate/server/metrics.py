"""Prometheus metrics of the API process, prefix ``lockgate:`` (served at ``/metrics``).

Owns one private ``CollectorRegistry`` (so several servers in one test process never clash)
and the metric objects. Latencies are observed by the frontend as outputs arrive; gauges
mirror the engine's load figures carried by every step batch. Token and prefix-cache
figures are counters, so rates and hit ratios over any window are exact.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from lockgate.ipc.messages import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                1.0, 2.5, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model = model_name
        self.ttft = Histogram("lockgate:time_to_first_token_seconds", "Time from request arrival to its first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("lockgate:inter_token_latency_seconds", "Time between consecutive output tokens",
                             labels, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("lockgate:e2e_request_latency_seconds", "Time from request arrival to its last token",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("lockgate:queue_time_seconds", "Time from arrival until the scheduler admitted it",
                               labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("lockgate:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("lockgate:num_requests_waiting", "Requests in the waiting queue", labels, registry=r)
        self.kv_usage = Gauge("lockgate:kv_slot_usage_ratio", "Used KV slots / capacity", labels, registry=r)
        self.kv_used = Gauge("lockgate:kv_slots_used", "KV slots held by requests", labels, registry=r)
        self.kv_capacity = Gauge("lockgate:kv_slots_capacity", "KV pool capacity in tokens", labels, registry=r)
        self.prompt_tokens = Counter("lockgate:prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=r)
        self.generation_tokens = Counter("lockgate:generation_tokens", "Generated tokens", labels, registry=r)
        self.requests = Counter("lockgate:request_success", "Finished requests by finish reason",
                                [*labels, "finished_reason"], registry=r)
        self.prefix_queries = Counter("lockgate:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter("lockgate:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels,
                                   registry=r)
        self.spec_draft = Counter("lockgate:spec_decode_draft_tokens", "Speculative guesses fed to the model",
                                  labels, registry=r)
        self.spec_accepted = Counter("lockgate:spec_decode_accepted_tokens",
                                     "Speculative guesses the model agreed with (tokens gained)", labels, registry=r)
        self._spec_seen = (0, 0)  # the scheduler's running totals at the last update
        self.spec_draft.labels(model_name)  # export zeros from the start
        self.spec_accepted.labels(model_name)
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(model_name, reason)  # export zeros from the start

    def update_stats(self, s: EngineStats) -> None:
        m = self.model
        self.running.labels(m).set(s.running)
        self.waiting.labels(m).set(s.waiting)
        self.kv_used.labels(m).set(s.slots_used)
        self.kv_capacity.labels(m).set(s.capacity)
        self.kv_usage.labels(m).set(s.slots_used / max(s.capacity, 1))
        drafted, accepted = self._spec_seen
        if s.draft_tokens > drafted:
            self.spec_draft.labels(m).inc(s.draft_tokens - drafted)
            self.spec_accepted.labels(m).inc(s.accepted_tokens - accepted)
            self._spec_seen = (s.draft_tokens, s.accepted_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
