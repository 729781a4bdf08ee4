"""The Llama family in plain torch: Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2.

Owns the architecture (``LlamaArgs``, parsed and validated from a Hugging Face
``config.json``), weight loading from safetensors (all shards, converted to the run dtype)
and the forward pass over one step of flat tokens.

Invariants:

* Weights are fused at load: one QKV matmul ([(H + 2 Hkv) D, hidden]) and one gate/up matmul
  ([2 F, hidden]) per layer, each run through ``lockgate.layers.linear.Linear`` (which packs
  bf16 weights for oneDNN once at load). With ``quantization`` auto/int4 each projection also
  gets a quantized form for small steps, made from the checkpoint's full-precision values
  (read as float32 one layer at a time, before rounding to the run dtype); auto takes it only
  where nothing is lost (a Q4_1 GGUF's projections: 4 bits; Q8_0: 8 bits with lockgate's
  kernels). The LM head gets one only where nothing is lost (the default model's Q8_0 head). With
  ``fp32_min_rows`` every projection and the LM head also keep a float32 copy of those values
  for large calls (prefill), which sgemm runs faster than bf16 on CPUs without AMX. Biases are loaded when the checkpoint has them (Qwen2 q/k/v,
  Llama ``attention_bias`` / ``mlp_bias``); the config decides whether they must exist.
* The forward gets the step's tokens flat (input_ids [T], positions [T]) plus an
  ``AttentionMetadata`` built once per step, writes the step's K/V into the pool at
  ``out_slots`` and returns float32 logits only for ``logits_rows`` (the last token of each
  sampled sequence), skipping the final norm and LM head for everything else.
* Unsupported architectures or features (another ``model_type``, non-SiLU activation, rope
  types other than default/linear/llama3, partial rotary) raise ``ValueError`` at load with
  the offending key, instead of computing something subtly wrong.

Called by ``lockgate.runner.model_runner`` (load + one forward per step) and tests.
"""

from __future__ import annotations

import json
import logging
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from lockgate.layers.attention import AttentionMetadata, paged_attention
from lockgate.layers.linear import (
    INT4_GROUP,
    INT4_MAX_ROWS,
    INT4_MODES,
    LOSSLESS_TOLERANCE,
    GroupQuantWeight,
    IntGemmWeight,
    Linear,
    QuantForm,
    choose_quant,
)
from lockgate.layers.norm import rms_norm
from lockgate.layers.rope import SUPPORTED_ROPE_TYPES, RotaryEmbedding, apply_rope, rope_type_of

log = logging.getLogger("lockgate.models")

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class LlamaArgs:
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
    rope_scaling: dict[str, Any] | None  # None or {"rope_type": "linear" | "llama3", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias
    o_bias: bool  # Llama attention_bias
    mlp_bias: bool
    sliding_window: int | None  # window of sliding-window attention, if the model uses one

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def matmul_parameters(self) -> int:
        """Weights of every projection and the LM head (what a per-weight copy costs, per byte)."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim * self.hidden_size
        o = self.num_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.intermediate_size * self.hidden_size
        return self.num_layers * (qkv + o + mlp) + self.vocab_size * self.hidden_size

    @staticmethod
    def from_config(cfg: dict[str, Any]) -> LlamaArgs:
        """Parse a Hugging Face config.json dict; raise ValueError for what we do not support."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r} (architectures={cfg.get('architectures')}); "
                             f"lockgate supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}: only 'silu' (Llama MLP) is implemented")
        if cfg.get("pretraining_tp", 1) not in (1, None):
            log.info("ignoring pretraining_tp=%s (only affects training-time numerics)", cfg["pretraining_tp"])
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        theta, scaling = _rope_params(cfg)
        sliding = None
        if model_type == "mistral":
            sliding = cfg.get("sliding_window")
        elif model_type == "qwen2" and (cfg.get("use_sliding_window")
                                        or "sliding_attention" in (cfg.get("layer_types") or ())):
            sliding = cfg.get("sliding_window")
        attention_bias = bool(cfg.get("attention_bias", False))
        return LlamaArgs(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
        )


