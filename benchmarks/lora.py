"""What serving LoRA adapters costs: c = 32 throughput with 0, 1, 4 and 16 distinct adapters in the batch.

Prints one JSON line (machine, command, per variant the median over rounds): output tok/s, TPOT p50
(ms per output token after the first), TTFT p50, and each variant's tok/s as a share of the base
model's. The adapters are random-weight PEFT adapters made with ``peft`` for the default model
(rank ``--rank``, every projection: q, k, v, o, gate, up, down), written to a temporary directory;
lockgate loads them with ``--lora-modules`` (``--max-loras 16``). The offline engine on the default
model (the same engine the server drives), its default dtype and kernels, greedy with ``ignore_eos``,
the prefix cache off (each variant computes every prompt). Requests go 32 at a time; with k
adapters, request i runs under adapter i mod k (0: the base model). Variants are interleaved
within each round (base, 1, 4, 16, then the reverse order), so the host's drift hits them alike.

Usage:  .venv/bin/python benchmarks/lora.py [--requests 64] [--prompt-tokens 256] [--max-tokens 128]
        [--rounds 2] [--rank 16] [--variants 0,1,4,16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import command, machine

from lockgate import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import ALL, make_adapter  # noqa: E402  (the tests' adapter maker)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, names: list[str | None],
        conc: int) -> dict[str, Any]:
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), conc):
        outs += llm.generate(prompt_token_ids=prompts[i:i + conc], sampling_params=params, lora=names[i:i + conc])
    wall = time.perf_counter() - t0
    n_out = [len(o.outputs[0].token_ids) for o in outs]
    tpot = [(o.metrics.e2e - o.metrics.time_to_first_token) / (n - 1) * 1e3
            for o, n in zip(outs, n_out, strict=True) if n > 1]
    return {"wall_s": wall, "output_tokens": sum(n_out), "output_tok_s": sum(n_out) / wall,
            "tpot_p50_ms": statistics.median(tpot),
            "ttft_p50_ms": statistics.median(o.metrics.time_to_first_token for o in outs) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--variants", default="0,1,4,16", help="numbers of distinct adapters in the batch")
    args = ap.parse_args()
    variants = [int(v) for v in args.variants.split(",")]
    top = max(variants)

    import torch
    from transformers import AutoModelForCausalLM

    from lockgate.checkpoint.loader import default_gguf_path

    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory(prefix="lockgate-lora-bench-") as d:  # read at load, then kept in memory
        tmp = Path(d)
        modules = []
        for i in range(top):
            make_adapter(hf, tmp / f"a{i}", seed=i, scale=0.3, r=args.rank, lora_alpha=2 * args.rank, target_modules=ALL)
            modules.append(f"a{i}={tmp / f'a{i}'}")
        del hf
        llm = LLM("default", max_total_tokens=65536, disable_prefix_cache=True, lora_modules=tuple(modules),
                  max_loras=max(top, 1))
    vocab = llm.engine.runner.vocab_size
    prompts = [[(7 + 31 * i + 17 * j) % (vocab - 10) + 5 for j in range(args.prompt_tokens)]
               for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def names_for(k: int) -> list[str | None]:
        return [None if k == 0 else f"a{i % k}" for i in range(args.requests)]

    llm.generate(prompt_token_ids=prompts[:4], sampling_params=SamplingParams(max_tokens=4), lora=names_for(top)[:4])
    results: dict[int, list[dict[str, Any]]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for k in (variants if r % 2 == 0 else variants[::-1]):
            results[k].append(run(llm, prompts, params, names_for(k), args.concurrency))
    summary: dict[str, Any] = {}
    for k, rs in results.items():
        summary[f"adapters_{k}"] = {key: round(statistics.median(x[key] for x in rs), 3) for key in rs[0]}
    if 0 in results:
        base = summary["adapters_0"]["output_tok_s"]
        for k in variants:
            summary[f"adapters_{k}"]["tok_s_vs_base"] = round(summary[f"adapters_{k}"]["output_tok_s"] / base, 3)
    s = llm.engine.scheduler.lora
    print(json.dumps({"benchmark": "lora", "command": command(), "machine": machine(), "dtype": str(llm.engine.runner.dtype),
                      "requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                      "concurrency": args.concurrency, "rank": args.rank, "rounds": args.rounds,
                      "slot_loads": s.counters.loads if s else 0, "results": summary}))


if __name__ == "__main__":
    main()
