"""A worker process killed under a serving server: /health 503, every stream ends with an error."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import httpx
import openai
import pytest
import trio

from legato.engine import open_engine

from .conftest import ENGINE_ARGS, MODEL, serving, wait_kv_used, wait_until
from .test_websocket import collect, connect, generate, receive, send


async def test_worker_death_fails_streams_and_health(toy_model_dir: Path) -> None:
    async with open_engine(str(toy_model_dir), executor="process", **ENGINE_ARGS) as engine:
        async with serving(engine) as server:
            async with (
                httpx.AsyncClient(base_url=server.http_url, timeout=30) as client,
                connect(server) as ws,
                trio.open_nursery() as nursery,
            ):
                assert (await client.get("/health")).status_code == 200
                long = {"prompt": "Hi", "max_tokens": 450, "ignore_eos": True}
                plain: list[httpx.Response] = []
                plain_done = trio.Event()

                async def post_plain() -> None:
                    plain.append(await client.post("/v1/completions", json=long))
                    plain_done.set()

                nursery.start_soon(post_plain)

                oai_failed = trio.Event()
                oai_started = trio.Event()

                async def openai_stream() -> None:
                    async with openai.AsyncOpenAI(
                        base_url=server.http_url + "/v1", api_key="x", max_retries=0
                    ) as oai:
                        chat = await oai.chat.completions.create(
                            model=MODEL,
                            messages=[{"role": "user", "content": "hi"}],
                            max_tokens=450,
                            stream=True,
                            extra_body={"ignore_eos": True},
                        )
                        async with chat:
                            with pytest.raises(openai.APIError, match="engine is dead"):
                                async for _ in chat:
                                    oai_started.set()
                    oai_failed.set()

                nursery.start_soon(openai_stream)
                await oai_started.wait()
                await send(ws, generate("w", max_tokens=450, ignore_eos=True))
                await receive(ws)
                async with client.stream(
                    "POST", "/v1/completions", json={**long, "stream": True}
                ) as sse:
                    lines = sse.aiter_lines()
                    await lines.__anext__()
                    await wait_kv_used(client)

                    engine.executor.kill()

                    with trio.fail_after(20):
                        rest = [line async for line in lines if line]
                assert rest[-1] == "data: [DONE]"
                error = json.loads(rest[-2][len("data: ") :])["error"]
                assert (
                    error["code"] == "engine_dead" and error["type"] == "service_unavailable_error"
                )

                with trio.fail_after(20):
                    await oai_failed.wait()
                frames = await collect(ws, {"w"})
                assert frames["w"][-1]["type"] == "error"
                assert frames["w"][-1]["code"] == "engine_dead"

                async def unhealthy() -> bool:
                    return (await client.get("/health")).status_code == 503

                await wait_until(unhealthy)
                assert not engine.is_running

                with trio.fail_after(20):
                    await plain_done.wait()
                assert plain[0].status_code == 503
                assert plain[0].json()["error"]["code"] == "engine_dead"

                refused = await client.post("/v1/completions", json={"prompt": "x"})
                assert (
                    refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
                )
                chat = functools.partial(
                    client.post,
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "x"}]},
                )
                assert (await chat()).status_code == 503
                await send(ws, generate("after", max_tokens=2))
                frame, _ = await receive(ws)
                assert (frame["type"], frame["code"]) == ("error", "engine_dead")
                assert (await client.get("/v1/models")).status_code == 200
