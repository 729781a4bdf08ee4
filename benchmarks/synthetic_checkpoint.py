"""Synthetic checkpoints of real architectures' shapes, random weights: for speed and memory at the
sizes people serve (no real checkpoint above 270M parameters can be installed here).

    .venv/bin/python benchmarks/synthetic_checkpoint.py --shape llama-3.2-1b --type Q4_0 --out /tmp/l1b-q4_0.gguf
    .venv/bin/python benchmarks/synthetic_checkpoint.py --shape llama-3.1-8b --type q4_k_m --out /tmp/l8b.gguf
    .venv/bin/python benchmarks/synthetic_checkpoint.py --shape llama-3.2-1b --safetensors /tmp/l1b-bf16

GGUF files are written as llama.cpp lays them out (``llama`` architecture, q/k rows as llama.cpp
stores them, the tokenizer and chat template of the default model, SmolLM2's 49,152 tokens, unless
``--vocab`` keeps the shape's own size with a byte-level stand-in). Weights are random blocks of the
type asked for (random codes, scales set for values of ~0.02: the values' distribution does not
matter for speed); ``q4_k_m`` mixes the types llama.cpp's Q4_K_M gives each tensor (Q6_K for
``attn_v`` and ``ffn_down`` in half the layers and for ``output``, Q4_K elsewhere). ``--safetensors``
writes a bf16 Hugging Face directory of the same shape (for vLLM), with the default model's
tokenizer files. Prints one JSON line: the file, its size, parameters, seconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {  # hidden, layers, heads, kv heads, ffn, own vocabulary, tied embeddings, rope theta
    "llama-3.2-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256, tied=True, theta=500000.0),
    "llama-3.2-3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128256, tied=True, theta=500000.0),
    "llama-3.1-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, tied=False,
                         theta=500000.0),
    "qwen2.5-7b-as-llama": dict(hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, vocab=152064, tied=False,
                                theta=1000000.0),
}
STD = 0.02


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str) -> np.ndarray:
    """[rows, cols] of ``qtype`` as raw GGUF blocks: random codes, float16 scales set so the values
    have about ``STD`` (measured on the first rows, then applied to all)."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    if qtype in ("F32", "F16", "BF16"):
        w = (STD * rng.standard_normal((rows, cols))).astype(np.float32)
        return w if qtype == "F32" else gguf.quants.quantize(w, t)
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    fields = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,)}[qtype]

    def set_scales(values: np.ndarray) -> None:
        for off in fields:
            raw[..., off:off + 2] = values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)

    set_scales(np.ones(raw.shape[:2]))
    sample = min(rows, 16)
    spread = float(gguf.quants.dequantize(raw[:sample].reshape(sample, -1), t).std())
    set_scales(np.full(raw.shape[:2], STD / spread))
    return raw.reshape(rows, -1)


def tensor_types(kind: str, layers: int) -> dict[str, str]:
    """The type of each tensor role, by layer for the mixes: key ``role`` or ``role@layer``."""
    if kind.upper() in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "F16", "BF16"):
        return {"*": kind.upper()}
    if kind.lower() == "q4_k_m":  # llama.cpp: Q6_K for attn_v / ffn_down in the first and last eighth and every
        six = {i for i in range(layers) if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2}
        out = {"*": "Q4_K", "output": "Q6_K", "token_embd": "Q4_K"}  # third layer between, and for output
        out.update({f"attn_v@{i}": "Q6_K" for i in six})
        out.update({f"ffn_down@{i}": "Q6_K" for i in six})
        return out
    raise ValueError(f"--type {kind}: Q4_0, Q4_1, Q5_0, Q8_0, F16, BF16 or q4_k_m")


