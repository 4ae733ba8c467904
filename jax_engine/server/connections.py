"""Who may hold the server's connections, and for how long: uvicorn's h11 protocol with the server's own count.

A connection is *pending* until it sends a request with a valid API key (or, without `--api-key`, any complete
request's headers); then it is *established* until it closes:

    accept --> pending (at most max_pending; the oldest idle one is closed to make room)
                  |  /health, or a 401 (answered with Connection: close): stays pending
                  |  a request with a valid key
                  v
               established (at most max_established; past that the request gets 503 + Connection: close)

uvicorn's own cap (limit_concurrency) counts every connection alike, so a client without a key that reconnects
quickly, or sends its headers a byte at a time, could hold all of them and turn every keyed request and /health
away with 503. Here it can only hold pending slots, and a newcomer takes the oldest idle one: a client that
sends its headers at once (any real client) is never crowded out.

Each connection also has deadlines: its request headers within `header_timeout` seconds (slowloris), and, while
the server has output waiting for it, some of it read within `send_timeout` seconds (nginx's send_timeout). A
client that stops reading a stream is disconnected, which aborts its request and frees its KV blocks. On SIGTERM
the connections still open after the drain time are disconnected too (DrainingServer).
"""

import asyncio
import logging
import socket
import struct
from collections import OrderedDict
from dataclasses import dataclass

import h11
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from jax_engine.server.auth import APIKeys
from jax_engine.server.errors import send_error

logger = logging.getLogger(__name__)
# Output the kernel holds for a connection before the client has taken it. Unbounded, Linux grows a send buffer to
# 4 MiB (tcp_wmem), all of it queued for a client that reads nothing; with TCP_NOTSENT_LOWAT the kernel takes more
# only while less than this is waiting to be sent, so a stalled reader shows as backpressure within ~200 KiB.
# Throughput does not suffer: bytes in flight do not count.
UNSENT_KERNEL_BYTES = 128 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    """The protocol's settings (docs/serving.md#security).

    Args:
        max_established: connections that sent a request with a valid key (with no keys: any request).
        max_pending: connections that have not (yet); past this many the oldest idle one is closed.
        header_timeout: seconds a client has to send a request's headers.
        send_timeout: seconds a client may leave the server's output unread (no byte taken) before it is
            disconnected.
    """

    max_established: int = 1024
    max_pending: int = 64
    header_timeout: float = 10.0
    send_timeout: float = 30.0


