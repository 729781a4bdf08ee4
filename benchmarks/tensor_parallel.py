"""Tensor parallelism on this machine: ``lockgate bench`` against TP = 2 and TP = 1 servers, side by side,
and what bypassing the one-call fused step costs.

Servers (the default model, defaults otherwise, one at a time, stopped by pid):

* ``tp1-all``: one process, one torch thread per core (the default);
* ``tp1-1thread``: one process, ``--num-threads 1``;
* ``tp2``: ``--tensor-parallel-size 2``, each rank on its own CPU group (here: one core each, one thread).

Each runs ``lockgate bench`` at c = 1 and c = ``--concurrency`` (random prompts of ``--input-len``,
``--output-len`` out, ignore_eos); the configurations take turns for ``--rounds`` rounds and the
medians are compared to ``tp1-all`` (ratios > 1: faster).

Then, offline in this process (no server): decode steps of one runner with the one-call fused step
(``decode_layers_``) and with it bypassed as tensor parallelism bypasses it (a no-op ``reduce``:
the layer loop on the fused element-wise kernels, the same results), paired rounds, at batch 1 and
``--concurrency``: the price a rank pays before any all-reduce.

On a machine with one group of cores (2 cores here), TP = 2 gives each rank one core: it divides
the same cores as ``tp1-all`` while adding two gloo all-reduces per layer, so it is not expected to
be faster here; the gain needs each rank on its own core group (a socket or NUMA node), where a
rank's share of the weights streams from its own memory channels. Prints one JSON document.

Usage: .venv/bin/python benchmarks/tensor_parallel.py [--rounds 2] [--concurrency 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command, machine, start_server  # noqa: E402

CONFIGS = {"tp1-all": [], "tp1-1thread": ["--num-threads", "1"], "tp2": ["--tensor-parallel-size", "2"]}
METRICS = ("output_throughput", "tpot_p50_ms", "ttft_p50_ms")


def serve(flags: list[str], log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    return start_server(["--model", "default", "--max-total-tokens", "16384", *flags], log_path)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench(url: str, conc: int, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    n = max(4, conc * a.requests_per_slot)
    argv = [sys.executable, "-m", "lockgate.cli", "bench", "--url", url, "--workload", "random", "--input-len",
            str(a.input_len), "--output-len", str(a.output_len), "--range-ratio", "0", "--num-requests", str(n),
            "--max-concurrency", str(conc), "--warmup-requests", "1", "--seed", "7", "--no-progress",
            "--log-level", "WARNING", "--out", str(out)]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    s = json.loads(out.read_text())["summary"]
    return {k: s[k] for k in (*METRICS, "failed")}


def servers(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for rnd in range(a.rounds):
        order = list(CONFIGS) if rnd % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            proc, url = serve(CONFIGS[name], work / f"{name}-{rnd}.log")
            try:
                for conc in (1, a.concurrency):
                    row = {"config": name, "round": rnd, "concurrency": conc,
                           **bench(url, conc, a, work / f"{name}-{rnd}-c{conc}.json")}
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    rows.append(row)
            finally:
                stop(proc)
    medians: dict[str, Any] = {}
    for conc in (1, a.concurrency):
        for name in CONFIGS:
            mine = [r for r in rows if r["config"] == name and r["concurrency"] == conc]
            medians[f"{name}/c{conc}"] = {m: round(statistics.median(r[m] for r in mine), 2) for m in METRICS}
    ratios = {}
    for conc in (1, a.concurrency):
        base = medians[f"tp1-all/c{conc}"]
        for name in CONFIGS:
            m = medians[f"{name}/c{conc}"]
            ratios[f"{name}/c{conc} vs tp1-all"] = {
                "output_throughput": round(m["output_throughput"] / base["output_throughput"], 3),
                "tpot_speedup": round(base["tpot_p50_ms"] / m["tpot_p50_ms"], 3)}
    return {"runs": rows, "medians": medians, "ratios": ratios}


def fused_bypass(a: argparse.Namespace) -> dict[str, Any]:
    """ms per decode step with the one-call fused step and with it bypassed (paired rounds)."""
    import numpy as np

    from lockgate.config import CacheConfig, ModelConfig
    from lockgate.plan import ForwardPlan, SamplingBatch
    from lockgate.runner.model_runner import ModelRunner

    runner = ModelRunner(ModelConfig(model="default", num_threads=a.step_threads), CacheConfig(max_total_tokens=16384))
    model = runner.model
    out: dict[str, Any] = {"fused_step_available": model.fused_ops and model.args.plain, "threads": a.step_threads}

    def decode_plan(b: int, ctx: int) -> ForwardPlan:
        i64 = np.int64
        seq = np.full(b, ctx + 1, i64)
        kv = np.concatenate([np.arange(s * (ctx + 1), (s + 1) * (ctx + 1)) for s in range(b)]).astype(i64)
        z = np.zeros(b, i64)
        greedy = SamplingBatch(temperature=np.zeros(b, np.float32), top_p=np.ones(b, np.float32), top_k=z.copy(),
                               min_p=np.zeros(b, np.float32), repetition_penalty=np.ones(b, np.float32),
                               frequency_penalty=np.zeros(b, np.float32), presence_penalty=np.zeros(b, np.float32),
                               seeds=z.copy(), has_seed=np.zeros(b, bool), seed_steps=z.copy(),
                               num_logprobs=np.full(b, -1, i64))
        ends = np.cumsum(seq)
        return ForwardPlan(input_ids=np.arange(1, b + 1, dtype=i64), positions=np.full(b, ctx, i64),
                           out_slots=kv[ends - 1], query_lens=np.ones(b, i64), seq_lens=seq, kv_slots=kv,
                           kv_offsets=np.concatenate([[0], ends]).astype(i64), sample_rows=np.arange(b, dtype=i64),
                           sampling=greedy)

    for b in (1, a.concurrency):
        plan = decode_plan(b, 200)
        times: dict[str, list[float]] = {"fused": [], "layer_loop": []}
        for _ in range(3):
            runner.execute(plan)
        for rnd in range(a.step_rounds):
            for how in (("fused", "layer_loop") if rnd % 2 == 0 else ("layer_loop", "fused")):
                model.reduce = None if how == "fused" else (lambda x: None)
                t0 = time.perf_counter()
                for _ in range(10):
                    runner.execute(plan)
                times[how].append((time.perf_counter() - t0) / 10 * 1e3)
        model.reduce = None
        f, lp = statistics.median(times["fused"]), statistics.median(times["layer_loop"])
        pairs = [y / x for x, y in zip(times["fused"], times["layer_loop"], strict=True)]
        out[f"batch{b}"] = {"fused_ms": round(f, 2), "layer_loop_ms": round(lp, 2),
                            "layer_loop_over_fused": round(statistics.median(pairs), 3)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests-per-slot", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--step-rounds", type=int, default=8)
    p.add_argument("--step-threads", type=int, default=1, help="torch threads of the fused-step comparison (a TP rank "
                   "on this machine has one)")
    p.add_argument("--skip-servers", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lockgate-tp-bench-"))
    print(f"logs and bench results in {work}", file=sys.stderr)
    doc: dict[str, Any] = {"command": command(), "machine": machine(), "model": "default (SmolLM2-135M-Instruct Q4_1)",
                           "workload": {"input_len": a.input_len, "output_len": a.output_len,
                                        "concurrency": [1, a.concurrency], "rounds": a.rounds}}
    if not a.skip_servers:
        doc["servers"] = servers(a, work)
    doc["fused_step_bypass"] = fused_bypass(a)
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
