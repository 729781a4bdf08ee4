"""The OpenAI error body and what goes into it: one readable line per error, and the field it is about.

Owns ``error_message`` (a pydantic ``ValidationError`` or a ``ValueError`` -> one line saying what
was wrong, "field.path: message (got input)"), ``error_param`` (the request field an error is
about, OpenAI's ``param``, which the ``openai`` package shows as ``BadRequestError.param``) and
``openai_error`` (the ``{"error": {...}}`` body). Invariants: a path is written the same way in the
message and in ``param`` (``messages[0].content``); ``param`` names only a field the request model
knows (``protocol.request_fields``), never an ignored key. Imports only pydantic and the stdlib.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError


def _path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a field path: ("messages", 0, "content") -> messages[0].content."""
    return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")


def error_param(exc: Exception, fields: Iterable[str] = ()) -> str | None:
    """The request field an error is about, for the OpenAI error body's ``param`` (``None`` when it
    is about no one field): the first pydantic error's location ("temperature",
    "messages[0].content"); for an error raised about the request as a whole (a model validator,
    SamplingParams' range checks), the field its message opens with ("best_of is not supported
    ...", "top_p must be in (0, 1]", "response_format.type must be ...") when that is one of
    ``fields`` (``protocol.request_fields``)."""
    known = set(fields)

    def opening_field(message: str) -> str | None:
        word = re.match(r"[A-Za-z_]\w*", message)
        return word.group(0) if word is not None and word.group(0) in known else None

    if not isinstance(exc, ValidationError):
        return opening_field(str(exc))
    for err in exc.errors(include_url=False):
        if err["loc"]:
            return _path(err["loc"])
        ctx_err = err.get("ctx", {}).get("error")
        found = opening_field(str(ctx_err) if ctx_err is not None else err["msg"])
        if found is not None:
            return found
    return None


def error_message(exc: Exception) -> str:
    """One readable line: "field.path: message (got input)" per pydantic error; str() otherwise."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    parts = []
    for err in exc.errors(include_url=False):
        path = _path(err["loc"])
        ctx_err = err.get("ctx", {}).get("error")
        own = err["type"] == "value_error" and ctx_err is not None  # ours: says what it got if useful
        msg = str(ctx_err) if own else err["msg"]
        if not own and err["type"] != "missing":
            msg += f" (got {err['input']!r:.60})"
        parts.append(f"{path}: {msg}" if path and not msg.startswith(path + " ") else msg)
    return "; ".join(parts)


_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error"}


def openai_error(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI error body: {"error": {"message", "type", "param", "code"}}; code is the HTTP status."""
    etype = "server_error" if status >= 500 else _ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": etype, "param": param, "code": status}}
