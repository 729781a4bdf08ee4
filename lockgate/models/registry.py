"""The model families lockgate serves, by config.json ``model_type``: the one place a new family is
registered (a module with a ``FAMILY``: its parser and layer reader, on the shared decoder).

Invariants: a ``model_type`` belongs to exactly one family; an unknown one is a ValueError naming
it and listing every supported ``model_type``.
"""

from __future__ import annotations

from typing import Any

from lockgate.models import gemma, llama, mixtral, phi3, qwen
from lockgate.models.args import ModelArgs
from lockgate.models.layout import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen.FAMILY, gemma.FAMILY, phi3.FAMILY, mixtral.FAMILY)
_BY_TYPE = {mt: f for f in FAMILIES for mt in f.model_types}
assert len(_BY_TYPE) == sum(len(f.model_types) for f in FAMILIES), "a model_type is registered twice"
SUPPORTED_MODEL_TYPES = tuple(_BY_TYPE)


def family_for(cfg: dict[str, Any]) -> Family:
    mt = cfg.get("model_type")
    if mt not in _BY_TYPE:
        raise ValueError(f"unsupported model_type {mt!r} (architectures={cfg.get('architectures')}); lockgate "
                         f"supports {', '.join(SUPPORTED_MODEL_TYPES)}")
    return _BY_TYPE[mt]


def args_from_config(cfg: dict[str, Any]) -> ModelArgs:
    """config.json (a dict) -> ``ModelArgs``, by the family its ``model_type`` names."""
    return family_for(cfg).parse(cfg)
