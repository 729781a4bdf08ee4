"""Mixtral: Mistral's attention with a top-k mixture of experts (``block_sparse_moe``: router
``gate``, experts ``w1`` gate / ``w3`` up / ``w2`` down) in every layer, the chosen experts'
weights always renormalised.

Owns how its config.json becomes ``ModelArgs`` and the experts' tensor names.
"""

from __future__ import annotations

from typing import Any

import torch

from lockgate.models.args import ModelArgs, MoeArgs, base_args, layer_windows
from lockgate.models.layout import Family, LayerTensors, read_standard_layer
from lockgate.models.weights import CheckpointReader


def parse(cfg: dict[str, Any]) -> ModelArgs:
    n = int(cfg["num_hidden_layers"])
    windows = layer_windows(cfg, n, every_layer=True)
    moe = MoeArgs(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                  expert_size=int(cfg["intermediate_size"]), norm_topk=True, sparse_layers=(True,) * n)
    return base_args(cfg, layer_windows=windows, sliding_window=next((w for w in windows if w), None), moe=moe)


def read_layer(w: CheckpointReader, a: ModelArgs, i: int, source: torch.dtype) -> LayerTensors:
    return read_standard_layer(w, a, i, source, moe_names="mixtral")


FAMILY = Family("Mixtral", ("mixtral",), parse, read_layer)
