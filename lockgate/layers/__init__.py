"""Model building blocks: attention over the slot-indexed KV pool, rotary embeddings, RMSNorm.

Pure torch; no knowledge of requests, the scheduler, IPC or the server.
"""

from lockgate.layers.attention import paged_attention, reference_attention, write_kv
from lockgate.layers.attention_meta import AttentionMetadata
from lockgate.layers.norm import rms_norm
from lockgate.layers.rope import RotaryEmbedding, apply_rope, rope_inv_freq

__all__ = ["AttentionMetadata", "RotaryEmbedding", "apply_rope", "paged_attention", "reference_attention",
           "rms_norm", "rope_inv_freq", "write_kv"]