def _rope_params(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers-5 ``rope_parameters`` or legacy ``rope_theta``/``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    if "rope_theta" in params and not isinstance(params["rope_theta"], int | float):
        raise ValueError("per-layer rope_parameters are not supported")
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
        raise ValueError(f"unsupported partial_rotary_factor={prf}")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if k not in scaling]
        if missing:
            raise ValueError(f"llama3 rope scaling is missing {missing}")
    if "factor" not in scaling:
        raise ValueError(f"{rope_type} rope scaling is missing 'factor'")
    return theta, {**scaling, "rope_type": rope_type}


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class DecoderLayer(nn.Module):
    """Weights of one transformer block (fused QKV and gate/up) and their ``Linear`` projections."""

    attn_norm: nn.Parameter
    qkv_weight: nn.Parameter
    qkv_bias: nn.Parameter | None
    o_weight: nn.Parameter
    o_bias: nn.Parameter | None
    mlp_norm: nn.Parameter
    gate_up_weight: nn.Parameter
    gate_up_bias: nn.Parameter | None
    down_weight: nn.Parameter
    down_bias: nn.Parameter | None

    def __init__(self, w: dict[str, torch.Tensor | None], dtype: torch.dtype, quantization: str = "none",
                 fp32_min_rows: int | None = None, cpu_kernels: bool = False):
        """``w``: this layer's tensors at full precision (any float dtype), cast here to ``dtype``;
        ``quantization``, ``fp32_min_rows`` and ``cpu_kernels`` (lockgate's kernels are loaded)
        pick the projections' extra forms (``Linear``, ``choose_quant``)."""
        super().__init__()

        def need(name: str) -> nn.Parameter:
            t = w[name]
            assert t is not None, name
            return _frozen(t.to(dtype))

        def opt(name: str) -> nn.Parameter | None:
            t = w[name]
            return None if t is None else _frozen(t.to(dtype))

        def quant(name: str) -> QuantForm | None:
            t = w[name]
            assert t is not None, name
            return choose_quant(t, quantization, dtype, cpu_kernels)

        self.attn_norm = need("attn_norm")  # [hidden]
        self.qkv_weight = need("qkv_weight")  # [(H + 2 Hkv) D, hidden]
        self.qkv_bias = opt("qkv_bias")  # [(H + 2 Hkv) D] or None
        self.o_weight = need("o_weight")  # [hidden, H D]
        self.o_bias = opt("o_bias")  # [hidden] or None
        self.mlp_norm = need("mlp_norm")  # [hidden]
        self.gate_up_weight = need("gate_up_weight")  # [2 F, hidden]
        self.gate_up_bias = opt("gate_up_bias")  # [2 F] or None
        self.down_weight = need("down_weight")  # [hidden, F]
        self.down_bias = opt("down_bias")  # [hidden] or None
        def linear(name: str) -> Linear:
            weight, bias = getattr(self, f"{name}_weight"), getattr(self, f"{name}_bias")
            source = w[f"{name}_weight"]
            assert source is not None, name
            small = quant(f"{name}_weight")
            large = IntGemmWeight.matching(source, small, dtype) if cpu_kernels else None
            return Linear(weight, bias, small, fp32_min_rows, source, w[f"{name}_bias"], large)

        self.qkv = linear("qkv")
        self.o = linear("o")
        self.gate_up = linear("gate_up")
        self.down = linear("down")

    def projections(self) -> dict[str, Linear]:
        return {"qkv": self.qkv, "o": self.o, "gate_up": self.gate_up, "down": self.down}


