"""Tensor parallelism (``--tensor-parallel-size``): the split, real ranks against references, a dead rank.

Every run with two ranks starts a real second process (``lockgate.runner.tensor_parallel``) and sums
over gloo: a tiny random checkpoint of each kind of split (sliding window, softcaps, experts) against transformers (greedy tokens, log-probs
within 1e-4, float32, alone / batched / from the prefix cache), the default model against the
same model on one rank (float32: the same tokens and log-probs within 1e-4, with speculation,
structured output; its quantized forms: the same tokens), and a server whose rank 1 is killed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading

import openai
import pytest
import torch
from family_util import PROMPTS, assert_lockgate_matches, hf_greedy
from server_util import ServerProc, pid_alive
from test_families import N_NEW, build, tokenizer_files  # noqa: F401  (a fixture)

from lockgate import LLM, SamplingParams
from lockgate.models.args import ModelArgs
from lockgate.models.shard import Shard, split
from lockgate.runner.tensor_parallel import cpu_groups
from lockgate.sampling import StructuredOutput


def _args(heads: int, kv: int, f: int = 96) -> ModelArgs:
    return ModelArgs(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=f, num_layers=2,
                     num_heads=heads, num_kv_heads=kv, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                     rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=True, qkv_bias=False,
                     o_bias=False, mlp_bias=False, sliding_window=None)


def test_heads_split_in_whole_kv_groups_and_kv_heads_replicate_below_the_rank_count() -> None:
    smol = _args(9, 3, 1536)  # the default model: 3 KV groups of 3 heads
    parts = [split(smol, Shard(r, 2)) for r in range(2)]
    assert [(p.heads, p.kv_heads, p.mlp) for p in parts] == [((0, 3), (0, 1), (0, 768)), ((3, 9), (1, 3), (768, 1536))]
    four = [split(_args(4, 2), Shard(r, 4)) for r in range(4)]  # 2 KV heads, 4 ranks: each KV head on two
    assert [(p.heads, p.kv_heads) for p in four] == [((0, 1), (0, 1)), ((1, 2), (0, 1)), ((2, 3), (1, 2)), ((3, 4), (1, 2))]
    assert split(_args(4, 2), Shard(1, 2), mlp_unit=32).mlp == (32, 96)  # whole 32-column blocks
    with pytest.raises(ValueError, match="--tensor-parallel-size 3: the model has 4 attention heads in 2 KV groups"):
        split(_args(4, 2), Shard(0, 3))
    with pytest.raises(ValueError, match="--tensor-parallel-size 8: the model has 4 attention heads"):
        split(_args(4, 2), Shard(0, 8))  # 2 heads per group cannot cover 4 ranks each


def test_cpu_groups_from_the_flag_or_cut_evenly() -> None:
    assert cpu_groups(2, "0-1,4|2-3", {0, 1, 2, 3, 4}) == [[0, 1, 4], [2, 3]]
    assert cpu_groups(2, None, {0, 1, 2, 3, 5}) == [[0, 1], [2, 3, 5]]
    assert cpu_groups(4, None, {0, 1}) == [[], [], [], []]  # fewer CPUs than ranks: no pinning
    with pytest.raises(ValueError, match="--tp-cpus '0' gives 1 CPU groups for --tensor-parallel-size 2"):
        cpu_groups(2, "0", {0, 1})
    with pytest.raises(ValueError, match=r"--tp-cpus '0\|7': CPUs \[7\] are not available"):
        cpu_groups(2, "0|7", {0, 1})
    with pytest.raises(ValueError, match=r"CPUs \[1\] are in two groups"):
        cpu_groups(2, "0-1|1", {0, 1})
    with pytest.raises(ValueError, match="--tp-cpus gives the CPU groups of tensor-parallel ranks; it needs --tensor-parallel-size > 1"):
        LLM("sim", tp_cpus="0|1")


# one family per kind of split: grouped KV heads with a sliding window, softcaps and local/global
# layers, experts cut by rows (the others share these code paths; tests/test_families.py covers each on one rank)
TP_FAMILIES = ("mistral_sliding", "gemma2", "qwen3_moe")


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_two_ranks_match_transformers_on_each_kind_of_split(family, tmp_path, tokenizer_files) -> None:  # noqa: F811
    hf = build(tmp_path, family, tokenizer_files)
    assert_lockgate_matches(tmp_path, [hf_greedy(hf, p, N_NEW) for p in PROMPTS], N_NEW, family,
                            tensor_parallel_size=2)


CHAT = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        "Count: one, two, three, four, five, six,"]


def test_the_default_model_on_two_ranks_is_the_one_rank_model(smol_fp32) -> None:
    """float32: the same greedy tokens and log-probs within 1e-4 as one rank (speculation on in both;
    the counting prompt is guessed ahead), the same constrained output; LoRA is refused by name.
    Rank 0 (this process) runs on its CPU group while the ranks run, and gets its CPUs back after."""
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    llm = LLM("default", dtype="float32", max_total_tokens=8192, check_invariants=True, tensor_parallel_size=2)
    rank = llm.engine.runner.tensor_parallel.procs[1]
    if len(cpus) >= 2:
        assert len(os.sched_getaffinity(0)) < len(cpus) and torch.get_num_threads() == len(os.sched_getaffinity(0))
    try:
        greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
                  "additionalProperties": False}
        constrained = SamplingParams(max_tokens=40, temperature=0.0, logprobs=0,
                                     structured=StructuredOutput("json", json.dumps(schema)))
        for params, prompts in ((greedy, CHAT), (constrained, ["The capital of France as JSON:"])):
            two, one = llm.generate(prompts, params), smol_fp32.generate(prompts, params)
            for a, b in zip(two, one, strict=True):
                x, y = a.outputs[0], b.outputs[0]
                assert x.token_ids == y.token_ids, (a.prompt, x.text, y.text)
                assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4
        assert json.loads(two[0].outputs[0].text)["city"]
        assert llm.engine.scheduler.speculator.num_accepted_tokens > 0
        with pytest.raises(ValueError, match="LoRA adapters are not supported with --tensor-parallel-size 2 yet"):
            llm.load_lora("a", "/nonexistent")
    finally:
        llm.engine.runner.close()
    assert rank.poll() == 0  # stopped by its message, not killed
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == (cpus, threads)


def test_the_default_models_quantized_forms_on_two_ranks() -> None:
    """The GGUF's Q4_1/Q8_0 blocks cut by rows and whole blocks of columns: the same greedy tokens
    as one rank (the log-probs differ in the last bits: each rank's forms are measured at its own
    shapes, and bf16 runs round each rank's partial sum)."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = []
    for tp in (1, 2):
        llm = LLM("default", max_total_tokens=2048, tensor_parallel_size=tp)
        try:
            assert llm.engine.runner.model.layers[0].qkv.quantized  # kept in blocks, not dense
            runs.append(llm.generate(CHAT, params))
        finally:
            llm.engine.runner.close()
    for a, b in zip(*runs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(abs(p - q) for p, q in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)) < 0.02


def test_a_killed_rank_ends_the_server_naming_it_and_nothing_is_left(tmp_path, tokenizer_files) -> None:  # noqa: F811
    build(tmp_path, "mistral_sliding", tokenizer_files)
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with pytest.raises(ValueError, match="--tensor-parallel-size 3: the model has 4 attention heads in 2 KV groups"):
        LLM(str(tmp_path), dtype="float32", max_total_tokens=512, tensor_parallel_size=3)
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == (cpus, threads)  # a failed start gives them back
    prompt = PROMPTS[2]
    want = LLM(str(tmp_path), dtype="float32", max_total_tokens=512).generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    s = ServerProc("--model", str(tmp_path), "--dtype", "float32", "--max-total-tokens", "512", "-tp", "2")
    try:
        s.wait_ready(timeout=300)
        rank = int(re.search(r"started ranks 1 \(pid (\d+)", s.log()).group(1))
        oai = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        got = oai.completions.create(model=str(tmp_path), prompt=prompt, max_tokens=8, temperature=0.0,
                                     extra_body={"ignore_eos": True})
        assert got.choices[0].text == want[0].outputs[0].text
        errors: list[str] = []
        first = threading.Event()

        def stream() -> None:
            try:
                for _ in oai.completions.create(model=str(tmp_path), prompt=prompt, max_tokens=240, stream=True,
                                                extra_body={"ignore_eos": True}):
                    first.set()
            except openai.APIError as e:
                errors.append(str(e))

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        os.kill(rank, signal.SIGKILL)  # while the stream runs
        t.join(60)
        assert s.proc.wait(60) == 1
        log = s.log()
        assert f"tensor-parallel rank 1 (pid {rank}) killed by SIGKILL" in log
        assert "code 71 (a tensor-parallel rank died" in log
        assert len(errors) == 1 and f"tensor-parallel rank 1 (pid {rank}) killed by SIGKILL" in errors[0], errors
        assert s.wait_children_gone() and not pid_alive(rank)
    finally:
        s.stop()


def test_the_8_bit_kv_pool_on_two_ranks_gives_the_one_rank_tokens() -> None:
    """--kv-cache-dtype int8 with two ranks: each rank's pool holds its heads' 8-bit codes, and greedy
    tokens are those of one rank (log-probs move more than on the exact pool: a K row that differs
    in its last bits can round to another code)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        llm = LLM("default", dtype="float32", max_total_tokens=2048, kv_cache_dtype="int8", tensor_parallel_size=tp)
        try:
            assert llm.engine.runner.kv_cache_dtype == "int8"
            runs.append([o.outputs[0].token_ids for o in llm.generate(CHAT[:2], params)])
        finally:
            llm.engine.runner.close()
    assert runs[0] == runs[1]
