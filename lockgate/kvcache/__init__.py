"""KV-cache index structures (numpy only, no torch): the slot allocator and, later, the
prefix tree. The KV tensors themselves live in the model runner."""

from lockgate.kvcache.allocator import OutOfSlots, SlotAllocator

__all__ = ["OutOfSlots", "SlotAllocator"]
