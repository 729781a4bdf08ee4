"""lockgate: an LLM serving engine with a token-granular KV pool and peak-usage admission.

Public offline API: ``LLM``, ``SamplingParams`` and ``StructuredOutput`` (constrained decoding). ``LLM`` is imported lazily so that
importing ``lockgate`` (for example from the API process) never pulls in torch.
"""

from typing import TYPE_CHECKING, Any

from lockgate.sampling import SamplingParams, StructuredOutput
from lockgate.version import __version__

if TYPE_CHECKING:
    from lockgate.offline import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "__version__"]



def __getattr__(name: str) -> Any:
    if name == "LLM":
        from lockgate.offline import LLM

        return LLM
    raise AttributeError(name)
