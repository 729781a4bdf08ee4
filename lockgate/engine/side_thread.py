"""A side thread of the scheduler process: work that must not run on the loop (a grammar compile,
an adapter's files read and checked) runs here, in order, one job at a time.

Owns ``SideThread``: ``submit(job)`` queues a callable; the thread runs it, then calls ``wake``
(the scheduler process's: a ``Wake`` message to its own socket, so an idle loop blocked there
collects the result). Jobs hand their results over themselves (under their owner's lock); a job
that raises is logged and the thread goes on.

The thread's stack is ``STACK_BYTES`` (virtual: only the pages a job touches are committed), several
times the grammar sandbox worker's (``grammar.sandbox.STACK_BYTES``), so a grammar that compiled
there compiles here too.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("lockgate.engine")

STACK_BYTES = 256 * 1024 * 1024


class SideThread:
    def __init__(self, name: str, wake: Callable[[], None] | None = None) -> None:
        self.name = name
        self._wake = wake
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            previous = threading.stack_size(STACK_BYTES)
            try:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            finally:
                threading.stack_size(previous)
        self._jobs.put(job)

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001  (a job hands its own errors over; this is a bug's last stop)
                log.exception("a job on the %s thread failed", self.name)
            if self._wake is not None:
                self._wake()
