"""Bounds on what one client can make the server read: body size, and time to send the headers.

    client --headers--> [header deadline: H11ProtocolWithHeaderTimeout]   slow or silent clients are cut off
           --body-----> [BodySizeLimitMiddleware]                         413 before a large body is read
           --request--> routes (tokenization on a worker thread, see ServerState.off_loop)
"""

import h11
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from jax_engine.server.errors import send_error


class BodySizeLimitMiddleware:
    """Answer 413 to a body over `max_bytes`: at once if its Content-Length says so, else as soon as more
    than that has arrived (chunked bodies declare no length)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> str:
        return f"the request body is larger than the server's limit of {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(send, 413, self._too_large(), code="body_too_large", headers={"connection": "close"})
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # FastAPI passes an HTTPException raised while reading on as is
                raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, counted_receive, send)


class H11ProtocolWithHeaderTimeout(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers.

    uvicorn closes idle keep-alive connections, but not one that sends its headers a byte at a time, or
    nothing at all after connecting (slowloris): each would hold a connection, and a connection cap would
    then turn everyone else away. Here a connection waiting for headers is closed after `header_timeout`
    seconds. Subclass it with the timeout set (see `with_header_timeout`).
    """

    header_timeout: float = 10.0
    _header_deadline = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # still reading a request's headers (or a new one's)
            self._arm_header_deadline()
        else:
            self._disarm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closed a connection that sent no complete request headers in %.0f s",
                             self.header_timeout)
            self.transport.close()


def with_header_timeout(seconds: float) -> type[H11Protocol]:
    """The protocol class to give uvicorn's `http=` setting."""
    return type("H11ProtocolWithHeaderTimeout", (H11ProtocolWithHeaderTimeout,), {"header_timeout": seconds})
