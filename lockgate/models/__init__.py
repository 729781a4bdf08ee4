"""Model architectures in torch: the Llama family (``llama``) and what every architecture shares
for reading a checkpoint's tensors (``weights``). The model files themselves (directory
resolution, GGUF conversion) are ``lockgate.checkpoint``'s. Never imports the scheduler, IPC or
server. Exports are lazy so that importing the package does not import torch.
"""

from typing import Any

__all__ = ["LlamaArgs", "LlamaModel"]


def __getattr__(name: str) -> Any:
    if name in ("LlamaArgs", "LlamaModel"):
        from lockgate.models import llama

        return getattr(llama, name)
    raise AttributeError(name)
