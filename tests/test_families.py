"""Every model family against transformers, on tiny random-weight checkpoints built in the run.

For each family a checkpoint is made with transformers' own config and model classes (same
structure, tiny sizes, every weight randomised, norms around their family's neutral value) and
saved with ``save_pretrained``; lockgate serves that directory in float32 through the offline
``LLM`` (the same engine the server drives) and must give transformers' greedy tokens, and its
log-probabilities within 1e-4: for every prompt alone, all prompts in one batch, and again with
the prompts' shared prefixes in the radix cache, with prompts prefilled in chunks of 8 tokens.
Sliding windows are 6 tokens and the prompts longer, so the windowed layers really drop keys;
Gemma 2's soft-caps are small enough to bend the scores; Phi-3's original context is 20 tokens,
so its sequences cross it and both LongRoPE tables are used.

The tokenizer files are the default model's (only used to print text; prompts go in as ids below
the tiny vocabulary).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as tf
from family_util import PROMPTS, assert_lockgate_matches, hf_greedy

from lockgate import LLM, SamplingParams

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5)
WINDOW = 6
SLIDE_FULL = ["sliding_attention", "full_attention"]

FAMILIES = {
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, rope_theta=1000.0)),
    "qwen3_sliding": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(
        **COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1])),
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(
        **COMMON, query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=SLIDE_FULL,
        attn_logit_softcapping=1.5, final_logit_softcapping=4.0)),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        **COMMON, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=SLIDE_FULL,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(
        **{**COMMON, "max_position_embeddings": 128}, original_max_position_embeddings=20, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(8)],
                         "long_factor": [2.0 + i for i in range(8)], "original_max_position_embeddings": 20})),
    "mistral_sliding": lambda: tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=WINDOW)),
    "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
}

N_NEW = 10


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    from lockgate.checkpoint.loader import convert_gguf_cached, default_gguf_path

    src = convert_gguf_cached(default_gguf_path())
    return [p for p in src.iterdir() if p.name.startswith(("tokenizer", "special_tokens", "generation_config"))
            or p.name.endswith(".jinja")]


def build(where, family: str, tokenizer_files) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = FAMILIES[family]().float().eval()
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # Gemma stores w - 1 (neutral 0), the others w (neutral 1)
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
            elif "mlp.gate.weight" in name or "block_sparse_moe.gate" in name:
                p.copy_(1.0 * torch.randn_like(p))  # routers: decisive enough that experts differ by token
            else:
                p.copy_(0.15 * torch.randn_like(p))
    hf.config._attn_implementation = "eager"
    where.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(where, safe_serialization=True)
    for f in tokenizer_files:
        shutil.copy(f, where / f.name)
    gen = where / "generation_config.json"
    if gen.exists():  # the default model's eos ids are not in the tiny vocabulary's sense: greedy runs on
        gen.write_text(json.dumps({**json.loads(gen.read_text()), "eos_token_id": []}))
    return hf


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers(family, tmp_path, tokenizer_files) -> None:
    hf = build(tmp_path, family, tokenizer_files)
    assert_lockgate_matches(tmp_path, [hf_greedy(hf, p, N_NEW) for p in PROMPTS], N_NEW, family)


def test_family_features_are_what_the_config_says() -> None:
    from lockgate.models.registry import SUPPORTED_MODEL_TYPES, args_from_config

    def args(family: str):
        return args_from_config(FAMILIES[family]().config.to_dict())

    g2, g3, q3, moe, phi = args("gemma2"), args("gemma3"), args("qwen3"), args("qwen3_moe"), args("phi3")
    assert g2.layer_windows == (WINDOW, None) and g2.attn_softcap == 1.5 and g2.final_softcap == 4.0
    assert g2.act == "gelu_tanh" and g2.sandwich_norms and g2.norm_offset and not g2.qk_norm
    assert g3.qk_norm and g3.local_rope == (100.0, None) and g3.rope_scaling["rope_type"] == "linear"
    assert q3.qk_norm and not q3.qkv_bias and q3.plain is False
    assert moe.moe is not None and moe.moe.sparse_layers == (True, False) and moe.moe.norm_topk
    assert phi.rope_scaling["rope_type"] == "longrope" and phi.rope_scaling["attention_factor"] > 1.0
    assert args("mistral_sliding").layer_windows == (WINDOW, WINDOW)
    for mt in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "mixtral"):
        assert mt in SUPPORTED_MODEL_TYPES


def test_unsupported_models_and_bad_tensors_are_clear_errors(tmp_path, tokenizer_files) -> None:
    from safetensors.torch import load_file, save_file

    from lockgate.models.registry import args_from_config

    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt_neox'.*supports llama, mistral, qwen2"):
        args_from_config({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]})
    cfg = FAMILIES["qwen3"]().config.to_dict()
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        args_from_config({**cfg, "rope_parameters": {**cfg["rope_parameters"], "partial_rotary_factor": 0.5}})
    with pytest.raises(ValueError, match="hidden_act 'relu2'"):
        args_from_config({**cfg, "hidden_act": "relu2"})
    build(tmp_path, "qwen3", tokenizer_files)
    f = next(tmp_path.glob("*.safetensors"))
    sd = load_file(f)
    sd["model.layers.1.self_attn.k_norm.weight"] = torch.ones(8)
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_norm.weight' has shape \[8\], config.json "
                                         r"implies \[16\]"):
        LLM(str(tmp_path), dtype="float32", max_total_tokens=256)
    del sd["model.layers.1.self_attn.k_norm.weight"]
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.self_attn.k_norm.weight' \(config.json "
                                         r"implies shape \[16\]\)"):
        LLM(str(tmp_path), dtype="float32", max_total_tokens=256)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe", "phi3"])
def test_integer_forms_serve_every_family(family, tmp_path, tokenizer_files) -> None:
    # --quantization int4 in bf16 on lockgate's kernels (tuning off: the static table, a quantized
    # form for every call of <= 16 rows, so decode steps run on them): every projection, and every
    # expert, gets the group-quantized forms, and the first step stays close to transformers in
    # float32: int4 rounding of random weights (lossy: a 16-bit checkpoint's values are not on the
    # grid) plus bf16 moves the top log-probabilities by up to 0.51 nats (measured), so 0.75 is asked.
    from lockgate.kernel_choice import FormChoice

    hf = build(tmp_path, family, tokenizer_files)
    llm = LLM(str(tmp_path), dtype="bfloat16", quantization="int4", tuning="off", max_total_tokens=1024)
    model = llm.engine.runner.model
    lins = [lin for lin in model.all_linears() if lin is not model.head]
    assert lins and all(lin.quantized for lin in lins)
    assert all(lin.choice == FormChoice.static(lin.forms) for lin in lins)
    # an expert follows the static choice, which never calls lockgate's bf16 kernel: no copy for it
    experts = [lin for layer in model.layers if layer.moe is not None for lin in layer.moe.linears()]
    assert all("bf16-gemm" not in lin.forms for lin in experts)
    assert family != "qwen3_moe" or experts
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    worst = 0.0
    for prompt in PROMPTS:
        got = dict(llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].top_logprobs[0])
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
        for t in torch.topk(want, 3).indices.tolist():
            if t in got:
                worst = max(worst, abs(got[t] - float(want[t])))
    assert worst < 0.75


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sharded_16_bit_checkpoint_with_an_index(dtype, tmp_path, tokenizer_files) -> None:
    """A checkpoint saved in bf16 / fp16 across several shards (model.safetensors.index.json) serves
    exactly what transformers computes from those 16-bit weights."""
    hf = build(tmp_path / "src", "qwen3", tokenizer_files).to(dtype)
    where = tmp_path / "sharded"
    hf.save_pretrained(where, safe_serialization=True, max_shard_size="150KB")
    for f in (tmp_path / "src").iterdir():
        if not f.name.endswith(".safetensors") and not f.name.startswith(("config", "model.safetensors")):
            shutil.copy(f, where / f.name)
    assert (where / "model.safetensors.index.json").is_file() and len(list(where.glob("*.safetensors"))) >= 2
    hf = tf.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32).eval()  # its own reading of the shards
    hf.config._attn_implementation = "eager"
    assert_lockgate_matches(where, [hf_greedy(hf, p, N_NEW) for p in PROMPTS], N_NEW, f"sharded {dtype}")