class ConnectionPool:
    """The server's connections by kind; each connection's protocol registers and leaves it."""

    def __init__(self, limits: ConnectionLimits, api_keys: APIKeys) -> None:
        self.limits, self.api_keys = limits, api_keys
        self.pending: OrderedDict["LimitedH11Protocol", None] = OrderedDict()  # oldest first
        self.established: set["LimitedH11Protocol"] = set()

    def admit(self, connection: "LimitedH11Protocol") -> bool:
        """Count a new connection as pending, closing the oldest idle pending one if there is no room; False
        (not counted) when every pending connection is busy answering a request."""
        if len(self.pending) >= self.limits.max_pending:
            idle = next((c for c in self.pending if c.idle), None)
            if idle is None:
                return False
            idle.close_for_newcomer()
            self.pending.pop(idle, None)
        self.pending[connection] = None
        return True

    def promote(self, connection: "LimitedH11Protocol", scope: Scope) -> bool:
        """Before a request runs: establish its connection if it carries a valid key; False if the request
        must get 503 instead (no room). Requests without a valid key run on a pending connection (/health
        answers, anything else gets 401 and the connection closes)."""
        if connection in self.established or not self.api_keys.admits(scope):
            return True
        if len(self.established) >= self.limits.max_established:
            return False
        self.pending.pop(connection, None)
        self.established.add(connection)
        return True

    def leave(self, connection: "LimitedH11Protocol") -> None:
        self.pending.pop(connection, None)
        self.established.discard(connection)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol counted in a ConnectionPool, with header and send deadlines.

    Give uvicorn a subclass bound to one pool (`protocol_class`), and limit_concurrency=None.
    """

    pool: ConnectionPool
    _header_deadline: asyncio.TimerHandle | None = None
    _send_deadline: asyncio.TimerHandle | None = None
    _counted = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if hasattr(socket, "TCP_NOTSENT_LOWAT") and sock is not None and sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, UNSENT_KERNEL_BYTES)
        self._counted = self.pool.admit(self)
        self.app = self._gate(self.app)  # uvicorn runs self.app for each request of this connection
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.leave(self)
        self._disarm_header_deadline()
        self._disarm_send_deadline()
        super().connection_lost(exc)

    @property
    def idle(self) -> bool:
        """No request running: waiting for one (slowly, maybe), or between two."""
        return self.cycle is None or self.cycle.response_complete

    def close_for_newcomer(self) -> None:
        logger.info("closed an idle connection without an API key to make room for a new one")
        self.transport.close()

    def _gate(self, app: ASGIApp) -> ASGIApp:
        async def gated(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and not (self._counted and self.pool.promote(self, scope)):
                await send_error(send, 503, "too many open connections; retry later", code="too_many_connections",
                                 headers={"connection": "close"})
                return
            await app(scope, receive, send)

        return gated

    # ------------------------------------------------------------------------ header deadline
    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # still reading a request's headers (or a new one's)
            self._arm_header_deadline()
        else:
            self._disarm_header_deadline()

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.pool.limits.header_timeout, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.info("closed a connection that sent no complete request headers in %.0f s",
                        self.pool.limits.header_timeout)
            self.transport.close()

    # -------------------------------------------------------------------------- send deadline
    # NOTE: asyncio pauses writing when the transport holds more than its high-water mark of unsent output, and
    # resumes below the low-water mark. While paused, the deadline is re-armed whenever the client took some
    # bytes, so a slow reader is served and only one that reads nothing for send_timeout seconds is cut off.
    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm_send_deadline(self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_send_deadline()

    def _arm_send_deadline(self, unsent: int) -> None:
        self._disarm_send_deadline()
        self._send_deadline = self.loop.call_later(self.pool.limits.send_timeout, self._check_client_reads, unsent)

    def _disarm_send_deadline(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _check_client_reads(self, unsent_before: int) -> None:
        self._send_deadline = None
        unsent = self.transport.get_write_buffer_size()
        if unsent < unsent_before:
            self._arm_send_deadline(unsent)
        elif not self.transport.is_closing():
            logger.warning("disconnected a client that read none of its %d bytes of output in %.0f s", unsent,
                           self.pool.limits.send_timeout)
            self.reset()

    def reset(self) -> None:
        """Drop the connection and what it has not sent: its request sees the client leave (and is aborted).

        A plain close would leave the kernel trying to deliver the unsent output to a client that takes none,
        for minutes; a reset (SO_LINGER 0) frees it at once.
        """
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()


def protocol_class(limits: ConnectionLimits, api_keys: tuple[str, ...]) -> type[H11Protocol]:
    """The protocol class to give uvicorn's `http=` setting: one pool, shared by the server's connections."""
    pool = ConnectionPool(limits, APIKeys(api_keys))
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"pool": pool})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown ends: connections still open `drain_timeout` seconds after it
    began are reset, so their requests end as if their clients had left (aborted, no traceback).

    uvicorn's own timeout_graceful_shutdown cancels the request tasks instead, which logs each one as an ASGI
    exception; it stays on as a backstop, a few seconds later.
    """

    def __init__(self, config: uvicorn.Config, drain_timeout: float) -> None:
        config.timeout_graceful_shutdown = drain_timeout + 5
        super().__init__(config)
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets=None) -> None:
        cut = asyncio.get_running_loop().call_later(self.drain_timeout, self._disconnect_all)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    def _disconnect_all(self) -> None:
        connections = list(self.server_state.connections)
        if connections:
            logger.warning("shutting down: disconnecting %d connections still open after %.0f s", len(connections),
                           self.drain_timeout)
        for connection in connections:
            connection.reset()
