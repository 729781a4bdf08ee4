"""A decoder-only model's architecture, parsed from a Hugging Face ``config.json``: ``ModelArgs``.

Owns the one dataclass every family fills (``lockgate.models.registry`` picks the family's parser
by ``model_type``) and the parsing shared by all of them: head sizes, rope parameters (global and,
for Gemma 3, the sliding layers' own), which layers attend over a sliding window. A family's
parser (``models/llama.py``, ``qwen.py``, ``gemma.py``, ``phi3.py``, ``mixtral.py``) starts from
``base_args`` and switches on its features.

Invariants: a ``ModelArgs`` only describes what the shared decoder (``models/decoder.py``)
computes exactly; anything it cannot (an activation, a rope type, partial rotary) is a
``ValueError`` at parse time naming the key, never a silently different model. ``layer_windows``
has one entry per layer (None: full attention). ``plain`` is True only for the Llama layout the
one-call fused step was written for.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from lockgate.layers.rope import SUPPORTED_ROPE_TYPES, rope_type_of
from lockgate.models.lora import LoraTargets, ModuleTarget

log = logging.getLogger("lockgate.models")

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class MoeArgs:
    """A mixture-of-experts MLP: ``num_experts`` experts of width ``expert_size``, ``top_k`` per token."""

    num_experts: int
    top_k: int
    expert_size: int
    norm_topk: bool  # renormalise the chosen experts' weights to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: the MoE block (True) or a dense MLP (False)


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None or {"rope_type": "linear" | "llama3" | "longrope", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias
    o_bias: bool  # Llama attention_bias
    mlp_bias: bool
    sliding_window: int | None  # the window of the sliding-window layers, if any
    layer_windows: tuple[int | None, ...] = ()  # per layer: its window, None for full attention
    act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and after the MLP too
    norm_offset: bool = False  # Gemma: checkpoints store w - 1 for every RMSNorm weight (folded at load)
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    attn_scale: float | None = None  # None: 1 / sqrt(head_dim); Gemma: query_pre_attn_scalar ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    local_rope: tuple[float, dict[str, Any] | None] | None = None  # Gemma 3: the sliding layers' (theta, scaling)
    moe: MoeArgs | None = None

    def __post_init__(self) -> None:
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (self.sliding_window,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_windows)} entries for {self.num_layers} layers")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def plain(self) -> bool:
        """The Llama layout exactly (what the one-call fused step computes)."""
        return (self.act == "silu" and not self.qk_norm and not self.sandwich_norms and self.embed_scale is None
                and self.attn_scale is None and self.attn_softcap is None and self.final_softcap is None
                and self.local_rope is None and self.moe is None and not any(self.layer_windows)
                and rope_type_of(self.rope_scaling) != "longrope")

    @property
    def matmul_parameters(self) -> int:
        """Weights of every projection and the LM head (what a per-weight copy costs, per byte)."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim * self.hidden_size
        o = self.num_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.intermediate_size * self.hidden_size
        if self.moe is not None:
            sparse = sum(self.moe.sparse_layers)
            experts = 3 * self.moe.expert_size * self.hidden_size * self.moe.num_experts
            return (self.num_layers * (qkv + o) + sparse * experts + (self.num_layers - sparse) * mlp
                    + self.vocab_size * self.hidden_size)
        return self.num_layers * (qkv + o + mlp) + self.vocab_size * self.hidden_size

    def lora_targets(self) -> LoraTargets:
        """The projections a LoRA adapter may touch, by PEFT module name, in the fused layout (the
        experts of a MoE block are not among them)."""
        h, hkv, d, hid, f = self.num_heads, self.num_kv_heads, self.head_dim, self.hidden_size, self.intermediate_size
        qkv = (h + 2 * hkv) * d
        targets = {
            "q_proj": ModuleTarget("qkv", hid, qkv, 0, h * d),
            "k_proj": ModuleTarget("qkv", hid, qkv, h * d, (h + hkv) * d),
            "v_proj": ModuleTarget("qkv", hid, qkv, (h + hkv) * d, qkv),
            "o_proj": ModuleTarget("o", h * d, hid, 0, hid),
        }
        if self.moe is None:
            targets.update({
                "gate_proj": ModuleTarget("gate_up", hid, 2 * f, 0, f),
                "up_proj": ModuleTarget("gate_up", hid, 2 * f, f, 2 * f),
                "down_proj": ModuleTarget("down", f, hid, 0, hid),
            })
        return LoraTargets(self.num_layers, targets)

    def replace(self, **changes: Any) -> ModelArgs:
        return dataclasses.replace(self, **changes)


