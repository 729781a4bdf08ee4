"""Prometheus metrics of the API process, prefix ``lockgate:`` (served at ``/metrics``).

Owns one private ``CollectorRegistry`` (so several servers in one test process never clash)
and the metric objects. Latencies are observed by the frontend as outputs arrive; gauges
mirror the engine's load figures carried by every step batch. Token and prefix-cache
figures are counters, so rates and hit ratios over any window are exact.

Names, types, units and label sets follow vLLM's for every concept both servers have (with
``lockgate:`` for ``vllm:``), so its dashboards and alerts work after a prefix relabel, and the
dashboard in ``dashboards/grafana.json`` works as it is. Histogram buckets are vLLM's bounds plus,
for the latencies, finer ones below them (CPU token latencies are milliseconds): every ``le`` a
vLLM query uses exists here too. Token-count histograms use the 1-2-5 series up to the context
length, as vLLM's do, and appear once the engine is ready (``on_ready``). Series with no vLLM
counterpart: ``kv_slots_used`` / ``kv_slots_capacity`` (the token pool in tokens), ``grammar_compiles``
(the grammar sandbox's outcomes).
Per tenant (``tenant`` label, bounded: server/tenants.py): ``tenant_prompt_tokens``,
``tenant_generation_tokens``, ``tenant_requests_waiting`` (accepted, no first token yet: what
``--max-queued-per-tenant`` counts) and ``tenant_time_to_first_token_seconds``.
``num_preemptions`` is always 0: peak admission never lets a running request run out of KV
slots, so nothing is ever preempted (exported for the dashboards that plot it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from lockgate.ipc.messages import EngineStats

# vLLM's bounds (vllm/v1/metrics/loggers.py), with finer ones below them where CPU latencies live
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model = model_name
        self._labels = labels

        def latency(name: str, doc: str, buckets: tuple[float, ...] = REQUEST_BUCKETS) -> Histogram:
            return Histogram(f"lockgate:{name}", doc, labels, buckets=buckets, registry=r)

        self.ttft = latency("time_to_first_token_seconds", "Time from request arrival to its first token",
                            TTFT_BUCKETS)
        self.itl = latency("inter_token_latency_seconds", "Time between consecutive output tokens", ITL_BUCKETS)
        self.e2e = latency("e2e_request_latency_seconds", "Time from request arrival to its last token")
        self.queue = latency("request_queue_time_seconds", "Time from arrival until the scheduler admitted it")
        self.inference = latency("request_inference_time_seconds", "Time from admission to the last token")
        self.prefill = latency("request_prefill_time_seconds", "Time from admission to the first token")
        self.decode = latency("request_decode_time_seconds", "Time from the first token to the last")
        self.params_n = Histogram("lockgate:request_params_n", "The n parameter of requests", labels,
                                  buckets=N_BUCKETS, registry=r)
        self.running = Gauge("lockgate:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("lockgate:num_requests_waiting", "Requests in the waiting queue", labels, registry=r)
        self.kv_usage = Gauge("lockgate:kv_cache_usage_perc", "KV pool usage, 1 = full (used slots / capacity)",
                              labels, registry=r)
        self.kv_used = Gauge("lockgate:kv_slots_used", "KV slots held by requests", labels, registry=r)
        self.kv_capacity = Gauge("lockgate:kv_slots_capacity", "KV pool capacity in tokens", labels, registry=r)
        self.prompt_tokens = Counter("lockgate:prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=r)
        self.generation_tokens = Counter("lockgate:generation_tokens", "Generated tokens", labels, registry=r)
        self.requests = Counter("lockgate:request_success", "Finished requests by finish reason",
                                [*labels, "finished_reason"], registry=r)
        self.grammar_compiles = Counter("lockgate:grammar_compiles", "Output constraints checked by the grammar "
                                        "sandbox, by outcome: ok, invalid, crash (the compiler died on it), "
                                        "timeout, busy (429: its queue was full), cached (answered from its cache)",
                                        [*labels, "outcome"], registry=r)
        self.preemptions = Counter("lockgate:num_preemptions", "Preempted requests (always 0: peak admission "
                                   "never lets a running request run out of KV slots)", labels, registry=r)
        self.prefix_queries = Counter("lockgate:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter("lockgate:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels,
                                   registry=r)
        self.spec_draft = Counter("lockgate:spec_decode_num_draft_tokens", "Speculative guesses fed to the model",
                                  labels, registry=r)
        self.spec_accepted = Counter("lockgate:spec_decode_num_accepted_tokens",
                                     "Speculative guesses the model agreed with (tokens gained)", labels, registry=r)
        tl = [*labels, "tenant"]
        self.tenant_prompt_tokens = Counter("lockgate:tenant_prompt_tokens", "Prompt tokens of finished requests, "
                                            "per tenant", tl, registry=r)
        self.tenant_generation_tokens = Counter("lockgate:tenant_generation_tokens", "Generated tokens, per tenant",
                                                tl, registry=r)
        self.tenant_waiting = Gauge("lockgate:tenant_requests_waiting", "Requests accepted and waiting for their "
                                    "first token, per tenant", tl, registry=r)
        self.tenant_ttft = Histogram("lockgate:tenant_time_to_first_token_seconds", "Time from request arrival to "
                                     "its first token, per tenant", tl, buckets=TTFT_BUCKETS, registry=r)
        # LoRA: requests per adapter, slot traffic, and vLLM's info gauge (labels carry the names)
        self.lora_running = Gauge("lockgate:lora_requests_running", "Running requests per LoRA adapter",
                                  [*labels, "lora_name"], registry=r)
        self.lora_waiting = Gauge("lockgate:lora_requests_waiting", "Waiting requests per LoRA adapter",
                                  [*labels, "lora_name"], registry=r)
        self.lora_loads = Counter("lockgate:lora_loads", "LoRA adapters put into one of the --max-loras slots",
                                  labels, registry=r)
        self.lora_evictions = Counter("lockgate:lora_evictions", "LoRA adapters taken out of a slot for another",
                                      labels, registry=r)
        self.lora_info = Gauge("lockgate:lora_requests_info", "vLLM's LoRA info gauge: value = time of the update",
                               ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self._lora_seen = (0, 0)
        self._lora_names: set[str] = set()
        # token-count histograms: buckets up to the context length, known once the engine is ready
        self.request_prompt_tokens: Histogram | None = None
        self.request_generation_tokens: Histogram | None = None
        self.max_generation_tokens: Histogram | None = None
        self.params_max_tokens: Histogram | None = None
        self._spec_seen = (0, 0)  # the scheduler's running totals at the last update
        for series in (self.spec_draft, self.spec_accepted, self.preemptions, self.prompt_tokens,
                       self.generation_tokens, self.prefix_queries, self.prefix_hits, self.lora_loads,
                       self.lora_evictions):
            series.labels(model_name)  # export zeros from the start
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(model_name, reason)

    def on_ready(self, max_model_len: int) -> None:
        """Create the token-count histograms (1-2-5 buckets up to the context length); once."""
        if self.request_prompt_tokens is not None:
            return
        buckets = one_two_five(max(max_model_len, 1))

        def tokens(name: str, doc: str) -> Histogram:
            h = Histogram(f"lockgate:{name}", doc, self._labels, buckets=buckets, registry=self.registry)
            h.labels(self.model)
            return h

        self.request_prompt_tokens = tokens("request_prompt_tokens", "Prompt tokens per request")
        self.request_generation_tokens = tokens("request_generation_tokens", "Generated tokens per request")
        self.max_generation_tokens = tokens("request_max_num_generation_tokens",
                                            "Most tokens generated by one sequence of a request (n > 1)")
        self.params_max_tokens = tokens("request_params_max_tokens", "The max_tokens parameter of requests")

    def finished(self, prompt_tokens: int, generation_tokens: int, e2e: float, queue: float | None,
                 first_token: float | None) -> None:
        """One engine request finished: ``e2e`` seconds after arrival, admitted ``queue`` seconds after
        it, its first token ``first_token`` seconds after it (None: it produced none)."""
        m = self.model
        self.e2e.labels(m).observe(e2e)
        if queue is not None:
            self.inference.labels(m).observe(max(e2e - queue, 0.0))
            if first_token is not None:
                self.prefill.labels(m).observe(max(first_token - queue, 0.0))
        if first_token is not None:
            self.decode.labels(m).observe(max(e2e - first_token, 0.0))
        if self.request_prompt_tokens is not None and self.request_generation_tokens is not None:
            self.request_prompt_tokens.labels(m).observe(prompt_tokens)
            self.request_generation_tokens.labels(m).observe(generation_tokens)

    def group_finished(self, n: int, max_tokens: int, most_generated: int) -> None:
        """Every sequence of one prompt's ``n`` (a parallel sampling group) finished."""
        m = self.model
        self.params_n.labels(m).observe(n)
        if self.max_generation_tokens is not None and self.params_max_tokens is not None:
            self.max_generation_tokens.labels(m).observe(most_generated)
            self.params_max_tokens.labels(m).observe(max_tokens)

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
        self._update_lora(s)

    def keep_adapters(self, names: set[str]) -> None:
        """Only these adapters are loaded now: the per-adapter series of the others go."""
        for gone in self._lora_names - names:
            self.lora_running.remove(self.model, gone)
            self.lora_waiting.remove(self.model, gone)
        self._lora_names &= names

    def _update_lora(self, s: EngineStats) -> None:
        m = self.model
        loads, evictions = self._lora_seen
        if s.lora_loads > loads or s.lora_evictions > evictions:
            self.lora_loads.labels(m).inc(s.lora_loads - loads)
            self.lora_evictions.labels(m).inc(s.lora_evictions - evictions)
            self._lora_seen = (s.lora_loads, s.lora_evictions)
        names = set(s.lora_running) | set(s.lora_waiting)
        self.keep_adapters(names)
        self._lora_names = names
        for name in names:
            self.lora_running.labels(m, name).set(s.lora_running.get(name, 0))
            self.lora_waiting.labels(m, name).set(s.lora_waiting.get(name, 0))
        if s.max_loras:
            self.lora_info.clear()
            running = ",".join(sorted(n for n, k in s.lora_running.items() if k))
            waiting = ",".join(sorted(n for n, k in s.lora_waiting.items() if k))
            self.lora_info.labels(str(s.max_loras), running, waiting).set(time.time())

    def set_tenant_queues(self, waiting: dict[str, int], labels: Iterable[str]) -> None:
        """The per-tenant waiting gauge as the API's streams are now, for every tenant label (0 when idle)."""
        for tenant in {*labels, *waiting}:
            self.tenant_waiting.labels(self.model, tenant).set(waiting.get(tenant, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
