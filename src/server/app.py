"""Wiring: the HTTP and WebSocket servers over one engine, graceful shutdown, ``legato serve``.

``open_server(engine, settings)`` binds both servers (ports 0 pick free
ones), yields a ``Server`` with the bound URLs, and on exit shuts down
gracefully. ``Server.shutdown`` is the one shutdown path: stop admitting
(new requests get 503 / an error frame, ``/health`` 503), let requests in
flight finish for up to ``shutdown_grace`` seconds, abort the rest, close
WebSocket connections (1001), stop both listeners.

``serve(model, engine_args, settings)`` is ``legato serve``: the engine and
the servers in one trio run, SIGINT / SIGTERM for a graceful shutdown (a
second signal skips the grace period), and the "listening on" line. With a
``RestartPolicy`` the engine runs under ``legato.supervise``: a dead engine is
replaced by a fresh one while both servers keep their ports and connections;
past the policy's limit ``serve`` raises ``RestartLimitExceeded``.

Imports trio and trio-websocket; never torch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import trio
from trio_websocket import Endpoint, WebSocketServer, serve_websocket

from ..engine import AsyncEngine, open_engine
from ..exception_groups import unwrap_single_error
from ..model_source import served_name
from ..protocol.client import EngineClient
from ..supervise import RestartPolicy, SupervisedEngine, open_supervised_engine
from .http import OpenAIApp
from .http1_connection import ConnectionLimits
from .http_server import HTTPServerConfig, serve_http
from .lora_routes import load_lora_modules
from .state import ServerSettings, ServingState
from .web_ui import WebUI
from .websocket import WebSocketEndpoint

logger = logging.getLogger("legato.server")


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Server:
    """Both front ends of one running server. Build it with ``open_server``."""

    def __init__(
        self,
        state: ServingState,
        endpoint: WebSocketEndpoint,
        http_port: int,
        ws_port: int,
        stop_http: trio.Event,
        ws_scope: trio.CancelScope,
    ) -> None:
        self.state = state
        self.endpoint = endpoint
        self.http_port = http_port
        self.ws_port = ws_port
        self._stop_http = stop_http
        self._ws_scope = ws_scope
        self._grace_scope: trio.CancelScope | None = None
        self._stopped = trio.Event()
        self._shutting_down = False

    @property
    def shutting_down(self) -> bool:
        """Whether ``shutdown`` has begun."""
        return self._shutting_down

    @property
    def http_url(self) -> str:
        return f"http://{_hostport(self.state.settings.host, self.http_port)}"

    @property
    def ws_url(self) -> str:
        return f"ws://{_hostport(self.state.settings.host, self.ws_port)}"

    async def shutdown(self, grace: float | None = None) -> None:
        """Drain (``grace`` seconds, default ``shutdown_grace``), then stop both servers.

        Idempotent: a second caller waits for the first to finish.
        """
        if self._shutting_down:
            await self._stopped.wait()
            return
        self._shutting_down = True
        grace = self.state.settings.shutdown_grace if grace is None else grace
        with trio.CancelScope() as self._grace_scope:
            await self.state.drain(grace)
        if self._grace_scope.cancelled_caught:  # skip_grace(): drain again without waiting
            await self.state.drain(0.0)
        await self.endpoint.close_all()
        self._stop_http.set()
        self._ws_scope.cancel()
        self._stopped.set()

    def skip_grace(self) -> None:
        """End the grace period of a shutdown in progress now (a second SIGINT)."""
        if self._grace_scope is not None:
            self._grace_scope.cancel()

    async def wait_stopped(self) -> None:
        """Return once ``shutdown`` has finished."""
        await self._stopped.wait()


async def _generates(engine: EngineClient) -> bool:
    """Whether ``engine`` has a model to run (a ``RenderOnlyClient`` says ``("render",)``)."""
    try:
        return await engine.get_supported_tasks() != ("render",)
    except NotImplementedError:  # a client that does not say: assume it generates
        return True


@asynccontextmanager
async def open_server(
    engine: EngineClient | SupervisedEngine,
    settings: ServerSettings,
    *,
    model_name: str | None = None,
) -> AsyncIterator[Server]:
    """Serve ``engine`` over HTTP and WebSocket until the block exits, then shut down gracefully.

    ``engine`` may be a ``RenderOnlyClient``: the same app then renders and tokenizes,
    and every generation answers 501 ``render_only``. It may be a ``SupervisedEngine``:
    requests then always go to its current engine, and while it restarts they (and ``/health``) get 503
    ``engine_restarting``. ``model_name`` is the served model name (default:
    ``settings.served_model_name``, else the engine's). If the block raises or
    is cancelled, the servers stop without waiting for requests in flight.
    """
    current = engine.engine if isinstance(engine, SupervisedEngine) else engine
    name = settings.served_model_name or model_name or current.model_info().name
    state = ServingState(engine, settings, model_name=name)
    state.generates = await _generates(current)
    for warning in settings.security_warnings():
        logger.warning("security: %s", warning)
    await load_lora_modules(state)
    endpoint = WebSocketEndpoint(state)
    web_ui = WebUI(state) if settings.web_ui else None
    config = HTTPServerConfig(
        host=settings.host,
        port=settings.port,
        # header_timeout is also how long a keep-alive connection may idle
        limits=ConnectionLimits(
            header_timeout=settings.header_timeout, send_timeout=settings.send_timeout
        ),
        max_connections=settings.max_connections,
    )
    stop_http = trio.Event()
    with unwrap_single_error():
        async with trio.open_nursery() as nursery:
            state.responses.nursery = nursery  # background responses run here, tracked
            http = functools.partial(
                serve_http, OpenAIApp(state, web_ui), config, shutdown_trigger=stop_http.wait
            )
            binds: list[str] = await nursery.start(http)
            http_port = int(binds[0].rsplit(":", 1)[1])
            state.site_guard = dataclasses.replace(state.site_guard, http_port=http_port)
            ws_scope = trio.CancelScope()

            async def run_ws(task_status: trio.TaskStatus[WebSocketServer]) -> None:
                with ws_scope:
                    await serve_websocket(
                        endpoint.handle,
                        settings.host,
                        settings.ws_port,
                        ssl_context=None,
                        max_message_size=endpoint.hard_limit,
                        connect_timeout=settings.header_timeout,
                        task_status=task_status,
                    )

            ws_server: WebSocketServer = await nursery.start(run_ws)
            ws_port = next(e.port for e in ws_server.listeners if isinstance(e, Endpoint))
            if web_ui is not None:
                web_ui.ws_port = ws_port
            server = Server(state, endpoint, http_port, ws_port, stop_http, ws_scope)
            try:
                yield server
            except BaseException:
                state.draining = True
                stop_http.set()
                nursery.cancel_scope.cancel()
                raise
            await server.shutdown()


async def serve(
    model: str | None,
    engine_args: dict[str, Any],
    settings: ServerSettings,
    *,
    restart: RestartPolicy | None = None,
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``legato serve``: run the engine and both servers until SIGINT / SIGTERM.

    The first signal starts a graceful shutdown; a second one ends the grace
    period at once. Returns normally after a shutdown (exit status 0).
    A signal that arrives while the engine is still starting ends start-up.

    Without ``restart`` a dead engine stays dead (503 until the process is
    restarted from outside). With it, the engine is restarted in place
    (``open_supervised_engine``); past the limit the servers stop at once and
    ``RestartLimitExceeded`` is raised.
    """
    with unwrap_single_error():
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                started: list[Server] = []

                async def on_signals() -> None:
                    async for signum in signals:
                        name = signal.Signals(signum).name
                        if not started:
                            logger.info("%s during start-up: exiting", name)
                            nursery.cancel_scope.cancel()
                            return
                        server = started[0]
                        if server.shutting_down:
                            logger.info("%s again: aborting requests still running", name)
                            server.skip_grace()
                        else:
                            logger.info(
                                "%s: shutting down (grace period %.1f s)",
                                name,
                                settings.shutdown_grace,
                            )
                            nursery.start_soon(server.shutdown)

                nursery.start_soon(on_signals)
                name = settings.served_model_name or served_name(model)
                engines: AbstractAsyncContextManager[AsyncEngine | SupervisedEngine]
                if restart is None:
                    engines = open_engine(model, **engine_args)
                else:
                    engines = open_supervised_engine(
                        model,
                        max_restarts=restart.max_restarts,
                        window=restart.window,
                        **engine_args,
                    )
                async with engines as engine:
                    async with open_server(engine, settings, model_name=name) as server:
                        started.append(server)
                        print(
                            f"legato: serving {name!r}: listening on {server.http_url} and {server.ws_url}",
                            flush=True,
                        )
                        if settings.web_ui:
                            print(f"legato: chat page at {server.http_url}/", flush=True)
                        task_status.started(server)
                        await server.wait_stopped()
                nursery.cancel_scope.cancel()

    logger.info("server stopped")