class LlamaModel(nn.Module):
    """Decoder-only Llama-family model over the slot-indexed KV pool."""

    def __init__(self, args: LlamaArgs, embed: torch.Tensor, layers: list[DecoderLayer],
                 norm: torch.Tensor, lm_head: torch.Tensor | None, dtype: torch.dtype | None = None,
                 fp32_min_rows: int | None = None, quantization: str = "none", cpu_kernels: bool = False):
        """embed/norm/lm_head at full precision, cast to ``dtype`` (default: embed's). The LM head
        gets a small-step form only where it loses nothing (``quantization`` other than none): a
        head is a poor place to lose precision."""
        super().__init__()
        dtype = dtype or embed.dtype
        self.args = args
        self.embed = _frozen(embed.to(dtype))  # [V, hidden]
        self.layers = nn.ModuleList(layers)
        self.norm = _frozen(norm.to(dtype))  # [hidden]
        self.lm_head = self.embed if lm_head is None else _frozen(lm_head.to(dtype))  # [V, hidden] (tied: same)
        head_source = embed if lm_head is None else lm_head
        head_quant = choose_quant(head_source, "none" if quantization == "none" else "auto", dtype, cpu_kernels)
        head_large = IntGemmWeight.matching(head_source, head_quant, dtype) if cpu_kernels else None
        self.head = Linear(self.lm_head, None, head_quant, fp32_min_rows, head_source, large=head_large)
        self.rope = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling, embed.device)
        self.scale = 1.0 / math.sqrt(args.head_dim)
        # Run the layers on lockgate's fused CPU ops (``lockgate.kernels`` is loaded).
        self.fused_ops = cpu_kernels
        # The one-call decode path's weights, made on first use: the small-step forms (key False) for
        # steps of up to _decode_small_rows sequences (the rows every projection gives them), the
        # integer-GEMM forms (key True) for larger ones, as ``Linear`` picks them per call.
        self._decode_packs: dict[bool, tuple[list[torch.Tensor], list[int]] | tuple[()]] = {}
        self._decode_small_rows = min([lin.small_max_rows for lin in self._layer_projections()], default=0)

    def drop_int_gemm_forms(self) -> None:
        """Forget every projection's integer-GEMM form (for A/B measurements): calls go back to the
        small-step forms up to their own limit and to the dense weight above."""
        for lin in [*self._layer_projections(), self.head]:
            lin.large = None
        self._decode_small_rows = min([lin.small_max_rows for lin in self._layer_projections()], default=0)
        self._decode_packs.clear()

    def _layer_projections(self) -> list[Linear]:
        return [lin for layer in typing.cast(list[DecoderLayer], self.layers) for lin in layer.projections().values()]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def kv_shape(self, capacity: int) -> tuple[int, int, int, int]:
        """Shape of each KV pool tensor: [num_layers, capacity, Hkv, D]."""
        a = self.args
        return (a.num_layers, capacity, a.num_kv_heads, a.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                logits_rows: torch.Tensor | None) -> torch.Tensor | None:
        """input_ids/positions [T] i64, k_cache/v_cache [layers, capacity, Hkv, D],
        logits_rows [S] i64 (rows of T) -> logits [S, V] f32, or None when logits_rows is None.
        """
        x = F.embedding(input_ids, self.embed)  # [T, hidden]
        cos, sin = self.rope.cos_sin(positions, x.dtype)  # [T, 1, D] each
        if self.fused_ops:
            decoded = self._layers_decode(x, cos, sin, meta, k_cache, v_cache)
            x = decoded if decoded is not None else self._layers_fused(x, cos, sin, meta, k_cache, v_cache)
        else:
            x = self._layers(x, cos, sin, meta, k_cache, v_cache)
        if logits_rows is None:
            return None
        x = rms_norm(x.index_select(0, logits_rows), self.norm, self.args.rms_norm_eps)  # [S, hidden]
        return self.head(x).float()  # [S, V]

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The decoder layers in torch ops: x [T, hidden] -> [T, hidden] (the residual stream)."""
        a = self.args
        t = x.shape[0]
        h, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        for i, layer in enumerate(typing.cast(list[DecoderLayer], self.layers)):
            y = rms_norm(x, layer.attn_norm, a.rms_norm_eps)  # [T, hidden]
            qkv = layer.qkv(y)  # [T, (H + 2 Hkv) D]
            qk = apply_rope(qkv[:, :(h + hkv) * d].view(t, h + hkv, d), cos, sin)  # [T, H + Hkv, D]: one pass
            v = qkv[:, (h + hkv) * d:].view(t, hkv, d)  # [T, Hkv, D]
            o = paged_attention(qk[:, :h], qk[:, h:], v, k_cache[i], v_cache[i], meta, self.scale)  # [T, H, D]
            x = x + layer.o(o.reshape(t, h * d))  # [T, hidden]
            y = rms_norm(x, layer.mlp_norm, a.rms_norm_eps)
            gate, up = layer.gate_up(y).chunk(2, dim=-1)  # [T, F] each
            x = x + layer.down(F.silu(gate) * up)  # [T, hidden]
        return x

    def _layers_decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
        """An all-decode step in one call (``lockgate::decode_layers_``: ``_layers_fused``'s very
        ops, without returning to Python between them), or None when the step is not one: every
        sequence decodes on the attention kernel without a shared prefix, and every projection
        has a quantized form for this row count (small-step forms up to ``_decode_small_rows``
        rows, integer-GEMM forms above). The weights are packed on first use: a projection's
        forms must not change afterwards (they are made at load)."""
        t = x.shape[0]
        groups = meta.groups
        if len(groups) != 1:
            return None
        g = groups[0]
        if g.kernel_slots is None or g.kernel_offsets is None or g.prefixes or g.token_idx is not None:
            return None
        large = t > self._decode_small_rows
        if large not in self._decode_packs:
            self._decode_packs[large] = self._pack_decode_weights(large)
        packed = self._decode_packs[large]
        if not packed:
            return None
        weights, kinds = packed
        a, d = self.args, self.args.head_dim
        return torch.ops.lockgate.decode_layers_(x, cos.view(t, d), sin.view(t, d), k_cache, v_cache, meta.out_slots,
                                                 g.kernel_slots, g.kernel_offsets, weights, kinds, a.num_heads,
                                                 a.num_kv_heads, a.rms_norm_eps, self.scale)

    def _pack_decode_weights(self, large: bool) -> tuple[list[torch.Tensor], list[int]] | tuple[()]:
        """The layers' tensors in ``decode_layers_``'s order, and each projection's kind, for the
        small-step forms or (``large``) the integer-GEMM forms; () when some projection lacks that
        form (then such steps stay on ``_layers_fused``)."""
        weights: list[torch.Tensor] = []
        kinds: list[int] = []
        for layer in typing.cast(list[DecoderLayer], self.layers):
            weights += [layer.attn_norm, layer.mlp_norm]
            for lin in layer.projections().values():
                form = lin.large if large else lin.quant
                args = None if form is None else form.decode_layers_args()
                if args is None:
                    return ()
                kinds.append(args[0])
                weights += [*args[1], torch.empty(0) if lin.bias is None else lin.bias]
        return weights, kinds

    def _layers_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The same layers on lockgate's fused CPU ops (``lockgate.kernels``): per layer two
        add + norm calls, one rope + K/V write, one silu * up, plus the matmuls and attention.
        Each fused op rounds where the torch ops of ``_layers`` round. x is updated in place."""
        a = self.args
        t = x.shape[0]
        h, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        ops = torch.ops.lockgate
        cos2, sin2 = cos.view(t, d), sin.view(t, d)
        pending: torch.Tensor | None = None  # the previous layer's MLP output, not yet added to x
        for i, layer in enumerate(typing.cast(list[DecoderLayer], self.layers)):
            y = ops.add_rms_norm_(x, pending, layer.attn_norm, a.rms_norm_eps)  # x += pending; [T, hidden]
            q = ops.rope_write_kv(layer.qkv(y), cos2, sin2, h, hkv, k_cache[i], v_cache[i],
                                  meta.out_slots)  # [T, H, D]; the step's K/V are in the pool
            o = paged_attention(q, None, None, k_cache[i], v_cache[i], meta, self.scale)  # [T, H, D]
            y = ops.add_rms_norm_(x, layer.o(o.view(t, h * d)), layer.mlp_norm, a.rms_norm_eps)
            pending = layer.down(ops.silu_mul(layer.gate_up(y)))  # [T, hidden]
        if pending is not None:
            x += pending
        return x

    @staticmethod
    def from_pretrained(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu", quantization: str = "none",
                        fp32_min_rows: int | None = None, cpu_kernels: bool = False) -> LlamaModel:
        """Load config.json + safetensors (all shards) from a Hugging Face model directory.

        ``fp32_min_rows``: calls with at least this many rows multiply in float32 against a copy
        made from the checkpoint's values (``Linear``); None: never.
        ``quantization`` (``lockgate.layers.linear.INT4_MODES``): none, int4 (every projection the
        kernel fits), auto (only projections already on a 4- or 8-bit grid: nothing lost).
        ``cpu_kernels``: lockgate's CPU kernels are loaded (``lockgate.kernels.load``): the model
        runs its fused ops and its own quantized matmuls (``choose_quant``).
        """
        if quantization not in INT4_MODES:
            raise ValueError(f"quantization {quantization!r} is not one of {INT4_MODES}")
        # int4 and float32 forms are made from the unrounded values (read one layer at a time)
        source = dtype if quantization == "none" and fp32_min_rows is None else torch.float32
        model_dir = Path(model_dir)
        cfg_path = model_dir / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{model_dir}: no config.json")
        args = LlamaArgs.from_config(json.loads(cfg_path.read_text()))
        with _Weights(model_dir, dtype, torch.device(device)) as w:
            layers = []
            for i in range(args.num_layers):
                p = f"model.layers.{i}."
                qkv = [p + f"self_attn.{n}_proj" for n in "qkv"]
                gu = [p + "mlp.gate_proj", p + "mlp.up_proj"]
                layers.append(DecoderLayer({
                    "attn_norm": w.get(p + "input_layernorm.weight"),
                    "qkv_weight": w.cat([n + ".weight" for n in qkv], source),
                    "qkv_bias": w.cat([n + ".bias" for n in qkv]) if args.qkv_bias else None,
                    "o_weight": w.get(p + "self_attn.o_proj.weight", source),
                    "o_bias": w.get(p + "self_attn.o_proj.bias") if args.o_bias else None,
                    "mlp_norm": w.get(p + "post_attention_layernorm.weight"),
                    "gate_up_weight": w.cat([n + ".weight" for n in gu], source),
                    "gate_up_bias": w.cat([n + ".bias" for n in gu]) if args.mlp_bias else None,
                    "down_weight": w.get(p + "mlp.down_proj.weight", source),
                    "down_bias": w.get(p + "mlp.down_proj.bias") if args.mlp_bias else None,
                }, dtype, quantization, fp32_min_rows, cpu_kernels))
            embed = w.get("model.embed_tokens.weight", source)
            lm_head = None
            if args.tie_word_embeddings:
                w.skip("lm_head.weight")  # some checkpoints store the tied copy too
            else:
                if not w.has("lm_head.weight"):
                    raise ValueError(f"{model_dir}: tie_word_embeddings is false but lm_head.weight is missing")
                lm_head = w.get("lm_head.weight", source)
            norm = w.get("model.norm.weight")
            unused = w.unused()
        if unused:
            log.warning("%s: ignoring %d unexpected tensors, e.g. %s", model_dir, len(unused), sorted(unused)[:3])
        model = LlamaModel(args, embed, layers, norm, lm_head, dtype, fp32_min_rows, quantization, cpu_kernels)
        del embed, lm_head  # the float32 copies (if any) live on only in the Linear forms
        _check_shapes(model)
        if quantization != "none":
            _log_quant(model, quantization)
        return model


