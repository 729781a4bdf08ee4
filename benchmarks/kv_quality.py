"""What the 8-bit KV tiers cost in quality: perplexity, top-1 agreement and log-prob drift against
the exact pool over the same tokens.

    .venv/bin/python benchmarks/kv_quality.py [--model default] [--tiers int8,fp8] [--tokens 4096]
        [--chunk 256] [--text FILE]

Each tier (and the exact pool, ``--kv-cache-dtype auto``) reads the same text teacher-forced: the
tokens go through the engine's own runner in prompt chunks of ``--chunk`` tokens over one sequence
(each chunk attends to the pool's K/V of everything before it and of itself, stored as the tier
stores it: later tokens see earlier tokens' quantized K/V, as in serving), and every position's
log-probabilities of the next token are kept. Printed as one JSON line: the CPU, the model, per tier
its perplexity, the ratio to the exact pool's, the share of positions whose top-1 token equals the
exact pool's, and the mean and 99th percentile of |log p(next) - log p_exact(next)|.

The default text is CPython's own documentation as the interpreter ships it (``pydoc_data.topics``,
English prose and examples; ``--text FILE`` for another), its first ``--tokens`` tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch


def cpu() -> dict[str, object]:
    info = Path("/proc/cpuinfo").read_text()
    name = re.search(r"model name\s*:\s*(.*)", info)
    flags = (re.search(r"flags\s*:\s*(.*)", info) or re.search("x^", "")).group(1).split()  # type: ignore[union-attr]
    notable = [f for f in flags if f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")]
    return {"cpu": name.group(1).strip() if name else "?", "flags": " ".join(notable), "threads": torch.get_num_threads()}


def default_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def next_token_logprobs(llm: object, ids: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced over ``ids`` on ``llm``'s runner (one sequence on slots 0 .. n-1, prompt chunks):
    (log p(ids[i + 1]) [n - 1] float64, argmax [n - 1]) of every position but the last."""
    from lockgate.layers.attention_meta import AttentionMetadata

    r = llm.engine.runner  # type: ignore[attr-defined]
    n = len(ids)
    assert n <= r.capacity, f"{n} tokens do not fit the pool ({r.capacity})"
    lp, top = np.zeros(n - 1), np.zeros(n - 1, np.int64)
    i64 = np.int64
    with torch.inference_mode():
        for start in range(0, n - 1, chunk):
            end = min(start + chunk, n - 1)
            q = end - start
            meta = AttentionMetadata.build(np.array([q], i64), np.array([end], i64), np.arange(end, dtype=i64),
                                           np.array([0, end], i64), np.arange(start, end, dtype=i64),
                                           r.model.args.num_queries_per_kv, r.device, r.paths.decode_kernel,
                                           r.paths.row_invariant, r.paths.prefill_kernel)
            logits = r.model(torch.from_numpy(ids[start:end]), torch.arange(start, end), meta, r.k_cache, r.v_cache,
                             torch.arange(q), None, 0 if r.paths.prompt_forms else None)  # [q, V] f32
            logp = torch.log_softmax(logits.double(), -1)
            nxt = torch.from_numpy(ids[start + 1:end + 1])
            lp[start:end] = logp.gather(1, nxt[:, None])[:, 0].numpy()
            top[start:end] = logp.argmax(-1).numpy()
    return lp, top


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--tiers", default="int8,fp8")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: pydoc_data.topics)")
    a = p.parse_args()
    from lockgate import LLM

    text = Path(a.text).read_text(encoding="utf-8") if a.text else default_text()
    result: dict[str, object] = {**cpu(), "model": a.model, "text": a.text or "pydoc_data.topics", "chunk": a.chunk}
    exact = None
    for tier in ["auto", *a.tiers.split(",")]:
        llm = LLM(a.model, dtype=a.dtype, kv_cache_dtype=tier, max_total_tokens=a.tokens + 16, speculative_tokens=0)
        if exact is None:
            ids = np.asarray(llm.get_tokenizer().encode(text)[:a.tokens], dtype=np.int64)
            result["tokens"] = int(len(ids))
            result["dtype"] = str(llm.engine.runner.dtype).removeprefix("torch.")
        lp, top = next_token_logprobs(llm, ids, a.chunk)
        ppl = float(np.exp(-lp.mean()))
        if exact is None:
            exact = (lp, top, ppl)
            result["auto"] = {"perplexity": round(ppl, 4)}
        else:
            drift = np.abs(lp - exact[0])
            result[tier] = {"perplexity": round(ppl, 4), "perplexity_ratio": round(ppl / exact[2], 5),
                            "top1_agreement": round(float((top == exact[1]).mean()), 4),
                            "logprob_drift_mean": round(float(drift.mean()), 5),
                            "logprob_drift_p99": round(float(np.quantile(drift, 0.99)), 5)}
        del llm
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
