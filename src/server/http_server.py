"""serve_http: hypercorn's HTTP protocol code under an accept loop where one connection
can only ever break itself.

``hypercorn.trio.serve`` runs every connection's task in one nursery, so an
exception that hypercorn's protocol layer lets escape from one connection
(h11's ``LocalProtocolError`` on a crafted packet, a WebSocket upgrade
followed by junk) cancels every other connection and ends the whole server:
a one-packet denial of service. Here each connection runs in a handler of our
own that logs such an error and closes that connection alone. Clients get
``keep_alive_timeout`` seconds to send a request's headers (hypercorn's idle
timer runs from the moment a connection is accepted until its first request
starts), so slow-header clients cannot pile up.

The shutdown follows hypercorn's: stop accepting, tell idle keep-alive
connections to close, give the others ``graceful_timeout`` seconds.

Each connection runs ``_HTTP1Server``: hypercorn's ``TCPServer.run`` for a
plain socket, with two changes.

- HTTP/1.x only. Hypercorn switches a connection to HTTP/2 on an ``Upgrade:
  h2c`` request (answering ``101``) or on the preface ``PRI * HTTP/2.0``, and
  its HTTP/2 code never ends a connection whose client hangs up before the
  answer is sent (the answer waits for a sender task that the hang-up already
  ended, and the idle timer stays off): one packet held a connection for
  ever. Hypercorn has no setting to turn cleartext HTTP/2 off, so our
  protocol's HTTP/2 check is a no-op: such a request is served as the
  HTTP/1.x request it also is, the upgrade ignored (as RFC 9110 allows, and
  as uvicorn, vLLM's server, does).
- A client that hangs up is let go once answered: hypercorn keeps the
  connection until its keep-alive timer runs out, even after the client's EOF.

Uses hypercorn's ``TCPServer``, ``ProtocolWrapper``, ``H11Protocol``,
``TaskGroup`` and ``WorkerContext`` (not part of its documented API: pinned to
0.17 - 0.18 in pyproject.toml); only our accept loop uses the subclasses,
hypercorn's own classes are left as they are. Imports trio and hypercorn;
never torch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import trio
from hypercorn.config import Config
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState
from hypercorn.utils import parse_socket_addr, repr_socket_addr

from .asgi import HTTPError, dumps

logger = logging.getLogger("legato.server")


async def serve_http(
    app: AppWrapper,
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]],
    max_connections: int = 1024,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``config.bind`` until ``shutdown_trigger()`` returns.

    At most ``max_connections`` connections are served at once; one more is
    answered ``503`` with ``Retry-After`` and closed (file descriptors are never
    exhausted by idle clients).

    Reports the bound addresses (``http://host:port``) through
    ``task_status``. Never raises for anything a client sends. Plain HTTP
    only (no TLS, no QUIC).
    """
    context = WorkerContext(None)
    sockets = config.create_sockets()
    listeners = []
    binds = []
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
    serve_one = functools.partial(_serve_connection, app, config, context)
    open_connections = 0

    async def handle(stream: trio.SocketStream) -> None:
        nonlocal open_connections
        if open_connections >= max_connections:
            with trio.move_on_after(1.0):
                await stream.send_all(SERVER_BUSY)
            await _abort(stream)
            return
        open_connections += 1
        try:
            await serve_one(stream)
        finally:
            open_connections -= 1

    async with trio.open_nursery() as connections:
        accepting = trio.CancelScope()

        async def accept(task_status: trio.TaskStatus[object]) -> None:
            with accepting:
                await trio.serve_listeners(
                    handle, listeners, handler_nursery=connections, task_status=task_status
                )

        await connections.start(accept)
        task_status.started(binds)
        try:
            await shutdown_trigger()
        finally:
            accepting.cancel()
            await context.terminated.set()  # idle keep-alive connections close now
            connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout


def _server_busy() -> bytes:
    """The whole answer to a connection past ``max_connections``: OpenAI's error body,
    written once (no app runs for it)."""
    body = dumps(HTTPError(503, "too many connections", code="server_busy").body())
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\n"
        f"Content-Type: application/json\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


SERVER_BUSY = _server_busy()


async def _serve_connection(
    app: AppWrapper, config: Config, context: WorkerContext, stream: trio.SocketStream
) -> None:
    """One connection, by hypercorn's protocol code; whatever it raises ends this one only."""
    try:
        await _HTTP1Server(app, config, context, stream).run()
    except Exception:
        logger.warning("HTTP connection closed after a protocol error", exc_info=True)
        await _abort(stream)


async def _abort(stream: trio.SocketStream) -> None:
    with trio.CancelScope(shield=True):
        await trio.aclose_forcefully(stream)


class _HTTP1Protocol(H11Protocol):
    """hypercorn's HTTP/1.x protocol, never switching to HTTP/2: a request with
    ``Upgrade: h2c`` or the ``PRI * HTTP/2.0`` preface goes to the app like any other
    (h11 then takes the upgrade as declined when the answer is not a ``101``)."""

    async def _check_protocol(self, event: object) -> None:  # an h11.Request
        return None


class _HTTP1Only(ProtocolWrapper):
    """The protocol wrapper ``TCPServer`` drives, always holding an ``_HTTP1Protocol``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # a plain connection: an H11Protocol, replaced here
        self.protocol = _HTTP1Protocol(
            self.app,
            self.config,
            self.context,
            self.task_group,
            self.state,
            self.ssl,
            self.client,
            self.server,
            self.send,
        )


class _HTTP1Server(TCPServer):
    """hypercorn's ``TCPServer`` for one plain (no TLS) connection, speaking HTTP/1.x only."""

    def __init__(
        self, app: AppWrapper, config: Config, context: WorkerContext, stream: trio.SocketStream
    ) -> None:
        # TCPServer takes a plain socket stream too (it only does TLS when it has one).
        tls_or_plain = cast("trio.SSLStream[trio.SocketStream]", stream)
        super().__init__(app, config, context, ConnectionState({}), tls_or_plain)
        self._socket = stream.socket

    async def run(self) -> None:
        """``TCPServer.run`` less the TLS handshake, with ``_HTTP1Only`` as the protocol.

        Returns when the connection is closed (by the client once answered, the idle
        or keep-alive timer, or the server's shutdown); lets escape what hypercorn's
        protocol code raises.
        """
        try:
            client = parse_socket_addr(self._socket.family, self._socket.getpeername())
            server = parse_socket_addr(self._socket.family, self._socket.getsockname())
            async with TaskGroup() as task_group:
                self._task_group = task_group
                self.protocol = _HTTP1Only(
                    self.app,
                    self.config,
                    self.context,
                    task_group,
                    ConnectionState(self.state),
                    False,
                    client,
                    server,
                    self.protocol_send,
                )
                await self.protocol.initiate()
                await self.idle_task.restart(task_group, self._idle_timeout)
                await self._read_data()
                # The client hung up (or the stream broke): no request can follow, so
                # nothing waits for the keep-alive timer; a request in flight still ends.
                await self.idle_task.stop()
        except OSError:
            pass
        finally:
            await self._close()
