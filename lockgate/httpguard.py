"""ASGI guards shared by the API server and the gateway: the bearer-token check, the body limit and
the last-resort error handler.

Owns three plain ASGI middlewares (not Starlette's ``@app.middleware("http")``, which wraps every
response body, streamed ones chunk by chunk, in its own task and memory stream: measured with
py-spy at concurrency 1, a fifth of the API process's time). Each answers a refused request
itself, through ``render(scope, status, message)``, so each app keeps its own error body format.

Invariants:

* ``BearerAuth``: every HTTP route but ``/health`` and the ``pages`` it is given (static pages
  read with GET or HEAD: the chat page, the API docs; they hold no data) needs
  ``Authorization: Bearer <key>`` with one of the keys; each comparison is constant-time and every key is compared; a refused request never
  reaches the app (nothing is routed, recorded or read beyond its headers). The name of the key
  that matched (``--api-key NAME=KEY``; None for a bare key) is put in ``scope["state"]["api_key_name"]``
  (the request's tenant).
* ``BodyLimit``: no request body larger than ``limit()`` bytes is ever held whole. A declared
  ``Content-Length`` over the limit is refused with 413 before a byte is read; a chunked body is
  read up to the limit and refused as soon as it passes it; either way the app never sees it.
* ``InternalErrors``: an unexpected exception is a 500 in the app's format and leaves the
  keep-alive connection open (bad input never gets here: it is a 4xx where it is parsed).

Imports only starlette and the stdlib (no server or gateway module).
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Callable, Iterable, Mapping

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

Render = Callable[[Scope, int, str], Response]

# The static pages a browser opens (server/pages.py: the chat page, the API reference and its files);
# they hold no data, so GET and HEAD read them without the key, on the server and through the gateway.
PAGES = ("/", "/docs", "/openapi.json", "/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css", "/docs/favicon.png")


ApiKeys = Mapping[str, "str | None"]  # key -> its name (the tenant), None for a bare key
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}")


def split_key(entry: str) -> tuple[str | None, str]:
    """An ``--api-key`` entry -> (name, key): ``NAME=KEY`` when NAME is a name (letters, digits,
    ``_.:@-``, at most 64) and KEY is not only '=' padding; else the whole entry is a bare key."""
    name, sep, key = entry.strip().partition("=")
    if sep and _KEY_NAME.fullmatch(name) and key.strip("="):
        return name, key
    return None, entry.strip()


def parse_api_keys(entries: Iterable[str], flag: str = "--api-key") -> dict[str, str | None]:
    """``KEY`` / ``NAME=KEY`` entries -> key -> name; ValueError naming ``flag`` for an empty or repeated key."""
    keys: dict[str, str | None] = {}
    for entry in entries:
        name, key = split_key(entry)
        if not key:
            raise ValueError(f"{flag}: an empty key")
        if key in keys:
            raise ValueError(f"{flag}: a key is given twice (names {keys[key]!r} and {name!r})")
        keys[key] = name
    return keys


def read_key_file(path: str) -> list[str]:
    """``--api-key-file``: one ``NAME=KEY`` (or bare key) per line; blank lines and '#' comments skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path}: cannot read it ({e})") from None
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def key_entries(flags: Iterable[str], file: str | None = None) -> list[str]:
    """The API key entries of a server or gateway: ``--api-key`` values and ``--api-key-file`` lines, else
    ``$LOCKGATE_API_KEY`` (one entry per line); [] when there are none (no key required)."""
    import os

    entries = [*flags, *(read_key_file(file) if file else [])]
    if not entries:
        entries = [ln.strip() for ln in os.environ.get("LOCKGATE_API_KEY", "").splitlines() if ln.strip()]
    return entries


def key_env(flags: Iterable[str], file: str | None = None) -> dict[str, str]:
    """The environment that hands a server's keys to its replicas (never on their command line)."""
    entries = key_entries(flags, file)
    return {"LOCKGATE_API_KEY": "\n".join(entries)} if entries else {}


def key_name(authorization: str | bytes, keys: ApiKeys) -> tuple[bool, str | None]:
    """(whether an ``Authorization`` value carries ``Bearer <one of keys>``, that key's name);
    every key is compared, each in constant time."""
    given = authorization.encode() if isinstance(authorization, str) else authorization
    found, name = False, None
    for key, n in keys.items():
        if hmac.compare_digest(given, b"Bearer " + key.encode()):
            found, name = True, n
    return found, name


def has_key(authorization: str | bytes, keys: ApiKeys | str) -> bool:
    """Whether an ``Authorization`` header value carries ``Bearer <key>`` for one of ``keys`` (constant-time)."""
    return key_name(authorization, {keys: None} if isinstance(keys, str) else keys)[0]


class BearerAuth:
    def __init__(self, app: ASGIApp, api_key: ApiKeys | str, render: Render, pages: Iterable[str] = ()) -> None:
        """``pages``: the exact paths GET and HEAD may read without a key (no prefixes: a prefix would
        let '/docs/../v1/...' through a gateway that normalizes the path it proxies)."""
        self.app = app
        self.keys: ApiKeys = {api_key: None} if isinstance(api_key, str) else dict(api_key)
        self.render = render
        self.pages = frozenset(pages)

    def _public(self, scope: Scope) -> bool:
        path = scope["path"]
        return path == "/health" or (scope["method"] in ("GET", "HEAD") and path in self.pages)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._public(scope):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            ok, name = key_name(given, self.keys)
            if not ok:
                message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                await self.render(scope, 401, message)(scope, receive, send)
                return
            scope.setdefault("state", {})["api_key_name"] = name
        await self.app(scope, receive, send)


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: Callable[[], int], flag: str, render: Render) -> None:
        self.app = app
        self.limit = limit  # evaluated per request: the API server's depends on the model, known once loaded
        self.flag = flag
        self.render = render

    def _too_large(self, scope: Scope, size: str) -> Response:
        limit = self.limit()
        return self.render(scope, 413, f"the request body is {size}; the limit is {limit} bytes ({self.flag})")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None:
            if declared.isdigit() and int(declared) > limit:
                await self._too_large(scope, f"{int(declared)} bytes")(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server stops reading at Content-Length
            return
        # No length given (chunked): read it here, at most limit bytes, then replay it to the app.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                replay: list[Message] = [message]
                break
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await self._too_large(scope, f"over {limit} bytes")(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
                break

        async def replayed() -> Message:
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replayed, send)


class InternalErrors:
    """An exception no route handled becomes a 500 in the app's error format, logged once with its
    traceback, and the connection stays usable. (Left to Starlette, the exception is re-raised after
    its plain-text 500 and uvicorn closes the connection: the client's next request on that keep-alive
    connection is reset.) An exception after the response started can only end that response."""

    def __init__(self, app: ASGIApp, render: Render, logger: logging.Logger) -> None:
        self.app = app
        self.render = render
        self.log = logger

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            self.log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                return  # the body was cut short; nothing more can be said on this response
            await self.render(scope, 500, "internal error: the server failed on this request (it is logged)")(
                scope, receive, send)
