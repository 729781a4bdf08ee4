"""Model definitions and loading: the Llama family in torch, and model-directory preparation.

``prepare_model_dir`` (loader) turns a model spec into a Hugging Face style directory;
``LlamaModel.from_pretrained`` (llama) loads it. Never imports the scheduler, IPC or server.
"""

from lockgate.models.llama import LlamaArgs, LlamaModel
from lockgate.models.loader import prepare_model_dir

__all__ = ["LlamaArgs", "LlamaModel", "prepare_model_dir"]
