"""The Phi-3 family: Phi-3 and Phi-3.5 mini (``phi3``): the Llama layout with fused ``qkv_proj`` and
``gate_up_proj`` tensors in the checkpoint, LongRoPE (short and long factors, an attention factor on
cos/sin) and, where the config sets one, a sliding window on every layer.

Owns how their config.json becomes ``ModelArgs`` and which tensors fill a layer (the fused ones).
"""

from __future__ import annotations

from typing import Any

import torch

from lockgate.models.args import ModelArgs, base_args, layer_windows
from lockgate.models.layout import Family, LayerTensors, read_standard_layer
from lockgate.models.weights import CheckpointReader


def parse(cfg: dict[str, Any]) -> ModelArgs:
    windows = layer_windows(cfg, int(cfg["num_hidden_layers"]), every_layer=True)
    return base_args(cfg, layer_windows=windows, sliding_window=next((w for w in windows if w), None))


def read_layer(w: CheckpointReader, a: ModelArgs, i: int, source: torch.dtype) -> LayerTensors:
    return read_standard_layer(w, a, i, source, fused=True)


FAMILY = Family("Phi-3 / Phi-3.5", ("phi3",), parse, read_layer)
