"""Offline throughput: lockgate's LLM.generate vs transformers' static batching, one run.

Prints one JSON line. Two workloads:
  uniform   N requests x 256 prompt tokens x 128 output tokens (ignore_eos)
  variable  N requests, prompt and output lengths drawn from a wide log-normal (seeded)
For each: lockgate (continuous batching, all requests submitted at once) and transformers
``generate`` on the same prompts in static, left-padded batches of 1 and 32 (greedy,
min_new_tokens = max_new_tokens = the batch's longest wanted output; only wanted tokens
count as output). Batch-1 runs on a subset (``--hf1-requests``): it is a rate, not a total.

Usage:  .venv/bin/python benchmarks/offline_throughput.py [--num-requests 128] [--workloads uniform,variable]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch

from lockgate import LLM, SamplingParams
from lockgate.bench.corpus import PromptMaker


def workload(kind: str, n: int, maker: PromptMaker, seed: int) -> list[tuple[list[int], int]]:
    if kind == "uniform":
        return [(maker.ids_of_length(256), 128) for _ in range(n)]
    rng = np.random.default_rng(seed)
    p = np.clip(rng.lognormal(np.log(200), 0.9, n), 16, 1024).astype(int)
    o = np.clip(rng.lognormal(np.log(100), 1.0, n), 8, 512).astype(int)
    return [(maker.ids_of_length(int(a)), int(b)) for a, b in zip(p, o, strict=True)]


def run_lockgate(llm: LLM, reqs: list[tuple[list[int], int]]) -> dict:
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=[p for p, _ in reqs], sampling_params=params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(o for _, o in reqs)
    n_in = sum(len(p) for p, _ in reqs)
    return {"seconds": round(dt, 2), "output_tok_s": round(n_out / dt, 1), "total_tok_s": round((n_in + n_out) / dt, 1)}


def run_hf(model, reqs: list[tuple[list[int], int]], batch: int, pad_id: int) -> dict:
    n_in = n_out = 0
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        new = max(o for _, o in chunk)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad_id)
        n_in += sum(len(p) for p, _ in chunk)
        n_out += sum(o for _, o in chunk)
    dt = time.perf_counter() - t0
    return {"requests": len(reqs), "seconds": round(dt, 2), "output_tok_s": round(n_out / dt, 1),
            "total_tok_s": round((n_in + n_out) / dt, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--hf1-requests", type=int, default=4, help="requests for the transformers batch-1 run")
    ap.add_argument("--workloads", default="uniform,variable")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-prefill-tokens", type=int, default=1024)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    llm = LLM(a.model, dtype=a.dtype, max_prefill_tokens=a.max_prefill_tokens, max_running_requests=256)
    maker = PromptMaker(lambda t: llm.tokenizer.encode(t, add_special_tokens=False), seed=a.seed)
    llm.generate(prompt_token_ids=[maker.ids_of_length(32)], sampling_params=SamplingParams(max_tokens=4))  # warm-up
    hf = None
    if not a.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.runner.model_dir),  # type: ignore[attr-defined]
                                                  dtype=getattr(torch, a.dtype)).eval()
    result: dict = {"benchmark": "offline_throughput", "model": a.model, "dtype": a.dtype,
                    "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
                    "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    for kind in a.workloads.split(","):
        reqs = workload(kind, a.num_requests, maker, a.seed)
        row: dict = {"requests": len(reqs), "prompt_tokens": sum(len(p) for p, _ in reqs),
                     "output_tokens": sum(o for _, o in reqs), "lockgate": run_lockgate(llm, reqs)}
        if hf is not None:
            pad = llm.tokenizer.eos_token_ids[0]
            row["hf_batch32"] = run_hf(hf, reqs, 32, pad)
            row["hf_batch1"] = run_hf(hf, reqs[:a.hf1_requests], 1, pad)
            for k in ("hf_batch32", "hf_batch1"):
                row[f"ratio_vs_{k}"] = round(row["lockgate"]["output_tok_s"] / row[k]["output_tok_s"], 2)
        result[kind] = row
        print(json.dumps({kind: row}), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
