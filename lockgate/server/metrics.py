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
``num_preemptions`` counts retracted requests: 0 under peak admission (the default), which never
lets a running request run out of KV slots; ``--admission ratio`` retracts when decode runs short,
and ``recomputed_prompt_tokens`` counts what those requests computed again on resumption.

Labels: ``model_name`` (the first served name) and ``engine`` (``"0"``: one engine per server; a
gateway adds ``replica``), as vLLM's. Every counter exists with 0 from the start (its label values
known then), so rates and dashboard panels have a series before the first event. vLLM series with
no concept here are not exported: external KV transfer and multimodal caches, KV block residency
(the pool has no blocks), sleep mode, CUDA graphs, the deprecated ``time_per_output_token_seconds``.
In ``cache_config_info`` a block is one token: ``block_size`` 1, ``num_gpu_blocks`` the pool's tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from lockgate.config import EngineConfig
from lockgate.ipc.messages import EngineStats

# vLLM's bounds (vllm/v1/metrics/loggers.py), with finer ones below them where CPU latencies live
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's, without CUDA graphs
ENGINE = "0"  # the ``engine`` label: one engine per server
PROMPT_SOURCES = ("local_compute", "local_cache_hit")  # vLLM's prompt token sources that exist here

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
    def __init__(self, model_name: str, engine: EngineConfig | None = None) -> None:
        """``engine``: the served config, for ``cache_config_info`` and the speculation positions."""
        self.registry = r = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.model = model_name
        self.key = (model_name, ENGINE)  # the label values of every series (``series.labels(*key)``)
        self._labels = labels
        self._engine = engine

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
        self.tpot = latency("request_time_per_output_token_seconds", "A request's decode time per output token "
                            "after the first (its mean inter-token latency)", ITL_BUCKETS)
        self.iteration_tokens = Histogram("lockgate:iteration_tokens_total", "Tokens per engine step (prompt tokens "
                                          "prefilled + tokens generated)", labels, buckets=ITERATION_BUCKETS,
                                          registry=r)
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
        self.prompt_tokens_cached = Counter("lockgate:prompt_tokens_cached", "Prompt tokens of finished requests "
                                            "taken from the prefix cache", labels, registry=r)
        self.prompt_tokens_by_source = Counter("lockgate:prompt_tokens_by_source", "Prompt tokens of finished "
                                               "requests by source: local_compute (prefilled), local_cache_hit "
                                               "(from the prefix cache)", [*labels, "source"], registry=r)
        self.generation_tokens = Counter("lockgate:generation_tokens", "Generated tokens", labels, registry=r)
        self.requests = Counter("lockgate:request_success", "Finished requests by finish reason",
                                [*labels, "finished_reason"], registry=r)
        self.grammar_compiles = Counter("lockgate:grammar_compiles", "Output constraints checked by the grammar "
                                        "sandbox, by outcome: ok, invalid, crash (the compiler died on it), "
                                        "timeout, busy (429: its queue was full), cached (answered from its cache)",
                                        [*labels, "outcome"], registry=r)
        self.preemptions = Counter("lockgate:num_preemptions", "Running requests retracted for KV slots (0 under "
                                   "peak admission; --admission ratio retracts)", labels, registry=r)
        self.recomputed = Counter("lockgate:recomputed_prompt_tokens", "Tokens retracted requests computed again "
                                  "on resumption (what the prefix cache no longer held)", labels, registry=r)
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
        self.spec_drafts = Counter("lockgate:spec_decode_num_drafts", "Drafts: a request fed guesses in a step",
                                   labels, registry=r)
        self.spec_per_pos = Counter("lockgate:spec_decode_num_accepted_tokens_per_pos", "Accepted guesses by their "
                                    "position in the draft (0: the first)", [*labels, "position"], registry=r)
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
        self.prefill_kv_computed: Histogram | None = None
        self.cache_config_info: Gauge | None = None
        self._spec_seen = (0, 0, 0)  # the scheduler's running totals at the last update
        self._retract_seen = (0, 0)  # retractions, recomputed tokens at the last update
        self._per_pos_seen: list[int] = []
        self._steps_seen = 0
        key = self.key
        for series in (self.spec_draft, self.spec_accepted, self.spec_drafts, self.preemptions, self.recomputed,
                       self.prompt_tokens,
                       self.prompt_tokens_cached, self.generation_tokens, self.prefix_queries, self.prefix_hits,
                       self.lora_loads, self.lora_evictions):
            series.labels(*key)  # export zeros from the start
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(*key, reason)
        for source in PROMPT_SOURCES:
            self.prompt_tokens_by_source.labels(*key, source)
        for pos in range(engine.scheduler.speculative_tokens if engine is not None else 0):
            self.spec_per_pos.labels(*key, str(pos))

    def on_ready(self, max_model_len: int, capacity: int | None = None, dtype: str | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        """Create the token-count histograms (1-2-5 buckets up to the context length) and, given the pool's
        ``capacity`` (tokens), the model's ``dtype`` and what the pool stores, ``cache_config_info``; once."""
        if self.request_prompt_tokens is not None:
            return
        buckets = one_two_five(max(max_model_len, 1))

        def tokens(name: str, doc: str) -> Histogram:
            h = Histogram(f"lockgate:{name}", doc, self._labels, buckets=buckets, registry=self.registry)
            h.labels(*self.key)
            return h

        self.prefill_kv_computed = tokens("request_prefill_kv_computed_tokens", "Prompt tokens a request prefilled "
                                          "(its prompt less what the prefix cache held)")
        if capacity is not None and self._engine is not None:
            e = self._engine
            info = {"engine": ENGINE, "block_size": "1", "num_gpu_blocks": str(capacity), "num_cpu_blocks": "0",
                    "cache_dtype": kv_cache_dtype if kv_cache_dtype in ("int8", "fp8_e4m3") else "auto",
                    "kv_dtype": kv_cache_dtype if kv_cache_dtype != "auto" else dtype or "", "enable_prefix_caching":
                    str(not e.scheduler.disable_prefix_cache), "gpu_memory_utilization":
                    str(e.cache.gpu_memory_utilization or "")}
            self.cache_config_info = Gauge("lockgate:cache_config_info", "The KV cache's configuration (vLLM's "
                                           "info gauge: always 1; a block is one token)", list(info),
                                           registry=self.registry)
            self.cache_config_info.labels(**info).set(1)

        self.request_prompt_tokens = tokens("request_prompt_tokens", "Prompt tokens per request")
        self.request_generation_tokens = tokens("request_generation_tokens", "Generated tokens per request")
        self.max_generation_tokens = tokens("request_max_num_generation_tokens",
                                            "Most tokens generated by one sequence of a request (n > 1)")
        self.params_max_tokens = tokens("request_params_max_tokens", "The max_tokens parameter of requests")

    def finished(self, prompt_tokens: int, generation_tokens: int, cached_tokens: int, e2e: float,
                 queue: float | None, first_token: float | None) -> None:
        """One engine request finished: ``cached_tokens`` of its prompt came from the prefix cache; ``e2e``
        seconds after arrival, admitted ``queue`` seconds after it, its first token ``first_token`` seconds
        after it (None: it produced none)."""
        k = self.key
        cached = min(max(cached_tokens, 0), prompt_tokens)
        self.prompt_tokens.labels(*k).inc(prompt_tokens)
        self.prefix_queries.labels(*k).inc(prompt_tokens)
        self.prefix_hits.labels(*k).inc(cached)
        self.prompt_tokens_cached.labels(*k).inc(cached)
        self.prompt_tokens_by_source.labels(*k, "local_cache_hit").inc(cached)
        self.prompt_tokens_by_source.labels(*k, "local_compute").inc(prompt_tokens - cached)
        self.e2e.labels(*k).observe(e2e)
        if queue is not None:
            self.inference.labels(*k).observe(max(e2e - queue, 0.0))
            if first_token is not None:
                self.prefill.labels(*k).observe(max(first_token - queue, 0.0))
        if first_token is not None:
            decode = max(e2e - first_token, 0.0)
            self.decode.labels(*k).observe(decode)
            if generation_tokens > 1:
                self.tpot.labels(*k).observe(decode / (generation_tokens - 1))
        if self.request_prompt_tokens is not None and self.request_generation_tokens is not None:
            self.request_prompt_tokens.labels(*k).observe(prompt_tokens)
            self.request_generation_tokens.labels(*k).observe(generation_tokens)
        if self.prefill_kv_computed is not None:
            self.prefill_kv_computed.labels(*k).observe(prompt_tokens - cached)

    def group_finished(self, n: int, max_tokens: int, most_generated: int) -> None:
        """Every sequence of one prompt's ``n`` (a parallel sampling group) finished."""
        k = self.key
        self.params_n.labels(*k).observe(n)
        if self.max_generation_tokens is not None and self.params_max_tokens is not None:
            self.max_generation_tokens.labels(*k).observe(most_generated)
            self.params_max_tokens.labels(*k).observe(max_tokens)

    def update_stats(self, s: EngineStats) -> None:
        k = self.key
        self.running.labels(*k).set(s.running)
        self.waiting.labels(*k).set(s.waiting)
        self.kv_used.labels(*k).set(s.slots_used)
        self.kv_capacity.labels(*k).set(s.capacity)
        self.kv_usage.labels(*k).set(s.slots_used / max(s.capacity, 1))
        if s.num_steps > self._steps_seen:  # this batch reports a new step
            self.iteration_tokens.labels(*k).observe(s.step_tokens)
            self._steps_seen = s.num_steps
        retracted, recomputed = self._retract_seen
        if s.retractions > retracted or s.recomputed_tokens > recomputed:
            self.preemptions.labels(*k).inc(max(s.retractions - retracted, 0))
            self.recomputed.labels(*k).inc(max(s.recomputed_tokens - recomputed, 0))
            self._retract_seen = (s.retractions, s.recomputed_tokens)
        drafted, accepted, drafts = self._spec_seen
        if s.draft_tokens > drafted:
            self.spec_draft.labels(*k).inc(s.draft_tokens - drafted)
            self.spec_accepted.labels(*k).inc(s.accepted_tokens - accepted)
            self.spec_drafts.labels(*k).inc(s.drafts - drafts)
            self._spec_seen = (s.draft_tokens, s.accepted_tokens, s.drafts)
            seen = self._per_pos_seen + [0] * (len(s.accepted_per_pos) - len(self._per_pos_seen))
            for pos, (now, before) in enumerate(zip(s.accepted_per_pos, seen, strict=True)):
                if now > before:
                    self.spec_per_pos.labels(*k, str(pos)).inc(now - before)
            self._per_pos_seen = list(s.accepted_per_pos)
        self._update_lora(s)

    def keep_adapters(self, names: set[str]) -> None:
        """Only these adapters are loaded now: the per-adapter series of the others go."""
        for gone in self._lora_names - names:
            self.lora_running.remove(*self.key, gone)
            self.lora_waiting.remove(*self.key, gone)
        self._lora_names &= names

    def _update_lora(self, s: EngineStats) -> None:
        k = self.key
        loads, evictions = self._lora_seen
        if s.lora_loads > loads or s.lora_evictions > evictions:
            self.lora_loads.labels(*k).inc(s.lora_loads - loads)
            self.lora_evictions.labels(*k).inc(s.lora_evictions - evictions)
            self._lora_seen = (s.lora_loads, s.lora_evictions)
        names = set(s.lora_running) | set(s.lora_waiting)
        self.keep_adapters(names)
        self._lora_names = names
        for name in names:
            self.lora_running.labels(*k, name).set(s.lora_running.get(name, 0))
            self.lora_waiting.labels(*k, name).set(s.lora_waiting.get(name, 0))
        if s.max_loras:
            self.lora_info.clear()
            running = ",".join(sorted(n for n, k in s.lora_running.items() if k))
            waiting = ",".join(sorted(n for n, k in s.lora_waiting.items() if k))
            self.lora_info.labels(str(s.max_loras), running, waiting).set(time.time())

    def set_tenant_queues(self, waiting: dict[str, int], labels: Iterable[str]) -> None:
        """The per-tenant waiting gauge as the API's streams are now, for every tenant label (0 when idle)."""
        for tenant in {*labels, *waiting}:
            self.tenant_waiting.labels(*self.key, tenant).set(waiting.get(tenant, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