def _log_quant(m: LlamaModel, mode: str) -> None:
    """One line on which projections got a small-step form, which kind, and what it cost in precision."""
    lins = m._layer_projections()
    forms = [lin.quant for lin in [*lins, m.head] if lin.quant is not None]
    if not forms:
        log.info("quantization=%s: no projection has a quantized form (%s)", mode,
                 "none is already on a 4- or 8-bit grid" if mode == "auto" else "the kernel does not fit")
        return
    worst = max(q.error for q in forms)
    large = [lin.large for lin in [*lins, m.head] if lin.large is not None]
    if large:
        kinds = sorted({f"{q.bits}-bit" for q in large})
        where = "lockgate's int16 x int GEMM (AVX512-VNNI) for every call"
    else:
        kinds = sorted({f"{q.bits}-bit {'lockgate' if isinstance(q, GroupQuantWeight) else 'torch'}" for q in forms})
        where = f"for steps of <= {max(lin.small_max_rows for lin in [*lins, m.head])} rows"
    log.info("quantization=%s: %d of %d projections%s quantized (%s, groups of %d), %s; "
             "largest re-quantization error %.3g steps (%s)", mode, len(forms), len(lins) + 1,
             " (the LM head included)" if m.head.quant is not None else "", ", ".join(kinds), INT4_GROUP, where,
             worst, "lossless" if worst <= LOSSLESS_TOLERANCE else "lossy")
    if large and len(large) < len(forms):
        log.info("%d of %d quantized projections run on the integer GEMM, the rest on their small-step form "
                 "up to %d rows", len(large), len(forms), INT4_MAX_ROWS)


