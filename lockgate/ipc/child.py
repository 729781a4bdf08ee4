"""Start-up shared by the server's child processes (scheduler, detokenizer).

Owns the three things every child does first: decode its JSON argument into its typed args
struct, configure logging with the process name in each line, and ignore SIGINT/SIGTERM.
Ctrl-C or a TERM sent to the whole process group reaches the children too; the API process
coordinates shutdown (a Shutdown message, then SIGKILL), so children must not die on their own.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import TypeVar

import msgspec

A = TypeVar("A")


def child_startup(argv: list[str] | None, args_type: type[A], name: str) -> A:
    argv = sys.argv[1:] if argv is None else argv
    args = msgspec.json.decode(argv[0], type=args_type)
    logging.basicConfig(level=getattr(args, "log_level", "INFO"), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return args
