"""Bounds on what one client can make the server read: connections, time to send the headers and the body,
body size.

    client --connect---> [connections.LimitedH11Protocol]  a pending or established slot; slow headers cut off
           --headers---> [auth.APIKeyMiddleware]             401 + close without a valid key
           --body------> [BodySizeLimitMiddleware]           413 before a large body is read
                         [BodyTimeoutMiddleware]             408 + close when the body is not in on time
           --request---> routes (tokenization on a worker thread, see ServerState.off_loop)
"""

import asyncio

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


class BodyTimeoutMiddleware:
    """Answer 408 (and close the connection) to a request whose body has not all arrived `seconds` after the
    route started reading it (nginx's client_body_timeout, for the whole body): a client that sends its
    headers and then dribbles the body cannot hold a connection and a request for long."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app, self.seconds = app, seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline, complete = None, False

        async def timed_receive() -> Message:
            nonlocal deadline, complete
            if complete:  # after the body, receive() waits for a disconnect, which takes as long as it takes
                return await receive()
            loop = asyncio.get_running_loop()
            deadline = deadline or loop.time() + self.seconds
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:  # FastAPI passes an HTTPException raised while reading on as is
                raise HTTPException(408, f"the request body did not arrive within {self.seconds:g} s",
                                    headers={"connection": "close"}) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)
