"""The Gemma family: Gemma 2 and Gemma 3 (text: ``gemma3_text``, the 1B model and the language
part of the larger ones).

Owns how their config.json becomes ``ModelArgs``: GeGLU (``gelu_pytorch_tanh``), RMSNorm weights
stored as ``w - 1`` (folded at load), a norm after attention and after the MLP besides the usual
two, embeddings scaled by sqrt(hidden), the attention scale ``query_pre_attn_scalar ** -0.5``,
alternating sliding-window and global layers (``layer_types``, or the older alternation rule),
Gemma 2's soft-capping of attention scores and logits, Gemma 3's q/k norms and the sliding
layers' own rope (``rope_parameters["sliding_attention"]`` or ``rope_local_base_freq``).
"""

from __future__ import annotations

from typing import Any

from lockgate.models.args import ModelArgs, base_args, layer_windows, rope_params
from lockgate.models.layout import Family, read_standard_layer


def _windows(cfg: dict[str, Any], n: int) -> tuple[int | None, ...]:
    if cfg.get("layer_types"):
        return layer_windows(cfg, n)
    w = cfg.get("sliding_window")
    if not w:
        return (None,) * n
    pattern = 2 if cfg.get("model_type") == "gemma2" else int(cfg.get("sliding_window_pattern")
                                                               or cfg.get("_sliding_window_pattern") or 6)
    return tuple(int(w) if (i + 1) % pattern else None for i in range(n))


def parse(cfg: dict[str, Any]) -> ModelArgs:
    mt = cfg.get("model_type")
    n = int(cfg["num_hidden_layers"])
    hidden = int(cfg["hidden_size"])
    windows = _windows(cfg, n)
    features: dict[str, Any] = dict(
        layer_windows=windows, sliding_window=next((w for w in windows if w), None),
        sandwich_norms=True, norm_offset=True, embed_scale=hidden ** 0.5,
        attn_scale=float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping"), final_softcap=cfg.get("final_logit_softcapping"),
        qk_norm=mt == "gemma3_text")
    if mt == "gemma3_text":
        rope = cfg.get("rope_parameters") or {}
        if isinstance(rope.get("sliding_attention"), dict):
            features["local_rope"] = rope_params(cfg, rope["sliding_attention"])
        else:  # transformers 4: rope_local_base_freq, no scaling on the sliding layers
            features["local_rope"] = (float(cfg.get("rope_local_base_freq", 10000.0)), None)
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an encoder-style Gemma) is not supported")
    return base_args(cfg, **features)


FAMILY = Family("Gemma 2 / Gemma 3", ("gemma2", "gemma3_text"), parse, read_standard_layer)
