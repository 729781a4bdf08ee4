"""Which checkpoint tensors fill a decoder layer: the readers every family shares, and ``Family``.

Owns ``Family`` (a family's name, its ``model_type``s, its config parser and its layer reader: what
``models/registry.py`` lists) and ``read_standard_layer``, the Hugging Face layout most families
use (``model.layers.N.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, the two norms) with
the switches families differ by: fused qkv / gate_up tensors (Phi-3), q/k norms (Qwen3, Gemma 3),
Gemma's four norms stored as ``w - 1``, and mixture-of-experts blocks (Qwen3-MoE and Mixtral names).

Invariants: every tensor is read with the shape config.json implies (``CheckpointReader.get``
raises naming the tensor and that shape); norm weights are returned in float32 with Gemma's
offset already added; projection weights in ``source`` (the caller's full-precision dtype), or as
a GGUF's blocks (``CheckpointReader.matrix``: a ``QuantMatrix``) where the reader keeps them packed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lockgate.models.args import ModelArgs
from lockgate.models.weights import CheckpointReader

LayerTensors = dict[str, Any]


@dataclass(frozen=True)
class Family:
    name: str  # what the docs and errors call it
    model_types: tuple[str, ...]  # config.json model_type values it reads
    parse: Callable[[dict[str, Any]], ModelArgs]
    read_layer: Callable[[CheckpointReader, ModelArgs, int, torch.dtype], LayerTensors]


def read_standard_layer(w: CheckpointReader, a: ModelArgs, i: int, source: torch.dtype, *, fused: bool = False,
                        moe_names: str = "qwen") -> LayerTensors:
    """Layer ``i``'s tensors in the Hugging Face Llama layout plus what ``a`` switches on.

    ``fused``: the checkpoint stores ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` (Phi-3).
    ``moe_names``: the experts' names in a MoE layer, ``qwen`` (``mlp.gate``,
    ``mlp.experts.E.{gate,up,down}_proj``) or ``mixtral`` (``block_sparse_moe.gate``,
    ``block_sparse_moe.experts.E.{w1,w3,w2}``)."""
    p = f"model.layers.{i}."
    h, hkv, d, hid, f = a.num_heads, a.num_kv_heads, a.head_dim, a.hidden_size, a.intermediate_size
    qkv_rows = (h + 2 * hkv) * d
    attn = p + "self_attn."

    def norm(name: str, size: int = hid) -> torch.Tensor:
        t = w.get(p + name, torch.float32, shape=(size,))
        return t + 1.0 if a.norm_offset else t

    out: LayerTensors = {"attn_norm": norm("input_layernorm.weight")}
    if fused:
        out["qkv_weight"] = w.matrix([attn + "qkv_proj.weight"], source, [(qkv_rows, hid)])
        out["qkv_bias"] = w.get(attn + "qkv_proj.bias", shape=(qkv_rows,)) if a.qkv_bias else None
    else:
        qkv = [attn + f"{n}_proj" for n in "qkv"]
        shapes = [(h * d, hid), (hkv * d, hid), (hkv * d, hid)]
        out["qkv_weight"] = w.matrix([n + ".weight" for n in qkv], source, shapes)
        out["qkv_bias"] = w.cat([n + ".bias" for n in qkv], None, [s[:1] for s in shapes]) if a.qkv_bias else None
    out["o_weight"] = w.matrix([attn + "o_proj.weight"], source, [(hid, h * d)])
    out["o_bias"] = w.get(attn + "o_proj.bias", shape=(hid,)) if a.o_bias else None
    if a.qk_norm:
        out["q_norm"] = norm("self_attn.q_norm.weight", d)
        out["k_norm"] = norm("self_attn.k_norm.weight", d)
    if a.sandwich_norms:  # Gemma: post_attention_layernorm follows attention; pre_feedforward precedes the MLP
        out["post_attn_norm"] = norm("post_attention_layernorm.weight")
        out["mlp_norm"] = norm("pre_feedforward_layernorm.weight")
        out["post_mlp_norm"] = norm("post_feedforward_layernorm.weight")
    else:
        out["mlp_norm"] = norm("post_attention_layernorm.weight")
    if a.moe is not None and a.moe.sparse_layers[i]:
        e, fe = a.moe.num_experts, a.moe.expert_size
        block, names = (p + "mlp.", ("gate_proj", "up_proj", "down_proj")) if moe_names == "qwen" else \
            (p + "block_sparse_moe.", ("w1", "w3", "w2"))
        out["router"] = w.get(block + "gate.weight", source, shape=(e, hid))
        out["experts"] = [
            (w.matrix([block + f"experts.{x}.{names[0]}.weight", block + f"experts.{x}.{names[1]}.weight"], source,
                      [(fe, hid), (fe, hid)]),
             w.matrix([block + f"experts.{x}.{names[2]}.weight"], source, [(hid, fe)]))
            for x in range(e)]
        out["top_k"], out["norm_topk"] = a.moe.top_k, a.moe.norm_topk
        return out
    mlp = p + "mlp."
    if fused:
        out["gate_up_weight"] = w.matrix([mlp + "gate_up_proj.weight"], source, [(2 * f, hid)])
        out["gate_up_bias"] = None
    else:
        gu = [mlp + "gate_proj", mlp + "up_proj"]
        out["gate_up_weight"] = w.matrix([n + ".weight" for n in gu], source, [(f, hid), (f, hid)])
        out["gate_up_bias"] = w.cat([n + ".bias" for n in gu], None, [(f,), (f,)]) if a.mlp_bias else None
    out["down_weight"] = w.matrix([mlp + "down_proj.weight"], source, [(hid, f)])
    out["down_bias"] = w.get(mlp + "down_proj.bias", shape=(hid,)) if a.mlp_bias else None
    return out
