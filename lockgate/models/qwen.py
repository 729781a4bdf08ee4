"""The Qwen family: Qwen2 / 2.5 (q/k/v biases), Qwen3 (q/k norms, no biases) and Qwen3-MoE
(Qwen3's attention, a top-k mixture of experts in every sparse layer).

Owns how their config.json becomes ``ModelArgs``: the biases, the norms, which layers slide
(``use_sliding_window`` from layer ``max_window_layers`` on, or ``layer_types``) and the experts.
"""

from __future__ import annotations

from typing import Any

from lockgate.models.args import ModelArgs, MoeArgs, base_args, layer_windows
from lockgate.models.layout import Family, read_standard_layer


def _windows(cfg: dict[str, Any], n: int) -> tuple[int | None, ...]:
    if cfg.get("layer_types"):
        return layer_windows(cfg, n)
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        first = int(cfg.get("max_window_layers", 0))
        return tuple(int(cfg["sliding_window"]) if i >= first else None for i in range(n))
    return (None,) * n


def parse(cfg: dict[str, Any]) -> ModelArgs:
    mt = cfg.get("model_type")
    n = int(cfg["num_hidden_layers"])
    windows = _windows(cfg, n) if cfg.get("use_sliding_window") or cfg.get("layer_types") else (None,) * n
    bias = bool(cfg.get("attention_bias", False))
    features: dict[str, Any] = dict(layer_windows=windows, sliding_window=next((w for w in windows if w), None),
                                    qkv_bias=True if mt == "qwen2" else bias, o_bias=False if mt == "qwen2" else bias,
                                    qk_norm=mt in ("qwen3", "qwen3_moe"))
    if mt == "qwen3_moe":
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        features["moe"] = MoeArgs(
            num_experts=experts, top_k=int(cfg["num_experts_per_tok"]), expert_size=int(cfg["moe_intermediate_size"]),
            norm_topk=bool(cfg.get("norm_topk_prob", False)),
            sparse_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)))
    return base_args(cfg, **features)


FAMILY = Family("Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE", ("qwen2", "qwen3", "qwen3_moe"), parse, read_standard_layer)
