"""Real-text prompts of exact token lengths, from a corpus that ships with Python.

Owns one thing: turning "give me a prompt of N tokens" into real English text (the
docstrings of the standard library, which every Python has), cut to exactly N tokens with
the served model's tokenizer. Deterministic for a given seed.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import random
import warnings
from collections.abc import Callable

_MODULES = ["collections", "functools", "itertools", "json", "logging", "os", "pathlib", "re", "shutil",
            "statistics", "string", "subprocess", "textwrap", "threading", "typing", "unittest", "argparse",
            "asyncio", "csv", "datetime", "decimal", "email", "fractions", "heapq", "http.client", "io",
            "random", "socket", "sqlite3", "tarfile", "tempfile", "urllib.parse", "uuid", "zipfile"]


@functools.cache
def corpus_text() -> str:
    """Concatenated docstrings of standard-library modules and their public members (built once)."""
    parts: list[str] = []
    with warnings.catch_warnings():  # reading typing.io / typing.re warns that they are deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in _MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            for obj in [mod, *(getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_"))]:
                doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
                if doc and len(doc) > 200:
                    parts.append(doc)
    return "\n\n".join(dict.fromkeys(parts))


class PromptMaker:
    """Cuts token windows of requested lengths out of the corpus."""

    def __init__(self, encode: Callable[[str], list[int]], seed: int = 0) -> None:
        self.ids = encode(corpus_text())
        self.rng = random.Random(seed)

    def ids_of_length(self, n: int) -> list[int]:
        if n <= 0:
            raise ValueError(f"prompt length must be positive, got {n}")
        total = len(self.ids)
        start = self.rng.randrange(0, max(1, total - n))
        out = self.ids[start:start + n]
        while len(out) < n:  # longer than the corpus: wrap around
            out += self.ids[:n - len(out)]
        return out
