"""The Llama family: Llama 2 / 3.x (rope scaling ``llama3``, tied or untied heads), SmolLM/SmolLM2,
and Mistral (every layer on its sliding window, computed as such, not a capped context).

Owns how their config.json becomes ``ModelArgs``; the layers are the shared decoder's
(``models/decoder.py``) in the standard layout (``models/layout.py``).
"""

from __future__ import annotations

from typing import Any

from lockgate.models.args import ModelArgs, base_args, layer_windows
from lockgate.models.layout import Family, read_standard_layer


def parse(cfg: dict[str, Any]) -> ModelArgs:
    n = int(cfg["num_hidden_layers"])
    windows = layer_windows(cfg, n, every_layer=cfg.get("model_type") == "mistral")
    return base_args(cfg, layer_windows=windows, sliding_window=next((w for w in windows if w), None))


FAMILY = Family("Llama / Mistral", ("llama", "mistral"), parse, read_standard_layer)
