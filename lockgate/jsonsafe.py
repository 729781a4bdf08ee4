"""JSON text from outside, read with limits: no recursion error, no lone surrogate, no huge integer.

Owns ``loads``: JSON text (a schema sent as a string, a tool call's arguments, a model's output)
-> the value, or ``ValueError`` saying what is wrong with it. It is what every parser of JSON that
did not come through the request body's own checks uses, so that none of them can raise anything
but ``ValueError`` on any input.

Invariants: a value ``loads`` returns is nested at most ``MAX_DEPTH`` deep (objects and arrays),
every string and key in it is valid Unicode (no lone surrogate from a ``\\ud800`` escape), every
integer fits in 64 bits, every float is finite, and walking it recursively (``json.dumps``, a schema compiler) is safe.
The depth walk is iterative. Imports only the stdlib and ``sampling``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from lockgate.sampling import is_text

MAX_DEPTH = 64
_INT_RANGE = (-(2**63), 2**64)  # signed and unsigned 64-bit


def problem(value: object, max_depth: int = MAX_DEPTH) -> tuple[str, str] | None:
    """The first thing in decoded JSON that breaks the invariants, as (path, what is wrong), or None."""
    stack: list[tuple[object, str, int]] = [(value, "", 1)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > max_depth:
                return path, f"nested too deeply: at most {max_depth} levels of objects and arrays"
            if isinstance(v, dict):
                for k, x in v.items():
                    if not is_text(k):
                        return path, f"the key {k!r:.40} is not valid Unicode (a lone surrogate escape)"
                    stack.append((x, f"{path}.{k}" if path else k, depth + 1))
            else:
                stack.extend((x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v))
        elif isinstance(v, str):
            if not is_text(v):
                return path, "text is not valid Unicode: it contains a lone surrogate escape (\\ud800-\\udfff)"
        elif type(v) is int and not _INT_RANGE[0] <= v < _INT_RANGE[1]:
            return path, f"the integer {v} is out of range: integers must fit in 64 bits"
        elif type(v) is float and not math.isfinite(v):
            return path, "a number is out of range (or NaN / Infinity, which JSON does not have)"
    return None


def loads(text: str | bytes, what: str = "JSON text", max_depth: int = MAX_DEPTH) -> Any:
    """``text`` decoded; ValueError naming ``what`` if it is not JSON or breaks the invariants."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply: at most {max_depth} levels of objects and arrays") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, int conversion limits
        raise ValueError(f"not JSON: {what} is not valid JSON ({e})") from None
    found = problem(value, max_depth)
    if found is not None:
        path, why = found
        raise ValueError(f"{what}{' at ' + path if path else ''}: {why}")
    return value
