"""Fixtures for the server tests: a real engine on the toy model, real servers on loopback."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from legato.engine import AsyncEngine, open_engine
from legato.server import Server, ServerSettings, open_server

MODEL = "legato-toy"
ENGINE_ARGS: dict[str, Any] = dict(max_model_len=512, num_kv_blocks=600, disable_log_stats=True)
SETTINGS: dict[str, Any] = dict(port=0, ws_port=0, shutdown_grace=1.0)


@asynccontextmanager
async def serving(engine: AsyncEngine, **settings: Any) -> AsyncIterator[Server]:
    """A server on free loopback ports over ``engine``; ``settings`` override the test defaults."""
    async with open_server(
        engine, ServerSettings(**{**SETTINGS, **settings}), model_name=MODEL
    ) as server:
        yield server


@pytest.fixture
async def engine(toy_model_dir: Path) -> AsyncIterator[AsyncEngine]:
    """An in-process engine on the toy model."""
    async with open_engine(str(toy_model_dir), executor="inproc", **ENGINE_ARGS) as eng:
        yield eng


@pytest.fixture
async def server(engine: AsyncEngine) -> AsyncIterator[Server]:
    """A server with the default test settings."""
    async with serving(engine) as srv:
        yield srv


@pytest.fixture
async def client(server: Server) -> AsyncIterator[httpx.AsyncClient]:
    """httpx against ``server``."""
    async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as c:
        yield c


def metric(text: str, name: str, default: float | None = None) -> float:
    """The value of the (single-series) metric ``name`` in Prometheus text.

    A labelled gauge has no series until it is first set: ``default`` is its value then.
    """
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    if match is None and default is not None:
        return default
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


async def wait_until(condition: Callable[[], Awaitable[bool]], seconds: float = 10.0) -> None:
    """Poll ``condition`` (an HTTP probe: nothing to wait on) until it holds; fail after ``seconds``."""
    with trio.fail_after(seconds):
        while True:
            if await condition():
                return
            await trio.sleep(0.02)


async def kv_blocks_used(client: httpx.AsyncClient) -> float:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return metric(response.text, "legato:kv_cache_blocks_used", default=0.0)


async def wait_kv_used(client: httpx.AsyncClient, seconds: float = 10.0) -> None:
    """Wait until /metrics reports KV blocks in use (a request is running)."""

    async def busy() -> bool:
        return await kv_blocks_used(client) > 0

    await wait_until(busy, seconds)


async def read_until_listening(process: trio.Process, seconds: float) -> bytes:
    """What a ``legato serve`` process printed up to its "listening on" line; fails if the
    process exits first or takes longer than ``seconds``."""
    assert process.stdout is not None
    output = b""
    with trio.fail_after(seconds):
        while b"listening on" not in output:
            chunk = await process.stdout.receive_some()
            assert chunk, f"exited early: {output.decode(errors='replace')}"
            output += chunk
    return output
