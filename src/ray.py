"""legato.ray: a Ray Serve deployment that serves the OpenAI routes from one legato
engine per replica (the ``ray`` extra: ``pip install 'legato[ray]'``).

    from ray import serve
    from legato.ray import build_app

    serve.run(build_app("path/to/model", num_replicas=2, max_model_len=4096))
    # or autoscaling: build_app(model, autoscaling_config={"min_replicas": 1, "max_replicas": 4})

Each replica runs ``legato.aio.open_engine`` (the trio engine in a thread of its
own) and, in that engine's thread, legato's own HTTP server (``open_server``)
on a loopback port; the replica's ingress forwards each request to it, bodies
streamed both ways. So the routes, validation, SSE streaming and error codes are
exactly those of ``legato serve`` (``/v1/completions``, ``/v1/chat/completions``,
``/v1/embeddings``, ``/v1/models``, ``/health``, ``/metrics`` ...). A client that
disconnects closes the forwarded request, which aborts it in the engine. A
replica whose engine dies answers 503 from ``/health`` (Ray Serve's health check
calls ``check_health``, which raises, so Ray replaces the replica).

Imports ray, httpx and starlette (the extra); never torch.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import httpx
import trio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ray import serve

from . import aio
from .engine import AsyncEngine
from .server import ServerSettings, open_server

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones httpx sets itself: not forwarded.
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host"}
    | {"content-length", "proxy-authenticate", "proxy-authorization"}
)


class LegatoServer:
    """The replica: one engine and legato's HTTP server over it on loopback. Ray Serve
    builds it with the deployment's arguments; ``__call__`` is its ingress."""

    def __init__(self, model: str | None, engine_args: dict[str, Any]) -> None:
        self._model = model
        self._engine_args = engine_args
        self._started = asyncio.Event()
        self._failed: BaseException | None = None
        self._base_url = ""
        self._engine: aio.AioEngine | None = None
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        self._task: asyncio.Task[None] | None = None  # started on the replica's event loop

    async def _run(self) -> None:
        """Hold the engine and its server for the replica's life."""
        try:
            async with aio.open_engine(self._model, **self._engine_args) as engine:
                self._engine = engine
                ports: asyncio.Future[int] = asyncio.get_running_loop().create_future()
                loop = asyncio.get_running_loop()

                async def serve_http(trio_engine: AsyncEngine) -> None:
                    settings = ServerSettings(host="127.0.0.1", port=0, ws_port=0, web_ui=False)
                    async with open_server(trio_engine, settings) as server:
                        loop.call_soon_threadsafe(_set_port, ports, server.http_port)
                        await trio.sleep_forever()

                serving = asyncio.ensure_future(engine.call_in_engine(serve_http))
                serving.add_done_callback(lambda _: ports.cancel())  # no-op once the port came
                try:
                    port = await ports
                except asyncio.CancelledError:
                    if serving.done():  # the server failed to start: its error
                        serving.result()
                    raise
                self._base_url = f"http://127.0.0.1:{port}"
                self._started.set()
                await serving
        except BaseException as exc:
            self._failed = exc
            self._started.set()
            raise

    async def _ready(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        await self._started.wait()
        if self._failed is not None:
            raise RuntimeError("the legato engine failed to start") from self._failed

    async def check_health(self) -> None:
        """Ray Serve's health check: raise if the engine is dead (Ray then replaces the
        replica)."""
        await self._ready()
        assert self._engine is not None
        await self._engine.check_health()

    async def __call__(self, request: Request) -> Response:
        """Forward ``request`` to this replica's legato server; stream the answer back."""
        await self._ready()
        url = httpx.URL(self._base_url + request.url.path, query=request.url.query.encode())
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS]
        upstream = self._client.build_request(
            request.method, url, headers=headers, content=await request.body()
        )
        response = await self._client.send(upstream, stream=True)
        forwarded = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
        forwarded["x-legato-replica"] = str(os.getpid())  # which replica answered

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:  # also when the client went away: closes the upstream request (abort)
                await response.aclose()

        return StreamingResponse(body(), status_code=response.status_code, headers=forwarded)


def _set_port(future: asyncio.Future[int], port: int) -> None:
    if not future.done():
        future.set_result(port)


def build_app(
    model: str | None = None,
    *,
    num_replicas: int | str | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    ray_actor_options: dict[str, Any] | None = None,
    name: str = "legato",
    **engine_args: Any,
) -> Any:
    """A Ray Serve application: ``LegatoServer`` with one engine per replica.

    ``num_replicas``, ``autoscaling_config`` and ``ray_actor_options`` go to
    ``serve.deployment`` unchanged (None: Ray's default); ``engine_args`` to
    ``legato.aio.open_engine`` in every replica. Pass the result to ``serve.run``.
    """
    options: dict[str, Any] = {"name": name}
    if num_replicas is not None:
        options["num_replicas"] = num_replicas
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    if ray_actor_options is not None:
        options["ray_actor_options"] = ray_actor_options
    return serve.deployment(**options)(LegatoServer).bind(model, engine_args)
