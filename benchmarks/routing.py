"""Routing ablation: the shared-prefix workload through ``lockgate serve --dp N``, one run per gateway policy.

For each policy a fresh ``lockgate serve --dp N --policy P`` (gateway + N replicas on this
machine) is started, ``lockgate bench --workload shared-prefix`` runs against the gateway, and
the replicas' own ``lockgate:prefix_cache_*`` counters give the real cache hit rate (prompt
tokens served from the replicas' radix trees / prompt tokens looked up). Everything is stopped
by pid before the next policy. Prints one JSON line: machine, command, one row per policy.

Each replica's KV pool is capped (``--max-total-tokens``) so that one replica cannot hold every
group's prefix: the regime where sending a group to the replica that has it matters. With
pools big enough for everything, round-robin only pays N cold prefills per group instead of one.

Usage: .venv/bin/python benchmarks/routing.py [--model default --dp 2] [--policies
       prefix-cache,round-robin,least-request] [--groups 8 --per-group 8 --prefix 1024 --suffix 64
       --output 64 --concurrency 16 --max-total-tokens 6144]
       sim model, 4 replicas: --model sim --dp 4 --groups 16 --max-total-tokens 6144
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

import httpx
from _common import command

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


def cache_counters(replica_urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in replica_urls:
        text = httpx.get(u + "/metrics", timeout=10).text
        hits += sum(float(v) for v in re.findall(r"^lockgate:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))
        queries += sum(float(v) for v in
                       re.findall(r"^lockgate:prefix_cache_queries_total\{[^}]*\} (\S+)$", text, re.M))
    return hits, queries


def run_policy(a: argparse.Namespace, policy: str, workdir: Path) -> dict:
    port = free_port_run(a.dp + 1)
    url = f"http://127.0.0.1:{port}"
    log_path = workdir / f"serve-{policy}.log"
    serve = [PY, "-m", "lockgate.cli", "serve", "--model", a.model, "--dp", str(a.dp), "--port", str(port),
             "--policy", policy, "--max-total-tokens", str(a.max_total_tokens), "--log-level", "WARNING"]
    if a.model == "sim":
        serve += ["--max-model-len", "8192"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_fleet(url, a.dp, proc)
        replicas = [r["url"] for r in httpx.get(url + "/v1/loads").json()["replicas"]]
        out = workdir / f"bench-{policy}.json"
        bench = [PY, "-m", "lockgate.cli", "bench", "--url", url, "--workload", "shared-prefix",
                 "--groups", str(a.groups), "--prompts-per-group", str(a.per_group), "--prefix-len", str(a.prefix),
                 "--suffix-len", str(a.suffix), "--output-len", str(a.output), "--max-concurrency",
                 str(a.concurrency), "--seed", str(a.seed), "--out", str(out), "--log-level", "WARNING",
                 "--tokenizer", a.model]  # local tokenizer: no /tokenize calls through the gateway
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        hits, queries = cache_counters(replicas)
        per_replica = {r["url"]: r["reported"].get("num_steps") for r in httpx.get(url + "/v1/loads").json()["replicas"]}
        s = json.loads(out.read_text())["summary"]
        routed = re.findall(r'^lockgate:gateway_requests_total\{policy="[^"]*",reason="([^"]*)",replica="([^"]*)"\} '
                            r'(\S+)$', httpx.get(url + "/metrics").text, re.M)
        by_replica: dict[str, int] = {}
        by_reason: dict[str, int] = {}
        for reason, replica, n in routed:
            by_replica[replica] = by_replica.get(replica, 0) + int(float(n))
            by_reason[reason] = by_reason.get(reason, 0) + int(float(n))
        return {"policy": policy, "cache_hit_rate": round(hits / queries, 3) if queries else None,
                "completed": s["completed"], "failed": s["failed"], "output_tok_s": s["output_throughput"],
                "total_tok_s": s["total_token_throughput"], "ttft_p50_ms": s["ttft_p50_ms"],
                "ttft_p99_ms": s["ttft_p99_ms"], "requests_per_replica": sorted(by_replica.values()),
                "route_reasons": by_reason, "engine_steps_per_replica": sorted(per_replica.values())}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--policies", default="prefix-cache,round-robin,least-request")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=6144)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    import platform

    result: dict = {"benchmark": "routing", "model": a.model, "dp": a.dp, "command": command(),
                    "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                    "workload": {k: getattr(a, k) for k in ("groups", "per_group", "prefix", "suffix", "output",
                                                            "concurrency", "max_total_tokens")},
                    "rows": []}
    with tempfile.TemporaryDirectory(prefix="lockgate-routing-") as d:
        for policy in a.policies.split(","):
            result["rows"].append(run_policy(a, policy, Path(d)))
            print(json.dumps(result["rows"][-1]), file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