def _check_shapes(m: LlamaModel) -> None:
    a = m.args
    qkv_rows = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    want = {"embed": (a.vocab_size, a.hidden_size), "lm_head": (a.vocab_size, a.hidden_size)}
    for name, shape in want.items():
        got = tuple(getattr(m, name).shape)
        if got != shape:
            raise ValueError(f"{name} has shape {got}, config.json implies {shape}")
    for i, layer in enumerate(m.layers):
        for name, shape in (("qkv_weight", (qkv_rows, a.hidden_size)),
                            ("o_weight", (a.hidden_size, a.num_heads * a.head_dim)),
                            ("gate_up_weight", (2 * a.intermediate_size, a.hidden_size)),
                            ("down_weight", (a.hidden_size, a.intermediate_size))):
            got = tuple(getattr(layer, name).shape)
            if got != shape:
                raise ValueError(f"layer {i} {name} has shape {got}, config.json implies {shape}")


class _Weights:
    """Name -> tensor access over all safetensors shards of a directory, converted on read."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{model_dir}: no *.safetensors weights")
        self.dtype, self.device = dtype, device
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}
        self._used: set[str] = set()

    def __enter__(self) -> _Weights:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()
        self._where.clear()

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor in ``dtype`` (default: the run dtype)."""
        if name not in self._where:
            raise ValueError(f"weights are missing tensor {name!r}")
        self._used.add(name)
        return self._where[name].get_tensor(name).to(device=self.device, dtype=dtype or self.dtype)

    def skip(self, name: str) -> None:
        self._used.add(name)

    def cat(self, names: list[str], dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.cat([self.get(n, dtype) for n in names], dim=0)

    def unused(self) -> set[str]:
        return {k for k in self._where if k not in self._used and not k.endswith("rotary_emb.inv_freq")}
