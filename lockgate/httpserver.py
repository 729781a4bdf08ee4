"""uvicorn as both of lockgate's HTTP servers (``serve`` and ``gateway``) run it: with a deadline
for a request's headers and one for idle keep-alive connections.

Owns ``uvicorn_config``. uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``
seconds, but it sets no deadline on a new connection nor on one that sends a byte now and then:
a client that connects and never finishes its headers holds a connection (and a file descriptor)
for ever, and thousands of them exhaust the server. ``HeaderDeadline`` (a subclass of the HTTP
protocol uvicorn would use) arms a timer when a connection opens and each time a response ends; the
timer closes the connection unless a complete request (its headers) reached the app before it
fires. A request being served, a response being streamed and a body being read are not limited
by it.

Imports uvicorn and the stdlib only.
"""

from __future__ import annotations

import asyncio
import math
import typing
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol


class HeaderDeadline(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    header_timeout: float = 10.0  # set per server by ``uvicorn_config`` (a subclass each)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        inner: ASGIApp = getattr(self, "app")  # noqa: B009  (uvicorn's protocol classes type it; the alias does not)

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            self._disarm()  # a whole request's headers arrived
            await inner(scope, receive, send)

        setattr(self, "app", app)  # noqa: B010

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        self._arm()  # before super(): a pipelined request it starts disarms it again
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def uvicorn_config(app: ASGIApp, host: str, port: int, log_level: str, *, header_timeout: float,
                   keep_alive_timeout: float, graceful_timeout: float) -> uvicorn.Config:
    """The uvicorn.Config of a lockgate server: no access log, the app's lifespan, the two deadlines."""
    protocol = type("HeaderDeadlineProtocol", (HeaderDeadline,), {"header_timeout": header_timeout})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=False, lifespan="on",
                          http=protocol, timeout_keep_alive=typing.cast(int, keep_alive_timeout),  # a float works
                          timeout_graceful_shutdown=math.ceil(graceful_timeout))