def write_gguf(shape: dict, kind: str, out: Path, vocab_source: str, seed: int) -> dict:
    import gguf

    from lockgate.checkpoint.loader import default_gguf_path

    rng = np.random.default_rng(seed)
    src = gguf.GGUFReader(str(default_gguf_path()))
    tokens = [f for k, f in src.fields.items() if k.startswith("tokenizer.")]
    vocab = int(len(src.fields["tokenizer.ggml.tokens"].data)) if vocab_source == "default" else shape["vocab"]
    h, n_layers, ffn = shape["hidden"], shape["layers"], shape["ffn"]
    head_dim = h // shape["heads"]
    types = tensor_types(kind, n_layers)

    def qtype(role: str, layer: int | None = None) -> str:
        return types.get(f"{role}@{layer}", types.get(role, types["*"]))

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"synthetic {out.stem}")
    w.add_context_length(131072)
    w.add_embedding_length(h)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_rope_freq_base(shape["theta"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    if vocab_source == "default":
        for f in tokens:  # the default model's tokenizer and chat template, as they are
            value = f.contents()
            if f.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_key_value(f.name, value, gguf.GGUFValueType.ARRAY, sub_type=f.types[-1])
            else:
                w.add_key_value(f.name, value, f.types[0])
    else:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"<t{i}>" for i in range(vocab)])
        w.add_token_types([1] * vocab)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)

    def mat(name: str, rows: int, cols: int, t: str) -> None:
        data = random_blocks(rng, rows, cols, t)
        w.add_tensor(name, data, raw_dtype=None if t == "F32" else gguf.GGMLQuantizationType[t])

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", vocab, h, qtype("token_embd"))
    norm("output_norm.weight", h)
    if not shape["tied"]:
        mat("output.weight", vocab, h, qtype("output"))
    kv = shape["kv_heads"] * head_dim
    for i in range(n_layers):
        b = f"blk.{i}"
        norm(f"{b}.attn_norm.weight", h)
        norm(f"{b}.ffn_norm.weight", h)
        for role, rows, cols in (("attn_q", h, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, h),
                                 ("ffn_gate", ffn, h), ("ffn_up", ffn, h), ("ffn_down", h, ffn)):
            mat(f"{b}.{role}.weight", rows, cols, qtype(role, i))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    params = vocab * h * (1 if shape["tied"] else 2) + n_layers * (2 * h * h + 2 * kv * h + 3 * h * ffn)
    return {"params": params, "vocab": vocab}


def write_safetensors(shape: dict, out: Path, seed: int) -> dict:
    """A bf16 Hugging Face directory (Llama layout) of the shape, the default model's tokenizer."""
    import torch
    from safetensors.torch import save_file

    from lockgate.checkpoint.loader import prepare_model_dir

    rng = torch.Generator().manual_seed(seed)
    tok_dir = prepare_model_dir("default")
    out.mkdir(parents=True, exist_ok=True)
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    h, n_layers, ffn = shape["hidden"], shape["layers"], shape["ffn"]
    head_dim = h // shape["heads"]
    kv = shape["kv_heads"] * head_dim

    def rand(*dims: int) -> torch.Tensor:
        return (STD * torch.randn(*dims, generator=rng)).to(torch.bfloat16)

    shard: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": torch.ones(h,
                                                                                              dtype=torch.bfloat16)}
    if not shape["tied"]:
        shard["lm_head.weight"] = rand(vocab, h)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shard.update({p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                      p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                      p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                      p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                      p + "mlp.gate_proj.weight": rand(ffn, h), p + "mlp.up_proj.weight": rand(ffn, h),
                      p + "mlp.down_proj.weight": rand(h, ffn)})
    save_file(shard, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": ffn, "num_hidden_layers": n_layers, "num_attention_heads": shape["heads"],
              "num_key_value_heads": shape["kv_heads"], "head_dim": head_dim, "rms_norm_eps": 1e-5,
              "rope_theta": shape["theta"], "max_position_embeddings": 131072, "vocab_size": vocab,
              "tie_word_embeddings": shape["tied"], "torch_dtype": "bfloat16", "hidden_act": "silu",
              "bos_token_id": 1, "eos_token_id": 2}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"params": sum(t.numel() for t in shard.values()), "vocab": vocab}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--type", default="Q4_0", help="Q4_0, Q4_1, Q5_0, Q8_0, F16, BF16 or q4_k_m (GGUF)")
    p.add_argument("--out", type=Path, help="the .gguf file to write")
    p.add_argument("--safetensors", type=Path, help="write a bf16 Hugging Face directory here instead")
    p.add_argument("--vocab", choices=["default", "own"], default="default",
                   help="default: SmolLM2's tokenizer (49,152 tokens); own: the shape's vocabulary size")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if (a.out is None) == (a.safetensors is None):
        p.error("give one of --out FILE.gguf or --safetensors DIR")
    t0 = time.perf_counter()
    if a.out is not None:
        info = write_gguf(SHAPES[a.shape], a.type, a.out, a.vocab, a.seed)
        where, size = a.out, a.out.stat().st_size
    else:
        info = write_safetensors(SHAPES[a.shape], a.safetensors, a.seed)
        where, size = a.safetensors, sum(f.stat().st_size for f in a.safetensors.iterdir())
    print(json.dumps({"path": str(where), "shape": a.shape, "type": a.type if a.out else "bf16", "bytes": size,
                      **info, "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
