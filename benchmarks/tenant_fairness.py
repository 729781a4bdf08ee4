"""Fair share between tenants: one tenant sends 10x the other's load, both backlogged; vtc vs none.

Workload: two tenants with closed-loop clients on one engine (offline, the server's scheduler and
runner): ``heavy`` keeps ``--light-streams`` x 10 requests outstanding, ``light`` keeps
``--light-streams``; each finished request is replaced at once by a new one of the same tenant.
Prompts of real text, lengths uniform in [``--prompt-min``, ``--prompt-max``], outputs of
``--max-tokens`` (ignore_eos). ``--max-running-requests`` is small enough that both tenants always
have requests waiting (backlogged), the case where the share is decided by the scheduler.

Each of ``--fairness`` (default ``none,vtc``; ``--repeats`` rounds alternating the modes) gets a
fresh engine and ``--seconds`` of load; the first ``--warmup`` seconds are not counted. Reported
per mode: each tenant's share of the weighted service (``wp * prompt + wq * output`` tokens, as
VTC charges them, by admission and generation within the window) and of the output tokens, next to
its weighted share (``--tenant-weight``: 50/50 by default); the light tenant's TTFT (arrival to
first token) percentiles; total output and total tokens per second; and vtc / none throughput.

Usage: .venv/bin/python benchmarks/tenant_fairness.py [--model sim|default] [--seconds 30]
       [--light-streams 8] [--max-running-requests 8] [--tenant-weight light=1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
from _common import command, cpu_model_and_flags

from lockgate import LLM, SamplingParams
from lockgate.bench.corpus import PromptMaker
from lockgate.bench.stats import summarize_ms
from lockgate.config import parse_tenant_weight


def one_run(a: argparse.Namespace, fairness: str, maker: PromptMaker | None) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_running_requests": a.max_running_requests, "fairness": fairness,
                          "tenant_weight": tuple(a.tenant_weight)}
    if a.model == "sim":
        kw.update(sim_step_ms=a.sim_step_ms, sim_token_ms=a.sim_token_ms)
    llm = LLM(a.model, **kw)
    eng = llm.engine
    rng = np.random.default_rng(a.seed)
    if maker is None and a.model != "sim":
        tok = llm.tokenizer
        maker = PromptMaker(lambda t, tok=tok: tok.encode(t, add_special_tokens=False), seed=a.seed)
    streams = {"heavy": a.light_streams * 10, "light": a.light_streams}
    live: dict[str, Any] = {}  # rid -> Request

    def submit(tenant: str) -> None:
        n = int(rng.integers(a.prompt_min, a.prompt_max + 1))
        ids = maker.ids_of_length(n) if maker is not None else rng.integers(3, 30000, n).tolist()
        r = eng.add_request(ids, SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, temperature=0.0),
                            tenant=tenant)
        live[r.rid] = r

    for tenant, n in streams.items():
        for _ in range(n):
            submit(tenant)
    t0 = time.monotonic()
    start, end = t0 + a.warmup, t0 + a.warmup + a.seconds
    out_tokens = {"heavy": 0, "light": 0}
    service = {"heavy": 0.0, "light": 0.0}
    weights = {t: 1.0 for t in streams} | dict(parse_tenant_weight(w) for w in a.tenant_weight)
    ttft_light: list[float] = []
    admitted: set[str] = set()
    steps = 0
    while time.monotonic() < end:
        outs = eng.step()
        now = time.monotonic()
        counting = now >= start
        steps += counting
        for r in eng.running:
            if r.rid not in admitted:
                admitted.add(r.rid)
                if counting:
                    service[r.tenant] += a.prompt_weight * r.num_prompt
        for ev in outs:
            r = live[ev.rid]
            if counting:
                out_tokens[r.tenant] += len(ev.new_token_ids)
                service[r.tenant] += a.output_weight * len(ev.new_token_ids)
            if ev.finish_reason is not None:
                del live[ev.rid]
                admitted.discard(ev.rid)
                if r.tenant == "light" and r.arrival_time >= start and r.first_token_time is not None:
                    ttft_light.append(r.first_token_time - r.arrival_time)
                submit(r.tenant)
    dt = end - start
    total_w = sum(service.values())
    total_out = sum(out_tokens.values())
    wsum = sum(weights[t] for t in streams)
    row: dict[str, Any] = {
        "steps": steps,
        "output_tok_s": round(total_out / dt, 1),
        "service_tok_s": round(total_w / dt, 1),
        "light_requests_done": len(ttft_light),
        **{f"{t}_service_share": round(service[t] / total_w, 3) for t in streams},
        **{f"{t}_weighted_share": round(weights[t] / wsum, 3) for t in streams},
        **{f"{t}_output_share": round(out_tokens[t] / max(total_out, 1), 3) for t in streams},
        **summarize_ms(ttft_light, "light_ttft"),
    }
    row["max_share_error"] = round(max(abs(row[f"{t}_service_share"] - row[f"{t}_weighted_share"])
                                       / row[f"{t}_weighted_share"] for t in streams), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="sim")
    ap.add_argument("--fairness", default="none,vtc")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--light-streams", type=int, default=8)
    ap.add_argument("--max-running-requests", type=int, default=8)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tenant-weight", action="append", default=[])
    ap.add_argument("--prompt-weight", type=float, default=1.0, help="wp (the engine's default)")
    ap.add_argument("--output-weight", type=float, default=2.0, help="wq (the engine's default)")
    ap.add_argument("--sim-step-ms", type=float, default=2.0)
    ap.add_argument("--sim-token-ms", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    cpu, flags = cpu_model_and_flags()
    result: dict[str, Any] = {
        "benchmark": "tenant_fairness", "model": a.model, "command": command(), "cpu": cpu, "cpu_flags": flags,
        "workload": {"heavy_streams": a.light_streams * 10, "light_streams": a.light_streams,
                     "max_running_requests": a.max_running_requests, "prompt_tokens": [a.prompt_min, a.prompt_max],
                     "max_tokens": a.max_tokens, "seconds": a.seconds, "tenant_weight": a.tenant_weight}}
    modes = a.fairness.split(",")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(a.repeats):
        for m in modes:
            row = one_run(a, m, None)
            runs[m].append(row)
            print(json.dumps({m: row}), file=sys.stderr)
    for m in modes:
        result[m] = runs[m] if a.repeats > 1 else runs[m][0]
    if "none" in runs and "vtc" in runs:
        tps = {m: float(np.mean([r["output_tok_s"] for r in runs[m]])) for m in ("none", "vtc")}
        result["vtc_vs_none_output_tok_s"] = round(tps["vtc"] / tps["none"], 3)
        p99 = {m: float(np.mean([r["light_ttft_p99_ms"] or 0.0 for r in runs[m]])) for m in ("none", "vtc")}
        result["light_ttft_p99_ms"] = {m: round(v, 1) for m, v in p99.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
