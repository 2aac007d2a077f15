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

Uses hypercorn's ``TCPServer`` and ``WorkerContext`` (not part of its
documented API: pinned to 0.17 - 0.18 in pyproject.toml). Imports trio and
hypercorn; never torch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import cast

import trio
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState
from hypercorn.utils import repr_socket_addr

logger = logging.getLogger("legato.server")


async def serve_http(
    app: AppWrapper,
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``config.bind`` until ``shutdown_trigger()`` returns.

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
    handle = functools.partial(_serve_connection, app, config, context)
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


async def _serve_connection(
    app: AppWrapper, config: Config, context: WorkerContext, stream: trio.SocketStream
) -> None:
    """One connection, by hypercorn's protocol code; whatever it raises ends this one only."""
    try:
        # TCPServer takes a plain socket stream too (it only does TLS when it has one).
        tls_or_plain = cast("trio.SSLStream[trio.SocketStream]", stream)
        await TCPServer(app, config, context, ConnectionState({}), tls_or_plain)
    except Exception:
        logger.warning("HTTP connection closed after a protocol error", exc_info=True)
        await _abort(stream)


async def _abort(stream: trio.SocketStream) -> None:
    with trio.CancelScope(shield=True):
        await trio.aclose_forcefully(stream)
