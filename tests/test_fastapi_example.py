"""examples/fastapi_app.py under uvicorn on loopback, driven by httpx: SSE streaming,
a client disconnect aborting its request, bad input, and a dead engine (503).

    python -m pytest tests/test_fastapi_example.py     # about 15 s
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

import legato.aio as aio
from legato import SamplingParams

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fastapi_app.py"
ENGINE_ARGS: dict[str, Any] = dict(
    executor="inproc", max_model_len=512, num_kv_blocks=600, disable_log_stats=True
)


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("fastapi_app", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """uvicorn serving ``app`` on a loopback socket bound (and listening) before it starts,
    so clients may connect at once: they wait in the backlog through the lifespan."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)
        sock.close()


async def sse_events(response: httpx.Response) -> AsyncIterator[Any]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


def run(body: Callable[[Any, httpx.AsyncClient], Awaitable[None]], toy_model_dir: Any) -> None:
    app = load_example().create_app(str(toy_model_dir), **ENGINE_ARGS)

    async def main() -> None:
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
            assert (await client.get("/health")).json() == {"status": "ok"}  # lifespan done
            await body(app, client)

    asyncio.run(main())


def test_streams_sse_and_a_disconnect_aborts_the_request(toy_model_dir: Any) -> None:
    async def body(app: Any, client: httpx.AsyncClient) -> None:
        engine: aio.AioEngine = app.state.engine
        # Streamed tokens are the engine's own greedy tokens.
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        async for out in engine.generate("Hello there", params, "direct"):
            expected = out.outputs[0]
        request = {"prompt": "Hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        async with client.stream("POST", "/generate", json=request) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [event async for event in sse_events(response)]
        assert events[-1] == "[DONE]" and events[-2]["finish_reason"] == "length"
        assert [t for e in events[:-1] for t in e["token_ids"]] == expected.token_ids
        assert "".join(e["text"] for e in events[:-1]) == expected.text

        # Bad input: the field is named, nothing is submitted.
        bad = await client.post("/generate", json={"prompt": "x", "temperature": -1})
        assert bad.status_code == 422 and "temperature" in bad.text

        # A client that leaves after the first event: its request ends as aborted,
        # long before its 400 tokens.
        registry = engine.engine.stats.prometheus.registry
        labels = {"model_name": engine.model_name, "finished_reason": "abort"}
        assert not registry.get_sample_value("legato:request_success_total", labels)
        request = {"prompt": "a long one", "max_tokens": 400, "ignore_eos": True}
        async with client.stream("POST", "/generate", json=request) as response:
            async for event in sse_events(response):
                assert event["token_ids"]
                break  # leaving the block closes the connection
        await engine.wait_until_idle()
        assert registry.get_sample_value("legato:request_success_total", labels) == 1
        generated = registry.get_sample_value(
            "legato:request_generation_tokens_sum", {"model_name": engine.model_name}
        )
        assert generated is not None and generated < 12 + 400

    run(body, toy_model_dir)


def test_a_dead_engine_answers_503(toy_model_dir: Any) -> None:
    async def body(app: Any, client: httpx.AsyncClient) -> None:
        engine: aio.AioEngine = app.state.engine
        request = {"prompt": "doomed", "max_tokens": 400, "ignore_eos": True}
        async with client.stream("POST", "/generate", json=request) as response:
            assert response.status_code == 200
            events = sse_events(response)
            assert (await anext(events))["token_ids"]

            async def kill(trio_engine: Any) -> None:
                trio_engine.inject_fault("scheduler", RuntimeError("injected"))
                await trio_engine.supervisor.dead.wait()

            await engine.call_in_engine(kill)
            rest = [event async for event in events]
        assert "engine dead" in rest[-1]["error"]  # the open stream ends with the error
        health = await client.get("/health")
        assert health.status_code == 503 and "engine dead" in health.json()["error"]
        late = await client.post("/generate", json={"prompt": "late"})
        assert late.status_code == 503

    run(body, toy_model_dir)
