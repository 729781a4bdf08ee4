"""uvicorn as both of lockgate's HTTP servers (``serve`` and ``gateway``) run it: with a deadline
for a request's headers and one for idle keep-alive connections.

Owns ``uvicorn_config``. uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``
seconds, but it sets no deadline on a new connection nor on one that sends a byte now and then:
a client that connects and never finishes its headers (or its body) holds a connection and a file
descriptor for ever, and thousands of them exhaust the server. ``HeaderDeadline`` (a subclass of
the HTTP protocol uvicorn would use) arms a timer when a connection opens and each time a response
ends, closing the connection unless a whole request's headers reached the app before it fires;
then a second one for the body, which ends when the app has read the body or starts its answer.
A response being streamed is not limited by either. Beyond ``max_connections`` a new connection is
closed at once and a request on an open one gets a 503 (uvicorn's ``limit_concurrency``), so held
connections cannot use up the file descriptors (the open-file limit is raised to its hard limit).

Imports uvicorn and the stdlib only.
"""

from __future__ import annotations

import asyncio
import math
import resource
import typing
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol


class HeaderDeadline(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    header_timeout: float = 10.0  # set per server by ``uvicorn_config`` (a subclass each)
    body_timeout: float = 60.0
    max_connections: int = 1 << 30

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        inner: ASGIApp = getattr(self, "app")  # noqa: B009  (uvicorn's protocol classes type it; the alias does not)

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            # a whole request's headers arrived: now its body has body_timeout to arrive, ending
            # when the app has read it all or starts answering (a route without a body never reads it)
            self._arm(self.body_timeout)

            async def receive_body() -> Message:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    self._disarm()
                return message

            async def send_answer(message: Message) -> None:
                if message["type"] == "http.response.start":
                    self._disarm()
                await send(message)

            await inner(scope, receive_body, send_answer)

        setattr(self, "app", app)  # noqa: B010

    def _arm(self, seconds: float | None = None) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout if seconds is None else seconds, self._expire)

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
        if len(self.connections) > self.max_connections:  # already full: not even its headers are waited for
            transport.close()
            return
        self._arm()

    def on_response_complete(self) -> None:
        self._arm()  # before super(): a pipelined request it starts disarms it again
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def open_files_limit() -> int:
    """Raise this process's open-file limit to its hard limit (a server holds one descriptor per
    connection; the soft limit is often 1,024); returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return int(soft)


def uvicorn_config(app: ASGIApp, host: str, port: int, log_level: str, *, header_timeout: float,
                   keep_alive_timeout: float, graceful_timeout: float, body_timeout: float = 60.0,
                   max_connections: int = 0) -> uvicorn.Config:
    """The uvicorn.Config of a lockgate server: no access log, the app's lifespan, the deadlines,
    and at most ``max_connections`` connections or requests at once (0: half the open-file limit,
    raised first): beyond them a request is answered 503 at once and its connection closed, so
    connections held open cannot use up the descriptors every other client needs."""
    limit = max_connections or max(64, open_files_limit() // 2)
    protocol = type("HeaderDeadlineProtocol", (HeaderDeadline,),
                    {"header_timeout": header_timeout, "body_timeout": body_timeout, "max_connections": limit})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=False, lifespan="on",
                          http=protocol, timeout_keep_alive=typing.cast(int, keep_alive_timeout),  # a float works
                          timeout_graceful_shutdown=math.ceil(graceful_timeout), limit_concurrency=limit)
