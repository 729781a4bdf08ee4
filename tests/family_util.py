"""Shared by the model-family tests (test_families, test_gguf_families): transformers' greedy
reference and lockgate's runs of the same prompts alone, batched and over the prefix cache."""

from __future__ import annotations

import torch
import transformers as tf

from lockgate import LLM, SamplingParams

# Prompts as ids below the tiny test vocabularies (128); two share a 12-token prefix for the cache.
SHARED = [11, 23, 5, 77, 42, 9, 31, 64, 3, 100, 18, 57]
PROMPTS = [SHARED + [7, 8, 9], SHARED + [90, 1], [5, 17, 3, 88, 42, 42, 7, 1, 60, 33, 91, 2, 14, 70, 29, 50],
           [9, 8, 7]]


def hf_greedy(hf, prompt: list[int], n_new: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their log-probabilities: the prompt in one forward, then one
    token per forward over its KV cache (what ``generate`` does, written out because Phi-3's
    ``generate`` drops the cache and re-encodes everything with the long LongRoPE factors once a
    sequence crosses ``original_max_position_embeddings``; lockgate, like the model itself over a
    cache, rotates each token by its own position's table)."""
    ids: list[int] = []
    lps: list[float] = []
    with torch.no_grad():
        cache = tf.DynamicCache(config=hf.config)
        logits = hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[0, -1]
        for _ in range(n_new):
            lp = logits.float().log_softmax(-1)
            ids.append(int(lp.argmax()))
            lps.append(float(lp[ids[-1]]))
            logits = hf(torch.tensor([[ids[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1]
    return ids, lps


def assert_lockgate_matches(model_dir, want: list[tuple[list[int], list[float]]], n_new: int, what: str,
                            **options) -> None:
    """lockgate (float32, prompts prefilled in chunks of 8; ``options``: more engine options) gives
    ``want``'s tokens, and log-probs within 1e-4, for every prompt alone, all in one batch, and again
    from the prefix cache."""
    assert len({tuple(w[0]) for w in want}) > 1, "the prompts should lead to different outputs"
    llm = LLM(str(model_dir), dtype="float32", max_total_tokens=2048, max_prefill_tokens=8, check_invariants=True,
              **options)
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True, logprobs=0)
    try:
        runs = {"alone": [llm.generate(prompt_token_ids=[p], sampling_params=params)[0] for p in PROMPTS],
                "batched": llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)}
        runs["cached"] = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    finally:
        llm.engine.runner.close()  # tensor-parallel ranks stop now, not at the test session's exit
    assert all(o.num_cached_tokens > 0 for o in runs["cached"])  # the prefix cache served these prompts
    for how, outs in runs.items():
        for prompt, out, (ids, lps) in zip(PROMPTS, outs, want, strict=True):
            got = out.outputs[0]
            assert got.token_ids == ids, (what, how, prompt)
            assert max(abs(a - b) for a, b in zip(got.logprobs, lps, strict=True)) < 1e-4, (what, how, prompt)