def base_args(cfg: dict[str, Any], **features: Any) -> ModelArgs:
    """The fields every family shares, from ``cfg``; ``features``: the family's ModelArgs fields."""
    act_name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act_name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act_name!r} (supported: {', '.join(sorted(ACTIVATIONS))})")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        log.info("ignoring pretraining_tp=%s (only affects training-time numerics)", cfg["pretraining_tp"])
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    num_layers = int(cfg["num_hidden_layers"])
    rope = cfg.get("rope_parameters") or {}
    if isinstance(rope.get("full_attention"), dict):  # transformers 5: per layer type (Gemma 3)
        if "local_rope" not in features:
            raise ValueError("per-layer-type rope_parameters are only supported for Gemma 3")
        rope = rope["full_attention"]
    theta, scaling = rope_params(cfg, rope)
    attention_bias = bool(cfg.get("attention_bias", False))
    fields: dict[str, Any] = dict(
        model_type=str(cfg.get("model_type")),
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=None,
        act=ACTIVATIONS[act_name],
    )
    fields.update(features)
    return ModelArgs(**fields)


def layer_windows(cfg: dict[str, Any], num_layers: int, every_layer: bool = False) -> tuple[int | None, ...]:
    """Per layer, its sliding window (None: full attention): from ``layer_types`` when the config
    has it, else every layer when ``every_layer`` (Mistral, Phi-3), else none."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown} (supported: sliding_attention, full_attention)")
        if "sliding_attention" in types and not window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        size = int(window or 0)
        return tuple(size if t == "sliding_attention" else None for t in types)
    if every_layer and window:
        return (int(window),) * num_layers
    return (None,) * num_layers


def rope_params(cfg: dict[str, Any], params: dict[str, Any] | None) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers-5 ``rope_parameters`` (one layer type's) or the legacy
    ``rope_theta`` / ``rope_scaling`` keys; ValueError for what lockgate does not implement."""
    params = dict(params or {})
    if "rope_theta" in params and not isinstance(params["rope_theta"], int | float):
        raise ValueError(f"rope_theta must be a number, got {params['rope_theta']!r}")
    legacy = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = {**legacy, **params}
    scaling.pop("rope_theta", None)
    rope_type = rope_type_of(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r} in config.json "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    prf = scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise ValueError(f"unsupported partial_rotary_factor={prf} (rope on part of each head)")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if k not in scaling]
        if missing:
            raise ValueError(f"llama3 rope scaling is missing {missing}")
    if rope_type == "longrope":
        orig = scaling.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        missing = [k for k in ("short_factor", "long_factor") if k not in scaling]
        if missing or not orig:
            raise ValueError(f"longrope rope scaling is missing {missing or ['original_max_position_embeddings']}")
        orig = int(orig)
        factor = scaling.get("factor") or int(cfg.get("max_position_embeddings") or orig) / orig
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        return theta, {**scaling, "rope_type": "longrope", "original_max_position_embeddings": orig,
                       "attention_factor": float(attention)}
    if "factor" not in scaling:
        raise ValueError(f"{rope_type} rope scaling is missing 'factor'")
    return theta, {**scaling, "rope_type": rope_type}
