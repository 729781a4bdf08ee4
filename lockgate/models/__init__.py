"""Model definitions and loading: the Llama family in torch, and model-directory preparation.

``prepare_model_dir`` (loader) turns a model spec into a Hugging Face style directory;
``LlamaModel.from_pretrained`` (llama) loads it. Never imports the scheduler, IPC or server.
Exports are lazy so that the loader (no torch on a cache hit) can be used without torch.
"""

from typing import Any

__all__ = ["LlamaArgs", "LlamaModel", "prepare_model_dir"]


def __getattr__(name: str) -> Any:
    if name in ("LlamaArgs", "LlamaModel"):
        from lockgate.models import llama

        return getattr(llama, name)
    if name == "prepare_model_dir":
        from lockgate.models.loader import prepare_model_dir

        return prepare_model_dir
    raise AttributeError(name)
