"""Routing ablation: workloads x fleet sizes x gateway policies through ``lockgate serve --dp N``, in one run.

For each (workload, N, policy) a fresh ``lockgate serve --dp N --policy P`` (gateway + N replicas on
this machine) is started, ``lockgate bench`` runs the workload against the gateway, and the run is
scored by total tok/s, TTFT p50/p99 and the real cache hit rate, read three ways that must agree:
the gateway's attribution counters (``lockgate:gateway_real_cached_tokens`` / ``..._prompt_tokens``,
per policy), the replicas' own ``lockgate:prefix_cache_hits`` / ``queries`` counters, and the bench's
``cached_prompt_tokens`` (the usage the replicas returned). The gateway's predicted cached tokens
are reported next to the real ones. Everything is stopped by pid before the next run. Prints one
JSON document (machine: CPU model and flags; the command; one row per run; ratios of ``forecast``
to the others per workload and N) and writes it to ``--out``.

Workloads (``lockgate bench``'s, sized per replica so 2 and 4 replicas see the same load each):

* ``shared-prefix``: ``--groups-per-replica`` groups x ``--per-group`` prompts of a ``--prefix``-token
  shared prefix + ``--suffix`` unique tokens, ``--output`` out;
* ``multi-turn``: ``--conversations-per-replica`` conversations of ``--turns`` turns, each turn a new
  ``--turn-input``-token user message on top of the whole conversation so far.

Each replica's KV pool is capped (``--max-total-tokens``) so that one replica cannot hold every
group's prefix or every conversation: the regime where sending a request where its prefix is matters.

The default model is ``sim`` with a CPU-like step cost (``--sim-step-ms 20 --sim-token-ms 0.5``: a
decode step of 8 rows ~24 ms, a 1,024-token prefill ~0.5 s), so that prefill is real work, as on a
CPU, while 4 replicas still fit on 2 cores (the sim sleeps instead of computing). ``--model default``
runs the real default model instead (keep the counts small on 2 cores).

Usage: .venv/bin/python benchmarks/routing.py [--out benchmarks/results/routing_forecast.json]
       [--dps 2,4] [--workloads shared-prefix,multi-turn] [--policies forecast,prefix-cache,least-request]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _common import command, cpu_model_and_flags

PY = sys.executable


def free_port_run(n: int) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port run")


def wait_fleet(url: str, dp: int, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).json().get("healthy") == dp:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError("replicas not healthy in time")


def _sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def replica_cache_counters(replica_urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in replica_urls:
        text = httpx.get(u + "/metrics", timeout=10).text
        hits += _sum(text, "lockgate:prefix_cache_hits_total")
        queries += _sum(text, "lockgate:prefix_cache_queries_total")
    return hits, queries


def bench_args(a: argparse.Namespace, workload: str, dp: int) -> list[str]:
    conc = str(a.concurrency_per_replica * dp)
    if workload == "shared-prefix":
        return ["--workload", "shared-prefix", "--groups", str(a.groups_per_replica * dp), "--prompts-per-group",
                str(a.per_group), "--prefix-len", str(a.prefix), "--suffix-len", str(a.suffix), "--output-len",
                str(a.output), "--max-concurrency", conc]
    if workload == "multi-turn":
        n = a.conversations_per_replica * dp * a.turns
        return ["--workload", "multi-turn", "--num-requests", str(n), "--turns", str(a.turns), "--input-len",
                str(a.turn_input), "--output-len", str(a.output), "--max-concurrency", conc]
    raise ValueError(f"unknown workload {workload!r}")


def run_one(a: argparse.Namespace, workload: str, dp: int, policy: str, workdir: Path) -> dict[str, Any]:
    port = free_port_run(dp + 1)
    url = f"http://127.0.0.1:{port}"
    tag = f"{workload}-{dp}-{policy}"
    serve = [PY, "-m", "lockgate.cli", "serve", "--model", a.model, "--dp", str(dp), "--port", str(port),
             "--policy", policy, "--max-total-tokens", str(a.max_total_tokens), "--log-level", "WARNING"]
    if a.model == "sim":
        serve += ["--max-model-len", "8192", "--sim-step-ms", str(a.sim_step_ms), "--sim-token-ms", str(a.sim_token_ms)]
    with (workdir / f"serve-{tag}.log").open("wb") as log:
        proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_fleet(url, dp, proc)
        replicas = [r["url"] for r in httpx.get(url + "/v1/loads").json()["replicas"]]
        out = workdir / f"bench-{tag}.json"
        bench = [PY, "-m", "lockgate.cli", "bench", "--url", url, *bench_args(a, workload, dp), "--seed", str(a.seed),
                 "--out", str(out), "--log-level", "WARNING", "--no-progress",
                 "--tokenizer", a.model]  # local tokenizer: no /tokenize calls through the gateway
        t0 = time.monotonic()
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        wall = time.monotonic() - t0
        hits, queries = replica_cache_counters(replicas)
        gw_text = httpx.get(url + "/metrics", timeout=30).text
        real = _sum(gw_text, "lockgate:gateway_real_cached_tokens_total")
        predicted = _sum(gw_text, "lockgate:gateway_predicted_cached_tokens_total")
        prompt = _sum(gw_text, "lockgate:gateway_prompt_tokens_total")
        routed = re.findall(r'^lockgate:gateway_requests_total\{policy="[^"]*",reason="([^"]*)",replica="([^"]*)"\} '
                            r'(\S+)$', gw_text, re.M)
        by_replica: dict[str, int] = {}
        by_reason: dict[str, int] = {}
        for reason, replica, n in routed:
            by_replica[replica] = by_replica.get(replica, 0) + int(float(n))
            by_reason[reason] = by_reason.get(reason, 0) + int(float(n))
        result = json.loads(out.read_text())
        s = result["summary"]
        return {"workload": workload, "dp": dp, "policy": policy, "completed": s["completed"], "failed": s["failed"],
                "total_tok_s": s["total_token_throughput"], "output_tok_s": s["output_throughput"],
                "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p99_ms": s["ttft_p99_ms"],
                "real_hit_rate": round(real / prompt, 3) if prompt else None,
                "predicted_hit_rate": round(predicted / prompt, 3) if prompt else None,
                "replica_cache_hit_rate": round(hits / queries, 3) if queries else None,
                "bench_cached_prompt_tokens": s.get("cached_prompt_tokens"),
                "gateway_real_cached_tokens": int(real), "gateway_predicted_cached_tokens": int(predicted),
                "gateway_prompt_tokens": int(prompt), "requests_per_replica": sorted(by_replica.values()),
                "route_reasons": by_reason, "bench_wall_s": round(wall, 1)}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def ratios(rows: list[dict[str, Any]], policies: list[str]) -> list[dict[str, Any]]:
    """forecast's total tok/s and TTFT p99 against each other policy, per workload and fleet size."""
    out = []
    if "forecast" not in policies:
        return out
    for key in sorted({(r["workload"], r["dp"]) for r in rows}):
        by = {r["policy"]: r for r in rows if (r["workload"], r["dp"]) == key}
        f = by.get("forecast")
        if f is None:
            continue
        for p, r in by.items():
            if p == "forecast":
                continue
            out.append({"workload": key[0], "dp": key[1], "vs": p,
                        "total_tok_s_ratio": round(f["total_tok_s"] / r["total_tok_s"], 3),
                        "ttft_p99_ratio": round(f["ttft_p99_ms"] / r["ttft_p99_ms"], 3)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="sim")
    ap.add_argument("--dps", default="2,4", help="fleet sizes, comma separated")
    ap.add_argument("--workloads", default="shared-prefix,multi-turn")
    ap.add_argument("--policies", default="forecast,prefix-cache,least-request")
    ap.add_argument("--groups-per-replica", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--conversations-per-replica", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-input", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--concurrency-per-replica", type=int, default=8)
    ap.add_argument("--max-total-tokens", type=int, default=6144)
    ap.add_argument("--sim-step-ms", type=float, default=20.0)
    ap.add_argument("--sim-token-ms", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = ap.parse_args()
    cpu, flags = cpu_model_and_flags()
    policies = a.policies.split(",")
    result: dict[str, Any] = {
        "benchmark": "routing", "model": a.model, "command": command(),
        "machine": {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(),
                    "load_average_at_start": [round(x, 2) for x in os.getloadavg()]},
        "config": {k: getattr(a, k) for k in ("dps", "workloads", "policies", "groups_per_replica", "per_group",
                                              "prefix", "suffix", "conversations_per_replica", "turns", "turn_input",
                                              "output", "concurrency_per_replica", "max_total_tokens", "sim_step_ms",
                                              "sim_token_ms", "seed")},
        "rows": []}
    with tempfile.TemporaryDirectory(prefix="lockgate-routing-") as d:
        for workload in a.workloads.split(","):
            for dp in (int(x) for x in a.dps.split(",")):
                for policy in policies:
                    row = run_one(a, workload, dp, policy, Path(d))
                    result["rows"].append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    result["ratios"] = ratios(result["rows"], policies)
    result["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(result, indent=1)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
