"""The offline API on the real default model (float32): sampling knobs end to end.

Seeded sampling is reproducible (alone or batched), min_tokens / ignore_eos / max_tokens
hold, stop strings cut the text before the stop and end the request, chat uses the model's
template, and bad prompts are rejected before anything runs.
"""

from __future__ import annotations

import pytest

from lockgate import SamplingParams

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_seeded_sampling_is_reproducible_and_batch_independent(smol_fp32) -> None:
    sp = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = smol_fp32.generate("Write a short poem about the sea.", sp)[0].outputs[0].token_ids
    again = smol_fp32.generate("Write a short poem about the sea.", sp)[0].outputs[0].token_ids
    batched = smol_fp32.generate(
        ["Tell me a joke.", "Write a short poem about the sea.", "List five fruits:"],
        [SamplingParams(max_tokens=30, temperature=0.9), sp, SamplingParams(max_tokens=7, temperature=0.5, seed=9)],
    )[1].outputs[0].token_ids
    assert alone == again == batched
    other = smol_fp32.generate("Write a short poem about the sea.",
                               SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=4321, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone  # 24 draws at temperature 1: equal only by a fluke


@pytest.fixture(scope="module")
def chat_answer(smol_fp32):
    """The greedy answer to CHAT (up to 40 tokens), asked once for the two tests that read it."""
    return smol_fp32.chat(CHAT, SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0]


def test_chat_greedy_answer_and_finish(smol_fp32, chat_answer) -> None:
    out = chat_answer
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and len(out.token_ids) < 40
    assert out.token_ids[-1] in smol_fp32.tokenizer.eos_token_ids  # EOS kept in ids, not in text
    assert "<|im_end|>" not in out.text


def test_min_tokens_ignore_eos_and_max_tokens(smol_fp32, chat_answer) -> None:
    short = chat_answer
    n = len(short.token_ids)
    forced = smol_fp32.chat(CHAT, SamplingParams(max_tokens=40, temperature=0.0, min_tokens=n + 5))[0].outputs[0]
    eos = set(smol_fp32.tokenizer.eos_token_ids)
    assert len(forced.token_ids) >= n + 5
    assert not eos & set(forced.token_ids[:n + 5 - 1])
    full = smol_fp32.chat(CHAT, SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert len(full.token_ids) == 33 and full.finish_reason == "length"


def test_stop_string_cuts_text_and_ends_request(smol_fp32) -> None:
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    text = smol_fp32.generate("The capital of France is", sp)[0].outputs[0].text
    stop = text[8:12]  # a stop string somewhere inside the greedy text, likely spanning tokens
    assert stop.strip(), text
    out = smol_fp32.generate("The capital of France is",
                             SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,)))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert len(out.token_ids) < 40


