"""serve_http: legato's HTTP/1.1 server, an accept loop where one connection can only
ever break itself.

Each accepted connection runs its own ``HTTP1Connection`` (h11 parses, our code
drives the ASGI app), in a handler that logs whatever goes wrong and closes
that connection alone: no client input and no app failure on one connection
can cancel another or stop the server.

Why not an ASGI server from PyPI (evaluated for issue 30): hypercorn's public
``serve`` (0.18) and anycorn (0.20) run every connection in one task group and
catch only stream and OS errors there, so an h11 ``LocalProtocolError`` from
one crafted packet ends the whole server; neither caps connections, and
neither can turn off cleartext HTTP/2 (whose code kept a connection for ever
when its client hung up before the answer). Reaching those needs their
private classes. uvicorn runs on asyncio, and Starlette middleware sits behind
the server and sees none of this. h11 is the part they share, and we use it
directly.

What the server adds to the connections: at most ``max_connections`` at once
(one more gets ``503`` with ``Retry-After`` and is closed, so idle clients
cannot exhaust file descriptors), and the shutdown: stop accepting, close the
connections that wait for a request, give the others ``graceful_timeout``
seconds.

Imports trio and h11 (through ``http1_connection``); never torch.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from .http1_connection import (
    ASGIApp,
    ConnectionLimits,
    HTTP1Connection,
    Shutdown,
    error_answer,
)


@dataclass(frozen=True)
class HTTPServerConfig:
    """Where ``serve_http`` listens and what a connection may cost."""

    host: str = "127.0.0.1"
    port: int = 8000
    """0 picks a free port."""
    limits: ConnectionLimits = ConnectionLimits()
    max_connections: int = 1024
    graceful_timeout: float = 2.0
    """Seconds busy connections get at shutdown before they are cancelled."""
    backlog: int = 128


SERVER_BUSY = error_answer(503, "too many connections", "server_busy", b"retry-after: 1\r\n")
"""The whole answer to a connection past ``max_connections`` (no app runs for it)."""


async def serve_http(
    app: ASGIApp,
    config: HTTPServerConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``config.host:config.port`` until ``shutdown_trigger()`` returns.

    Reports the bound address (``http://host:port``) through ``task_status``;
    raises ``OSError`` if it cannot bind. Never raises for anything a client
    sends or the app raises. Plain HTTP/1.x only (no TLS, no HTTP/2).
    """
    listener = await _listen(config)
    host, port = listener.socket.getsockname()[:2]
    bind = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    shutdown = Shutdown()
    open_connections = 0

    async def handle(stream: trio.SocketStream) -> None:
        nonlocal open_connections
        if open_connections >= config.max_connections:
            with trio.move_on_after(1.0):
                try:
                    await stream.send_all(SERVER_BUSY)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            await trio.aclose_forcefully(stream)
            return
        open_connections += 1
        try:
            await HTTP1Connection(app, stream, config.limits, shutdown).run()
        finally:
            open_connections -= 1

    async with trio.open_nursery() as connections:
        accepting = trio.CancelScope()

        async def accept(task_status: trio.TaskStatus[object]) -> None:
            with accepting:
                await trio.serve_listeners(
                    handle, [listener], handler_nursery=connections, task_status=task_status
                )

        await connections.start(accept)
        task_status.started([bind])
        try:
            await shutdown_trigger()
        finally:
            accepting.cancel()
            shutdown.begin()
            connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout


async def _listen(config: HTTPServerConfig) -> trio.SocketListener:
    """One listening TCP socket on ``host:port`` (an IPv6 one when the host has a ``:``)."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await sock.bind((config.host, config.port))
        sock.listen(config.backlog)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)
