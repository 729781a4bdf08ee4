"""The Llama family in plain torch: Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2.

Owns the architecture (``LlamaArgs``, parsed and validated from a Hugging Face
``config.json``), weight loading from safetensors (all shards, converted to the run dtype)
and the forward pass over one step of flat tokens.

Invariants:

* Weights are fused at load: one QKV matmul ([(H + 2 Hkv) D, hidden]) and one gate/up matmul
  ([2 F, hidden]) per layer, each a ``lockgate.layers.linear.Linear`` with its forms
  (``lockgate.layers.forms.make_forms``: dense always; with ``quantization`` auto/int4 the
  quantized forms, made from the checkpoint's full-precision values read as float32 one layer
  at a time, before rounding to the run dtype, auto only where nothing is lost; with ``fp32`` a
  float32 copy for 16-bit runs). The LM head gets quantized forms only where nothing is lost
  (the default model's Q8_0 head). Which form serves which call is each projection's
  ``FormChoice``, by role (``projections``, ``choose_forms``), measured by
  ``lockgate.runner.tuning``. Biases are loaded when the checkpoint has them (Qwen2 q/k/v,
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
from torch import nn

from lockgate.kernel_choice import FormChoice
from lockgate.layers.attention import AttentionMetadata, paged_attention
from lockgate.layers.forms import INT4_MODES, make_forms
from lockgate.layers.linear import Linear
from lockgate.layers.lora import LoraStep
from lockgate.layers.norm import rms_norm
from lockgate.layers.ops import KernelOps, LayerOps, TorchOps
from lockgate.layers.rope import SUPPORTED_ROPE_TYPES, RotaryEmbedding, rope_type_of
from lockgate.models.lora import LoraTargets, ModuleTarget
from lockgate.models.weights import CheckpointReader, log_quantization

log = logging.getLogger("lockgate.models")

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
PROJECTION_ROLES = ("qkv", "o", "gate_up", "down", "head")  # ``LlamaModel.projections``' keys


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

    def lora_targets(self) -> LoraTargets:
        """The projections a LoRA adapter may touch, by PEFT module name, in the fused layout."""
        h, hkv, d, hid, f = self.num_heads, self.num_kv_heads, self.head_dim, self.hidden_size, self.intermediate_size
        qkv = (h + 2 * hkv) * d
        return LoraTargets(self.num_layers, {
            "q_proj": ModuleTarget("qkv", hid, qkv, 0, h * d),
            "k_proj": ModuleTarget("qkv", hid, qkv, h * d, (h + hkv) * d),
            "v_proj": ModuleTarget("qkv", hid, qkv, (h + hkv) * d, qkv),
            "o_proj": ModuleTarget("o", h * d, hid, 0, hid),
            "gate_proj": ModuleTarget("gate_up", hid, 2 * f, 0, f),
            "up_proj": ModuleTarget("gate_up", hid, 2 * f, f, 2 * f),
            "down_proj": ModuleTarget("down", f, hid, 0, hid),
        })

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
                 fp32: bool = False, cpu_kernels: bool = False, want: dict[str, set[str]] | None = None):
        """``w``: this layer's tensors at full precision (any float dtype), cast here to ``dtype``;
        ``quantization``, ``fp32`` (make float32 copies) and ``cpu_kernels`` (lockgate's kernels
        are loaded) decide the projections' forms (``make_forms``); ``want``: per projection
        (qkv, o, gate_up, down) the forms to make, None for every one it can have."""
        super().__init__()

        def need(name: str) -> nn.Parameter:
            t = w[name]
            assert t is not None, name
            return _frozen(t.to(dtype))

        def opt(name: str) -> nn.Parameter | None:
            t = w[name]
            return None if t is None else _frozen(t.to(dtype))

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
            forms = make_forms(source, dtype, quantization, cpu_kernels, fp32=fp32, source_bias=w[f"{name}_bias"],
                               want=None if want is None else want.get(name, set()))
            return Linear(weight, bias, forms)

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
                 fp32: bool = False, quantization: str = "none", cpu_kernels: bool = False,
                 head_want: set[str] | None = None):
        """embed/norm/lm_head at full precision, cast to ``dtype`` (default: embed's). The LM head
        gets quantized forms only where they lose nothing (``quantization`` other than none): a
        head is a poor place to lose precision. ``head_want``: the head's forms to make (None: all)."""
        super().__init__()
        dtype = dtype or embed.dtype
        self.args = args
        self.embed = _frozen(embed.to(dtype))  # [V, hidden]
        self.layers = nn.ModuleList(layers)
        self.norm = _frozen(norm.to(dtype))  # [hidden]
        self.lm_head = self.embed if lm_head is None else _frozen(lm_head.to(dtype))  # [V, hidden] (tied: same)
        head_source = embed if lm_head is None else lm_head
        head_forms = make_forms(head_source, dtype, "none" if quantization == "none" else "auto", cpu_kernels,
                                fp32=fp32, want=head_want)
        self.head = Linear(self.lm_head, None, head_forms)
        self.rope = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling, embed.device)
        self.scale = 1.0 / math.sqrt(args.head_dim)
        # The layers' ops backend: lockgate's fused CPU ops when ``lockgate.kernels`` is loaded
        # (with a whole-step fast path for decode steps), else plain torch.
        self.ops: LayerOps = KernelOps() if cpu_kernels else TorchOps()

    def use_kernels(self, on: bool) -> None:
        """Run the layers on lockgate's fused CPU ops (``on``; they must be loaded) or on plain torch."""
        if on != self.fused_ops:
            self.ops = KernelOps() if on else TorchOps()

    @property
    def fused_ops(self) -> bool:
        return self.ops.name == "kernels"

    def projections(self) -> dict[str, list[Linear]]:
        """Every projection by role (qkv, o, gate_up, down: one per layer; head: the LM head)."""
        roles: dict[str, list[Linear]] = {"qkv": [], "o": [], "gate_up": [], "down": []}
        for layer in typing.cast(list[DecoderLayer], self.layers):
            for role, lin in layer.projections().items():
                roles[role].append(lin)
        roles["head"] = [self.head]
        return roles

    def choose_forms(self, choices: dict[str, FormChoice], drop: bool = False) -> None:
        """Give each role's projections their choice (``Linear.choose``); roles not named keep
        theirs. ``drop``: free the forms no choice calls (a measured table is final)."""
        for role, lins in self.projections().items():
            for lin in lins:
                if role in choices:
                    lin.choose(choices[role])
                if drop:
                    lin.drop_unchosen()
        self.ops.forget()  # the whole-step path packed the old choices' weights

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
                logits_rows: torch.Tensor | None, lora: LoraStep | None = None) -> torch.Tensor | None:
        """input_ids/positions [T] i64, k_cache/v_cache [layers, capacity, Hkv, D],
        logits_rows [S] i64 (rows of T) -> logits [S, V] f32, or None when logits_rows is None.
        ``lora``: the step's adapters (rows' low-rank updates of every projection), None for none.
        """
        x = F.embedding(input_ids, self.embed)  # [T, hidden]
        cos, sin = self.rope.cos_sin(positions, x.dtype)  # [T, 1, D] each
        a = self.args
        layers = typing.cast(list[DecoderLayer], self.layers)
        whole = None if lora is not None else self.ops.whole_step(
            x, cos, sin, meta, k_cache, v_cache, layers, a.num_heads, a.num_kv_heads, a.rms_norm_eps, self.scale)
        x = whole if whole is not None else self._layers(x, cos, sin, meta, k_cache, v_cache, lora)
        if logits_rows is None:
            return None
        x = rms_norm(x.index_select(0, logits_rows), self.norm, self.args.rms_norm_eps)  # [S, hidden]
        return self.head(x).float()  # [S, V]

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        """The decoder layers on ``self.ops`` (torch, or lockgate's fused kernels): x [T, hidden] ->
        [T, hidden], the residual stream, updated in place. Each layer's MLP output is added at the
        start of the next (``add_norm``), where the kernel backend fuses the add into the norm.
        ``lora``: each projection's output gets its rows' adapter updates (``LoraStep.add``)."""
        a, ops = self.args, self.ops
        t = x.shape[0]
        h, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        pending: torch.Tensor | None = None  # the previous layer's MLP output, not yet added to x

        def project(lin: Linear, inp: torch.Tensor, i: int, role: str) -> torch.Tensor:
            out = lin(inp)
            return out if lora is None else lora.add(out, inp, i, role)

        for i, layer in enumerate(typing.cast(list[DecoderLayer], self.layers)):
            y = ops.add_norm(x, pending, layer.attn_norm, a.rms_norm_eps)  # x += pending; [T, hidden]
            q, k, v = ops.rope_qkv(project(layer.qkv, y, i, "qkv"), cos, sin, h, hkv, k_cache[i], v_cache[i],
                                   meta.out_slots)
            o = paged_attention(q, k, v, k_cache[i], v_cache[i], meta, self.scale)  # [T, H, D]
            y = ops.add_norm(x, project(layer.o, o.reshape(t, h * d), i, "o"), layer.mlp_norm, a.rms_norm_eps)
            pending = project(layer.down, ops.silu_mul(project(layer.gate_up, y, i, "gate_up")), i, "down")
        if pending is not None:
            x += pending
        return x

    @staticmethod
    def from_pretrained(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu", quantization: str = "none",
                        fp32: bool = False, cpu_kernels: bool = False,
                        want: dict[str, set[str]] | None = None) -> LlamaModel:
        """Load config.json + safetensors (all shards) from a Hugging Face model directory.

        ``fp32``: 16-bit runs also keep float32 copies of every projection and the LM head, made
        from the checkpoint's values (the ``fp32`` form).
        ``quantization`` (``lockgate.layers.forms.INT4_MODES``): none, int4 (every projection the
        kernel fits), auto (only projections already on a 4- or 8-bit grid: nothing lost).
        ``cpu_kernels``: lockgate's CPU kernels are loaded (``lockgate.kernels.load``): the model
        runs its fused ops and may have lockgate's quantized forms (``make_forms``).
        ``want``: per role (qkv, o, gate_up, down, head) the forms to make; None: every form a
        projection can have (what a measurement needs). Projections follow their static choice
        (``FormChoice.static``) until ``choose_forms``.
        """
        if quantization not in INT4_MODES:
            raise ValueError(f"quantization {quantization!r} is not one of {INT4_MODES}")
        # quantized and float32 forms are made from the unrounded values (read one layer at a time)
        source = dtype if quantization == "none" and not fp32 else torch.float32
        model_dir = Path(model_dir)
        cfg_path = model_dir / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{model_dir}: no config.json")
        args = LlamaArgs.from_config(json.loads(cfg_path.read_text()))
        with CheckpointReader(model_dir, dtype, torch.device(device)) as w:
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
                }, dtype, quantization, fp32, cpu_kernels, want))
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
        model = LlamaModel(args, embed, layers, norm, lm_head, dtype, fp32, quantization, cpu_kernels,
                           None if want is None else want.get("head", set()))
        del embed, lm_head  # the float32 copies (if any) live on only in the Linear forms
        _check_shapes(model)
        if quantization != "none":
            log_quantization([lin for group in model.projections().values() for lin in group], model.head,
                             quantization)
        return model


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