def test_bad_prompts_rejected_before_running(smol_fp32) -> None:
    free = smol_fp32.engine.scheduler.stats()
    with pytest.raises(ValueError, match="prompt 1"):
        smol_fp32.generate(["fine", "x " * 9000], SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert smol_fp32.engine.scheduler.stats() == free  # nothing was submitted, no slot taken
    assert not smol_fp32.engine.has_work


SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in at most one sentence. " * 8}
CONVS = [[SYSTEM, {"role": "user", "content": q}] for q in
         ("What is 2 + 2?", "Name a planet.", "What color is the sky?", "Who wrote Hamlet?")]
CONV_PARAMS = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def cache_off_answers():
    """The conversations' greedy answers with the prefix cache off (the reference both attention
    paths below are held to; computed once)."""
    from lockgate import LLM

    off = LLM("default", dtype="float32", max_total_tokens=4096, disable_prefix_cache=True).chat(CONVS, CONV_PARAMS)
    assert all(o.num_cached_tokens == 0 for o in off)
    return [o.outputs[0].token_ids for o in off]


@pytest.mark.parametrize("prefill_kernel", [False, True], ids=["sdpa-cascade", "prefill-kernel"])
def test_prefix_cache_on_equals_off_greedy(smol_fp32, cache_off_answers, monkeypatch, prefill_kernel: bool) -> None:
    # With the cache on, the last three conversations prefill together on the cached system
    # prompt's slots (> MIN_SHARED_PREFIX tokens). On SDPA (asked for explicitly) attention reads it
    # once per step for all three (shared-prefix path); on the prefill kernel each token reads it by
    # slot. Either way the greedy tokens must be the cache-off run's.
    from lockgate.layers import attention, attention_meta

    if prefill_kernel and not smol_fp32.engine.runner.paths.decode_kernel:
        pytest.skip("lockgate's CPU kernels are not loaded here")
    monkeypatch.setattr(smol_fp32.engine.runner.paths, "prefill_kernel", prefill_kernel)
    calls = []
    real = attention._add_prefixes
    monkeypatch.setattr(attention, "_add_prefixes", lambda *a: calls.append(len(a[5])) or real(*a))
    first = smol_fp32.chat(CONVS[:1], CONV_PARAMS)  # warms the cache with the system prompt
    on = first + smol_fp32.chat(CONVS[1:], CONV_PARAMS)
    assert all(o.num_cached_tokens > attention_meta.MIN_SHARED_PREFIX for o in on[1:])  # the system prompt was reused
    if not prefill_kernel:
        assert calls and max(calls) == 1  # one shared prefix, attended once per layer and step
    else:
        assert not calls
    assert [o.outputs[0].token_ids for o in on] == cache_off_answers


def test_model_spec_forms_load_the_same_model(smol_fp32) -> None:
    """--model accepts 'default', a .gguf path and a Hugging Face directory (config.json +
    safetensors + tokenizer): here the directory the GGUF was converted into."""
    from lockgate import LLM
    from lockgate.checkpoint.loader import default_gguf_path

    sp = SamplingParams(max_tokens=12, temperature=0.0)
    want = smol_fp32.generate("The capital of France is", sp)[0].outputs[0].token_ids
    model_dir = smol_fp32.engine.runner.model_dir
    for spec in (str(default_gguf_path()), str(model_dir)):
        llm = LLM(spec, dtype="float32", max_total_tokens=1024)
        assert llm.generate("The capital of France is", sp)[0].outputs[0].token_ids == want, spec
    with pytest.raises(ValueError, match="missing config.json"):
        LLM(str(model_dir.parent), dtype="float32", max_total_tokens=1024)


def test_kernels_off_gives_the_same_greedy_text(smol_fp32) -> None:
    # --cpu-kernels off (what a machine without a compiler gets) runs plain torch ops: the same
    # greedy continuations as the kernels' path in float32 (both compute in float32).
    from lockgate import LLM

    assert smol_fp32.engine.runner.cpu_kernels and smol_fp32.engine.runner.model.fused_ops
    off = LLM("default", dtype="float32", max_total_tokens=2048, cpu_kernels="off")
    assert not off.engine.runner.cpu_kernels and not off.engine.runner.model.fused_ops
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot"]
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    got = [o.outputs[0].token_ids for o in off.generate(prompts, sp)]
    want = [o.outputs[0].token_ids for o in smol_fp32.generate(prompts, sp)]
    assert got == want


def test_speculation_gives_bitwise_the_same_greedy_tokens_and_logprobs() -> None:
    """N-gram speculation on the real model, on a path whose rows do not depend on each other
    (float32 with lockgate's integer GEMM, asked for by name; its group-quant kernel on a CPU
    without a vector int_linear): the same tokens and bitwise the same log-probabilities as one
    token per step, in fewer steps. (Other forms, such as MKL's sgemm or torch's int4 kernel, may
    round a row differently when it shares a call with others: there the two agree to rounding.)"""
    from lockgate import LLM
    from lockgate.layers.forms import int_gemm_available

    prompts = ["def fibonacci(n):\n    if n < 2:\n        return n\n", "Count: 1, 2, 3, 4, 5, 6,",
               "The quick brown fox jumps over the lazy dog. The quick brown fox"]
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for k in (0, 2):
        llm = LLM("default", dtype="float32", quantization="int4", max_total_tokens=2048, speculative_tokens=k,
                  check_invariants=True, matmul_forms="int-gemm" if int_gemm_available() else "group-quant")
        outs = [llm.generate(p, sp)[0].outputs[0] for p in prompts]  # one at a time: room for guesses
        runs[k] = (outs, llm.engine.num_steps, llm.engine.scheduler.speculator.num_accepted_tokens)
        # A stop string inside a step's accepted run: the tokens after it are left out, as
        # they would never have been generated one token per step.
        # (The greedy answer to the first prompt repeats "print(fibonacci(10))  # Output: ..." lines.)
        stop = SamplingParams(max_tokens=48, temperature=0.0, stop=("33\nprint(fibonacci(10))  # Output: 33\nprint(",), logprobs=0)
        runs[k] += (llm.generate(prompts[0], stop)[0].outputs[0],)
        del llm
    (off, off_steps, _, off_stop), (on, on_steps, accepted, on_stop) = runs[0], runs[2]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.logprobs for o in on] == [o.logprobs for o in off]
    assert [o.top_logprobs for o in on] == [o.top_logprobs for o in off]
    assert accepted > 0 and on_steps == off_steps - accepted  # each accepted guess saved a step
    assert off_stop.finish_reason == on_stop.finish_reason == "stop"
    assert (on_stop.text, on_stop.token_ids, on_stop.logprobs) == (off_stop.text, off_stop.token_ids, off_stop.logprobs)
