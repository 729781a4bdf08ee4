"""AdapterRegistry: the LoRA adapters an engine serves, by name.

Owns the names (name -> (uid, info)): a fresh uid per load, which is also the prefix-cache namespace,
so a name loaded again never reuses KV computed under its old weights; the adapters being unloaded
(their weights stay with the runner until no request that named them is left: ``reap``); the reads of
adapter files on a side thread (``read_aside`` / ``take_reads``); and the runner's ``--max-loras``
slots (``slots``, an ``AdapterSlots`` the engine hands to the scheduler, which fills them at
admission). The runner reads and keeps the weights; this object decides which it keeps.

Invariants: a name maps to one uid, never reused; a uid is in ``names`` or in ``unloading`` until
its weights are dropped, not both; a name is read on the side thread at most once at a time.

Called by ``EngineCore`` (which keeps the engine's public adapter methods and says which uids
requests still use) on the thread that steps the engine; only ``read_aside``'s read runs elsewhere.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable

from lockgate.checkpoint.peft import AdapterInfo
from lockgate.config import LoraConfig
from lockgate.engine.side_thread import SideThread
from lockgate.runner import Runner
from lockgate.scheduler.lora_slots import AdapterSlots

# a side-thread read's outcome: (ticket, name, info, weights, error)
Read = tuple[str, str, AdapterInfo | None, object, str | None]


class AdapterRegistry:
    def __init__(self, cfg: LoraConfig, runner: Runner, wake: Callable[[], None] | None = None) -> None:
        """With LoRA on, readies the runner's adapter slots (``slots``; None with LoRA off)."""
        self.enabled = cfg.enable_lora
        self.runner = runner
        self.names: dict[str, tuple[int, AdapterInfo]] = {}
        self.unloading: set[int] = set()  # uids whose weights wait for their last request
        self._uids = itertools.count(1)
        self._reading: set[str] = set()  # names whose files are being read on the side thread
        self._reads: list[Read] = []
        self._reads_lock = threading.Lock()
        self._side = SideThread("adapter-read", wake)
        self.slots: AdapterSlots | None = None
        if self.enabled:
            runner.enable_lora(cfg.max_loras, cfg.max_lora_rank)
            self.slots = AdapterSlots(cfg.max_loras, runner.put_adapter)

    def uid(self, name: str) -> int | None:
        """The number of the adapter loaded as ``name`` (None: not loaded)."""
        entry = self.names.get(name)
        return None if entry is None else entry[0]

    def load(self, name: str, path: str, replace: bool = False) -> AdapterInfo:
        """Read, check and register the PEFT adapter at ``path`` as ``name``, now (``EngineCore.load_adapter``)."""
        self._check_new(name, replace)
        info, weights = self.runner.read_adapter(name, path)
        return self._install(name, info, weights)

    def read_aside(self, ticket: str, name: str, path: str, replace: bool = False) -> None:
        """``load`` with the files read on the side thread; ``take_reads`` registers the adapter after."""
        self._check_new(name, replace)
        self._reading.add(name)

        def read() -> None:
            info, weights, error = None, None, None
            try:
                info, weights = self.runner.read_adapter(name, path)
            except (ValueError, OSError) as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001  (a hostile file may break a reader anyhow: its load fails)
                error = f"LoRA adapter {path}: cannot be read ({type(e).__name__}: {e})"
            with self._reads_lock:
                self._reads.append((ticket, name, info, weights, error))

        self._side.submit(read)

    def take_reads(self) -> list[tuple[str, str, str | None]]:
        """Side-thread reads that ended since the last call, registered now if good: (ticket, name, error)."""
        if not self._reads:
            return []
        with self._reads_lock:
            reads, self._reads = self._reads, []
        out = []
        for ticket, name, info, weights, error in reads:
            self._reading.discard(name)
            if error is None:
                assert info is not None
                self._install(name, info, weights)
            out.append((ticket, name, error))
        return out

    def _check_new(self, name: str, replace: bool) -> None:
        if not self.enabled:
            raise ValueError("LoRA adapters are disabled (--no-enable-lora)")
        if not isinstance(name, str) or not name.strip():
            raise ValueError("a LoRA adapter needs a non-empty name")
        if name in self._reading:
            raise ValueError(f"a LoRA adapter named {name!r} is being loaded already")
        if name in self.names and not replace:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (unload it first)")

    def _install(self, name: str, info: AdapterInfo, weights: object) -> AdapterInfo:
        """Keep ``weights`` under a fresh uid as ``name``; an adapter of that name already is unloaded
        (its requests finish on its weights; ``reap`` drops them after)."""
        uid = next(self._uids)
        self.runner.add_adapter(uid, weights)
        if name in self.names:
            self.unloading.add(self.names.pop(name)[0])
        self.names[name] = (uid, info)
        return info

    def unload(self, name: str) -> None:
        """Take ``name`` away (KeyError if it is not loaded); its weights wait for ``reap``."""
        uid, _ = self.names.pop(name)
        self.unloading.add(uid)

    def reap(self, in_use: Iterable[int]) -> None:
        """Drop the weights of unloaded adapters no request uses (``in_use``: the adapter uids of every
        request the engine holds) and that no longer sit in a slot."""
        used = set(in_use)
        for uid in list(self.unloading):
            if uid not in used and (self.slots is None or self.slots.forget(uid)):
                self.runner.drop_adapter(uid)
                self.unloading.discard(uid)
