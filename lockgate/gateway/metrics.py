"""Prometheus metrics of the gateway, prefix ``lockgate:gateway_`` (served at the gateway's ``/metrics``).

One private registry per gateway. Counters: requests by replica, policy and route reason; prefix
blocks looked up and matched (their ratio is the gateway's expected hit rate; the replicas' own
``lockgate:prefix_cache_*`` counters say what really hit); retries by cause; replica health
changes; replica restarts (``serve --dp``); proxy errors by kind. Counters start at 0: retries for
each replica and the usual causes (``RETRY_CAUSES``) from its first health change on, errors for every kind. Gauges: each replica's health and
load, and its queue ETA as the gateway estimates it (``gateway_replica_queue_eta_seconds``).

Hit attribution, by replica and policy, over the answered generation requests whose replica reported
its counts (a header on whole responses, a comment line at the end of streams): the prompt tokens
(``gateway_prompt_tokens``), the tokens the replica really served from its prefix cache
(``gateway_real_cached_tokens``) and the tokens the gateway predicted it would (its matched blocks'
share of the prompt, ``gateway_predicted_cached_tokens``). real / prompt is the hit rate a policy
earns; real / predicted says how right the gateway's picture of the caches is (below 1: replicas
evicted what the index still lists; above 1: they shared more than whole blocks, or than the index knew).

Fleet series: every scrape of the gateway's ``/metrics`` also scrapes its healthy replicas and
re-exports their ``lockgate:`` series with a ``replica`` label added (``FleetCollector``), so one
scrape target shows the whole fleet and ``sum without (replica)`` gives fleet totals; the
dashboard's queries (``sum by (le)``, rates) work on them unchanged. One exposition format
(prometheus_client's latest text format) on the gateway and on every engine.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from lockgate.gateway.policy import Route

CONTENT_TYPE = CONTENT_TYPE_LATEST
RETRY_CAUSES = ("ConnectError", "429", "503")  # the usual retry causes: each replica's series start at 0


class FleetCollector:
    """The replicas' last scraped series, each sample labelled with its replica's URL."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}  # replica URL -> its /metrics text

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for replica, text in self.texts.items():
            try:
                families = list(text_string_to_metric_families(text))
            except ValueError:
                continue  # not an exposition we can read: left out, the rest still shows
            for fam in families:
                if not fam.name.startswith("lockgate:") or fam.name.startswith("lockgate:gateway_"):
                    continue
                out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
                out.samples += [Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                                for s in fam.samples]
        yield from merged.values()


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("lockgate:gateway_requests", "Requests routed, by replica, policy and reason",
                                ["replica", "policy", "reason"], registry=r)
        self.blocks_queried = Counter("lockgate:gateway_prefix_blocks_queried",
                                      "Prompt blocks looked up in the gateway's prefix index", registry=r)
        self.blocks_matched = Counter("lockgate:gateway_prefix_blocks_matched",
                                      "Prompt blocks found on the chosen replica", registry=r)
        self.retries = Counter("lockgate:gateway_retries", "Requests retried on another replica, by cause",
                               ["replica", "cause"], registry=r)
        self.health_changes = Counter("lockgate:gateway_replica_health_changes",
                                      "Replica health transitions", ["replica", "to"], registry=r)
        self.restarts = Counter("lockgate:gateway_replica_restarts", "Replicas restarted by serve --dp after "
                                "exiting on their own", ["replica"], registry=r)
        self.errors = Counter("lockgate:gateway_errors", "Requests the gateway could not complete, by kind",
                              ["kind"], registry=r)
        self.healthy = Gauge("lockgate:gateway_replica_healthy", "1 if the replica takes traffic", ["replica"],
                             registry=r)
        self.load = Gauge("lockgate:gateway_replica_load", "Requests in flight on the replica, as routed on",
                          ["replica"], registry=r)
        self.queue_eta = Gauge("lockgate:gateway_replica_queue_eta_seconds", "The replica's queue ETA as the "
                               "gateway estimates it (its last report, aged, plus what was sent there since)",
                               ["replica"], registry=r)
        self.predicted_cached = Counter("lockgate:gateway_predicted_cached_tokens", "Prompt tokens the gateway "
                                        "expected the replica to serve from its prefix cache (matched blocks)",
                                        ["replica", "policy"], registry=r)
        self.real_cached = Counter("lockgate:gateway_real_cached_tokens", "Prompt tokens the replica reported "
                                   "it served from its prefix cache", ["replica", "policy"], registry=r)
        self.prompt_tokens = Counter("lockgate:gateway_prompt_tokens", "Prompt tokens of the requests whose "
                                     "replica reported its counts", ["replica", "policy"], registry=r)
        for kind in ("no_replica", "upstream", "midstream", "refused"):
            self.errors.labels(kind)
        self.fleet = FleetCollector()
        r.register(self.fleet)

    def routed(self, route: Route) -> None:
        self.requests.labels(route.replica, route.policy, route.reason).inc()
        if route.total_blocks:
            self.blocks_queried.inc(route.total_blocks)
            self.blocks_matched.inc(route.matched_blocks)

    def attributed(self, replica: str, policy: str, predicted: int, real: int, prompt: int) -> None:
        self.predicted_cached.labels(replica, policy).inc(predicted)
        self.real_cached.labels(replica, policy).inc(real)
        self.prompt_tokens.labels(replica, policy).inc(prompt)

    def health(self, replica: str, healthy: bool) -> None:
        for cause in RETRY_CAUSES:  # exported with 0 from the replica's first health check on
            self.retries.labels(replica, cause)
        self.health_changes.labels(replica, "healthy" if healthy else "unhealthy").inc()
        self.healthy.labels(replica).set(1 if healthy else 0)

    def forget(self, replica: str) -> None:
        """The replica left the fleet: drop its gauges (its counters stay, they are history)."""
        for gauge in (self.healthy, self.load, self.queue_eta):
            try:
                gauge.remove(replica)
            except KeyError:
                pass

    def render(self, loads: dict[str, int], replica_texts: dict[str, str] | None = None,
               etas: dict[str, float] | None = None) -> bytes:
        """The gateway's series, and the replicas' (``replica_texts``: URL -> their /metrics text)."""
        for replica, n in loads.items():
            self.load.labels(replica).set(n)
        for replica, eta in (etas or {}).items():
            self.queue_eta.labels(replica).set(eta)
        self.fleet.texts = replica_texts or {}
        try:
            return generate_latest(self.registry)
        finally:
            self.fleet.texts = {}
