"""Model architectures in torch: the shared decoder (``decoder``), the families it serves
(``llama``, ``qwen``, ``gemma``, ``phi3``, ``mixtral``, registered in ``registry`` by config.json
``model_type``), their configs (``args``) and what every architecture shares for reading a
checkpoint's tensors (``weights``, ``layout``). The model files themselves (directory resolution,
GGUF conversion) are ``lockgate.checkpoint``'s. Never imports the scheduler, IPC or server. Exports
are lazy so that importing the package does not import torch.
"""

from typing import Any

__all__ = ["ModelArgs", "DecoderModel", "args_from_config"]


def __getattr__(name: str) -> Any:
    if name == "DecoderModel":
        from lockgate.models import decoder

        return decoder.DecoderModel
    if name == "ModelArgs":
        from lockgate.models import args

        return args.ModelArgs
    if name == "args_from_config":
        from lockgate.models import registry

        return registry.args_from_config
    raise AttributeError(name)
