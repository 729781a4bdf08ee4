"""Writes dashboards/grafana.json: lockgate's Grafana dashboard (engines, and the fleet behind a gateway).

Run ``python dashboards/make_grafana.py`` after changing a panel; the JSON is committed beside this
script. Every series a panel queries exists on a running server (``tests/test_gateway.py`` scrapes a
gateway, which re-exports its replicas' series, and checks each one). The panels cover what vLLM's
example dashboard shows (the same concepts under the same names, ``lockgate:`` for ``vllm:``), plus
the prefix cache, speculation and the gateway's routing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SEL = '{model_name=~"$model_name"}'
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def quantiles(metric: str) -> list[tuple[str, str]]:
    q = [(f"P{int(p * 100)}", f"histogram_quantile({p}, sum by(le) (rate(lockgate:{metric}_bucket{SEL}[$__rate_interval])))")
         for p in (0.99, 0.95, 0.9, 0.5)]
    mean = (f"rate(lockgate:{metric}_sum{SEL}[$__rate_interval])\n/\n"
            f"rate(lockgate:{metric}_count{SEL}[$__rate_interval])")
    return [*q, ("Mean", mean)]


def heatmap_target(metric: str) -> list[tuple[str, str]]:
    return [("{{le}}", f"sum by(le) (increase(lockgate:{metric}_bucket{SEL}[$__rate_interval]))")]


PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [  # (title, kind, unit, [(legend, expr)])
    ("E2E Request Latency", "timeseries", "s", quantiles("e2e_request_latency_seconds")),
    ("Token Throughput", "timeseries", "none", [
        ("Prompt tokens/s", f"sum(rate(lockgate:prompt_tokens_total{SEL}[$__rate_interval]))"),
        ("Generation tokens/s", f"sum(rate(lockgate:generation_tokens_total{SEL}[$__rate_interval]))")]),
    ("Inter-Token Latency", "timeseries", "s", quantiles("inter_token_latency_seconds")),
    ("Scheduler State", "timeseries", "none", [
        ("Running", f"sum(lockgate:num_requests_running{SEL})"),
        ("Waiting", f"sum(lockgate:num_requests_waiting{SEL})"),
        ("Preemptions/s", f"sum(rate(lockgate:num_preemptions_total{SEL}[$__rate_interval]))")]),
    ("Time To First Token", "timeseries", "s", quantiles("time_to_first_token_seconds")),
    ("KV Cache Usage", "timeseries", "percentunit", [
        ("{{replica}}", f"lockgate:kv_cache_usage_perc{SEL}")]),
    ("Request Prompt Length", "heatmap", "none", heatmap_target("request_prompt_tokens")),
    ("Request Generation Length", "heatmap", "none", heatmap_target("request_generation_tokens")),
    ("Finish Reason", "timeseries", "none", [
        ("{{finished_reason}}",
         f"sum by(finished_reason) (increase(lockgate:request_success_total{SEL}[$__rate_interval]))")]),
    ("Queue Time", "timeseries", "s", [
        ("Queue time (s per s)", f"sum(rate(lockgate:request_queue_time_seconds_sum{SEL}[$__rate_interval]))")]),
    ("Requests Prefill and Decode Time", "timeseries", "s", [
        ("Prefill", f"sum(rate(lockgate:request_prefill_time_seconds_sum{SEL}[$__rate_interval]))"),
        ("Decode", f"sum(rate(lockgate:request_decode_time_seconds_sum{SEL}[$__rate_interval]))")]),
    ("Max Generation Tokens per Sampling Group", "heatmap", "none",
     heatmap_target("request_max_num_generation_tokens")),
    ("Prefix Cache Hit Rate", "timeseries", "percentunit", [
        ("Hit rate", f"sum(rate(lockgate:prefix_cache_hits_total{SEL}[$__rate_interval]))\n/\n"
                     f"sum(rate(lockgate:prefix_cache_queries_total{SEL}[$__rate_interval]))")]),
    ("Speculative Decoding Acceptance", "timeseries", "percentunit", [
        ("Accepted / drafted", f"sum(rate(lockgate:spec_decode_num_accepted_tokens_total{SEL}[$__rate_interval]))\n/\n"
                               f"sum(rate(lockgate:spec_decode_num_draft_tokens_total{SEL}[$__rate_interval]))")]),
    ("Gateway: Requests by Replica", "timeseries", "reqps", [
        ("{{replica}} ({{reason}})", "sum by(replica, reason) (rate(lockgate:gateway_requests_total[$__rate_interval]))"),
        ("Retries {{cause}}", "sum by(cause) (rate(lockgate:gateway_retries_total[$__rate_interval]))")]),
    ("Gateway: Replica Health and Load", "timeseries", "none", [
        ("healthy {{replica}}", "lockgate:gateway_replica_healthy"),
        ("in flight {{replica}}", "lockgate:gateway_replica_load")]),
]


def panel(i: int, title: str, kind: str, unit: str, targets: list[tuple[str, str]]) -> dict[str, Any]:
    p: dict[str, Any] = {
        "id": i + 1, "title": title, "type": kind, "datasource": DS,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + j),
                     "range": True, **({"format": "heatmap"} if kind == "heatmap" else {})}
                    for j, (legend, expr) in enumerate(targets)],
    }
    if kind == "heatmap":
        p["options"] = {"calculate": False, "yAxis": {"unit": "none"}, "color": {"scheme": "Spectral", "mode": "scheme"}}
    return p


def dashboard() -> dict[str, Any]:
    return {
        "title": "lockgate", "uid": "lockgate", "description": "lockgate engines and gateway",
        "schemaVersion": 39, "editable": True, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "datasource", "type": "datasource", "query": "prometheus"},
            {"name": "model_name", "label": "model", "type": "query", "datasource": DS, "includeAll": True,
             "multi": True, "query": "label_values(lockgate:num_requests_running, model_name)",
             "refresh": 2, "current": {"text": "All", "value": "$__all"}},
        ]},
        "panels": [panel(i, *spec) for i, spec in enumerate(PANELS)],
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("grafana.json")
    out.write_text(json.dumps(dashboard(), indent=1) + "\n")
    print(f"wrote {out} ({len(PANELS)} panels)")
