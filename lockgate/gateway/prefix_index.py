"""Which replica has which prompt prefix cached, in hashed blocks (the gateway's view of the caches).

A prompt is a sequence of keys (characters of its text, or token ids of the served model). It is cut
into blocks of ``block_size`` keys; only full blocks count. Block ``i``'s hash covers the whole
prefix up to and including block ``i`` (each hash chains the previous one), so equal hashes mean
equal prefixes and a match is the longest run of leading blocks a replica holds.

``PrefixIndex`` maps block hash -> the replicas a request with that prefix was sent to, bounded
to ``max_blocks`` entries and evicted least-recently-used (a block is used when it is matched or
recorded; a prompt's blocks are touched deepest first, so its tail is evicted before its head). Invariants: ``len(index) <= max_blocks``; no entry has an empty replica set.

The gateway cannot see the replicas' radix trees; this is its guess of them, right while the
replicas keep what they were sent. When a replica evicts, the guess costs one cold prefill there.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(keys: Sequence[int] | str, block_size: int, salt: str = "") -> list[bytes]:
    """Chained hashes of the full blocks of ``keys`` (a string's characters or token ids);
    ``salt`` (a LoRA adapter's name) starts the chain, so equal prompts under different adapters
    never share a block."""
    out: list[bytes] = []
    prev = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).digest() if salt else b""
    for start in range(0, len(keys) - block_size + 1, block_size):
        block = keys[start:start + block_size]
        data = block.encode("utf-8", "surrogatepass") if isinstance(block, str) else _ids_bytes(block)
        prev = hashlib.blake2b(prev + data, digest_size=16).digest()
        out.append(prev)
    return out


def _ids_bytes(ids: Sequence[int]) -> bytes:
    return b"".join(int(i).to_bytes(4, "little", signed=True) for i in ids)


class PrefixIndex:
    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[bytes], replicas: Sequence[str]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each of ``replicas`` holds; only replicas with >= 1 block appear."""
        alive = set(replicas)
        matched: dict[str, int] = {}
        depth = 0
        for h in hashes:
            holders = self._blocks.get(h)
            if holders is None or not alive & holders:
                break
            alive &= holders
            depth += 1
            for r in alive:
                matched[r] = depth
        self._touch(hashes[:depth])
        return matched

    def record(self, hashes: Sequence[bytes], replica: str) -> None:
        """``replica`` now holds every block of ``hashes`` (it was sent that prompt)."""
        for h in reversed(hashes):
            holders = self._blocks.get(h)
            if holders is None:
                self._blocks[h] = {replica}
            else:
                holders.add(replica)
                self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def _touch(self, hashes: Sequence[bytes]) -> None:
        # Deepest first, so a prompt's first block is its most recent one: eviction takes tails first
        # and never leaves a tail whose head is gone (a tail alone can never match).
        for h in reversed(hashes):
            self._blocks.move_to_end(h)

    def forget(self, replica: str) -> None:
        """Drop ``replica`` everywhere (it left the fleet or restarted with an empty cache)."""
        empty = []
        for h, holders in self._blocks.items():
            holders.discard(replica)
            if not holders:
                empty.append(h)
        for h in empty:
            del self._blocks[h]
