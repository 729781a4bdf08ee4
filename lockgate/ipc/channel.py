"""Typed ZeroMQ channels: one PUSH -> PULL pipe per direction, msgpack-encoded msgspec structs.

Owns socket setup and (de)serialisation; knows nothing of what the messages mean. A
``Receiver`` binds (it owns the endpoint); ``Sender``s connect, so several processes may
feed one receiver (the scheduler hears both the API and the detokenizer). Receivers block
on the socket when idle (no polling sleeps); ``drain`` takes everything already queued so a
loop handles a burst in one pass.

``AsyncReceiver`` / ``AsyncSender`` are the asyncio versions used by the API process.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")

_ENCODER = msgspec.msgpack.Encoder()


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)  # never hang on exit with undelivered messages
    return s


class Sender:
    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = _socket(ctx, zmq.PUSH)
        self.sock.connect(endpoint)

    def send(self, msg: Any) -> None:
        self.sock.send(_ENCODER.encode(msg), copy=False)

    def try_send(self, msg: Any) -> bool:
        """Send unless the peer's queue is full (it is not reading); False then, nothing sent."""
        try:
            self.sock.send(_ENCODER.encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self.sock.close(0)


class Receiver(Generic[T]):
    def __init__(self, ctx: zmq.Context, endpoint: str, msg_type: Any) -> None:
        self.sock = _socket(ctx, zmq.PULL)
        self.sock.bind(endpoint)
        self.decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(msg_type)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Block until a message arrives (or ``timeout_ms`` passes: None)."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return self.decoder.decode(self.sock.recv(copy=False).buffer)

    def drain(self) -> list[T]:
        """Every message already queued, without blocking."""
        out: list[T] = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            out.append(self.decoder.decode(frame.buffer))

    def close(self) -> None:
        self.sock.close(0)


class AsyncSender:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = _socket(ctx, zmq.PUSH)
        self.sock.connect(endpoint)

    def send_nowait(self, msg: Any) -> None:
        """PUSH to a live local peer never blocks in practice; raise zmq.Again if it would."""
        self.sock.send(_ENCODER.encode(msg), zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self.sock.close(0)


class AsyncReceiver(Generic[T]):
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, msg_type: Any) -> None:
        self.sock = _socket(ctx, zmq.PULL)
        self.sock.bind(endpoint)
        self.decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(msg_type)

    async def recv(self) -> T:
        frame: zmq.Frame = await self.sock.recv(copy=False)  # type: ignore[misc]
        return self.decoder.decode(frame.buffer)

    def close(self) -> None:
        self.sock.close(0)
