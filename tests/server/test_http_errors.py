"""Bad input, auth and limits on the HTTP API: OpenAI's error body, and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import trio
import trio.testing
from trio_websocket import open_websocket_url

from legato.engine import AsyncEngine

from .conftest import MODEL, serving

JSON = {"content-type": "application/json"}


def assert_error(
    response: httpx.Response, status: int, code: str, param: str | None = None
) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"]
    assert error["param"] == param


async def assert_still_serving(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2}
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


@pytest.fixture
async def small(engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a server with small limits: 2000-byte bodies, n <= 4."""
    async with serving(engine, max_body_bytes=2000, max_n=4) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as client:
            yield client


BAD_BODIES: list[tuple[dict[str, Any], str, int, str, str | None]] = [
    # body, path, status, code, param
    ({"prompt": "x", "max_tokens": "ten"}, "/v1/completions", 400, "invalid_value", "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "/v1/completions", 400, "invalid_value", "temperature"),
    ({"prompt": "x", "top_p": True}, "/v1/completions", 400, "invalid_value", "top_p"),
    ({"prompt": "x", "stop": [1, 2]}, "/v1/completions", 400, "invalid_value", "stop[0]"),
    ({"prompt": {"text": "x"}}, "/v1/completions", 400, "invalid_value", "prompt"),
    ({"prompt": []}, "/v1/completions", 400, "invalid_value", "prompt"),
    ({"max_tokens": 3}, "/v1/completions", 400, "invalid_value", "prompt"),
    ({"prompt": [99999]}, "/v1/completions", 400, "invalid_value", "prompt"),
    ({"prompt": "x", "n": 5}, "/v1/completions", 400, "invalid_value", "n"),
    ({"prompt": "x", "n": 5, "stream": True}, "/v1/completions", 400, "invalid_value", "n"),
    ({"prompt": "x", "logprobs": 50}, "/v1/completions", 400, "invalid_value", "logprobs"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "/v1/completions", 400, "invalid_value", "stream_options"),
    ({"prompt": "x", "suffix": "y"}, "/v1/completions", 400, "invalid_value", "suffix"),
    ({"prompt": "x", "model": "gpt-4"}, "/v1/completions", 404, "model_not_found", "model"),
    ({"messages": "hi"}, "/v1/chat/completions", 400, "invalid_value", "messages"),
    ({"messages": [{"content": "hi"}]}, "/v1/chat/completions", 400, "invalid_value", "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "/v1/chat/completions", 400, "invalid_value", "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "/v1/chat/completions", 400, "invalid_value", "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "/v1/chat/completions", 400, "invalid_value", "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "nope"}, "/v1/chat/completions", 404, "model_not_found", "model"),
    ({"tokens": ["a"]}, "/detokenize", 400, "invalid_value", "tokens[0]"),
    ({"tokens": [99999]}, "/detokenize", 400, "invalid_value", "tokens"),
    ({}, "/tokenize", 400, "invalid_value", "prompt"),
    # SamplingParams' own rules, and the engine's, name the field as the request spelled it
    ({"prompt": "x", "top_p": 1.5}, "/v1/completions", 400, "invalid_value", "top_p"),
    ({"prompt": "x", "min_tokens": 5, "max_tokens": 4}, "/v1/completions", 400, "invalid_value", "min_tokens"),
    ({"prompt": "x", "stop_token_ids": [99999]}, "/v1/completions", 400, "invalid_value", "stop_token_ids"),
    ({"prompt": "x", "structured_outputs": {"json": "{no"}}, "/v1/completions", 400, "invalid_value", "structured_outputs.json"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "/v1/chat/completions", 400, "invalid_value", "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "/v1/chat/completions", 400, "invalid_value", "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0, "max_tokens": 5}, "/v1/chat/completions", 400, "invalid_value", "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, "/v1/chat/completions", 400, "invalid_value", "top_logprobs"),
]  # fmt: skip


async def test_bad_bodies_get_openai_errors_naming_the_field(small: httpx.AsyncClient) -> None:
    for body, path, status, code, param in BAD_BODIES:
        response = await small.post(path, json=body)
        assert_error(response, status, code, param)
        if code == "invalid_value" and param is not None:  # "param: reason", one field named
            assert response.json()["error"]["message"].startswith(f"{param}: "), response.text
    await assert_still_serving(small)


async def test_max_tokens_past_the_context_is_capped_not_refused(small: httpx.AsyncClient) -> None:
    """As vLLM's server: the output runs to max_model_len and ends with "length"."""
    body = {"prompt": [5] * 500, "max_tokens": 100000, "temperature": 0, "ignore_eos": True}
    response = await small.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (500, 12)  # max_model_len 512
    await assert_still_serving(small)


async def test_malformed_json_wrong_shapes_routes_and_methods(small: httpx.AsyncClient) -> None:
    for raw in (b"{", b"not json", b"\xff\xfe", b"[1, 2]", b'"a string"', b""):
        response = await small.post("/v1/completions", content=raw, headers=JSON)
        assert_error(response, 400, "invalid_json")
    assert_error(await small.get("/v1/nothing"), 404, "not_found")
    assert_error(await small.get("/v1/completions"), 405, "method_not_allowed")
    await assert_still_serving(small)


async def test_unknown_fields_are_ignored(small: httpx.AsyncClient) -> None:
    body = {
        "prompt": "x",
        "max_tokens": 2,
        "brand_new_option": [1, 2],
        "user": "u1",
        "metadata": {"k": "v"},
    }
    response = await small.post("/v1/completions", json=body)
    assert response.status_code == 200
    chat = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
        "store": False,
        "x": None,
    }
    assert (await small.post("/v1/chat/completions", json=chat)).status_code == 200


async def test_oversized_bodies_get_413_while_being_read(small: httpx.AsyncClient) -> None:
    big = {"prompt": "x" * 5000}
    assert_error(await small.post("/v1/completions", json=big), 413, "body_too_large")

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit counts bytes
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 100
        yield b'"}'

    response = await small.post("/v1/completions", content=chunked(), headers=JSON)
    assert_error(response, 413, "body_too_large")
    await assert_still_serving(small)


async def test_api_key(engine: AsyncEngine) -> None:
    async with serving(engine, api_key="s3cret") as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as anon:
            assert (await anon.get("/health")).status_code == 200
            for path in ("/v1/models", "/metrics", "/version", "/v1/nothing"):
                response = await anon.get(path)
                assert_error(response, 401, "invalid_api_key")
                assert response.headers["www-authenticate"] == "Bearer"
            wrong = {"Authorization": "Bearer nope"}
            assert_error(await anon.get("/v1/models", headers=wrong), 401, "invalid_api_key")
            basic = {"Authorization": "Basic s3cret"}
            assert_error(await anon.get("/v1/models", headers=basic), 401, "invalid_api_key")
            right = {"Authorization": "Bearer s3cret"}
            assert (await anon.get("/v1/models", headers=right)).status_code == 200
            assert (await anon.get("/metrics", headers=right)).status_code == 200

        async with openai.AsyncOpenAI(
            base_url=server.http_url + "/v1", api_key="wrong", max_retries=0
        ) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
        async with openai.AsyncOpenAI(
            base_url=server.http_url + "/v1", api_key="s3cret", max_retries=0
        ) as good:
            result = await good.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert result.choices[0].message.role == "assistant"


async def test_openai_client_raises_on_400(engine: AsyncEngine) -> None:
    async with serving(engine, max_n=2) as server:
        async with openai.AsyncOpenAI(
            base_url=server.http_url + "/v1", api_key="x", max_retries=0
        ) as oai:
            with pytest.raises(openai.BadRequestError) as info:
                await oai.completions.create(model=MODEL, prompt="x", n=3)
            assert "n" in str(info.value)
            with pytest.raises(openai.NotFoundError):
                await oai.completions.create(model="other", prompt="x")


async def test_slow_clients_that_never_finish_their_headers_block_no_one(
    engine: AsyncEngine,
) -> None:
    """Clients that open connections and dribble header bytes (slowloris) on either port:
    everyone else is served meanwhile, and each slow connection is closed once its
    ``header_timeout`` is up, however often it sends a byte."""
    timeout = 3.0
    async with serving(engine, header_timeout=timeout) as server:
        closed_after: list[float] = []

        async def slow_client(port: int, start: bytes) -> None:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            opened = trio.current_time()
            try:
                await stream.send_all(start)
                while True:
                    with trio.move_on_after(0.1):
                        if await stream.receive_some() == b"":
                            break
                    await stream.send_all(b"a")  # one more byte of a header that never ends
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the server reset it: closed too
            finally:
                closed_after.append(trio.current_time() - opened)
                await stream.aclose()

        http_start = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Slow: "
        ws_start = b"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nX-Slow: "
        with trio.fail_after(timeout + 20):
            async with trio.open_nursery() as nursery:
                for _ in range(20):
                    nursery.start_soon(slow_client, server.http_port, http_start)
                    nursery.start_soon(slow_client, server.ws_port, ws_start)
                await trio.testing.wait_all_tasks_blocked()
                async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as client:
                    await assert_still_serving(client)
                async with open_websocket_url(server.ws_url + "/") as ws:
                    await ws.send_message(
                        json.dumps({"type": "generate", "request_id": "r", "prompt": "hi"})
                    )
                    while not json.loads(await ws.get_message()).get("finished"):
                        pass
                assert len(closed_after) < 40  # served while slow ones still hold connections
    assert len(closed_after) == 40
    assert max(closed_after) < timeout + 3, sorted(closed_after)


async def test_the_api_description_follows_the_api_key(engine: AsyncEngine) -> None:
    """F15: /openapi.json and /docs need the key as the docs say; only /health is open."""
    async with (
        serving(engine, api_key="s3cret") as server,
        httpx.AsyncClient(base_url=server.http_url, timeout=30) as anon,
    ):
        for path in ("/openapi.json", "/docs"):
            assert_error(await anon.get(path), 401, "invalid_api_key")
            keyed = await anon.get(path, headers={"authorization": "Bearer s3cret"})
            assert keyed.status_code == 200, path
        page = await anon.get("/docs", headers={"authorization": "Bearer s3cret"})
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert (await anon.get("/health")).status_code == 200


async def test_the_engines_admission_bound_is_a_503_server_busy(
    toy_model_dir: Any, gate_steps: Any
) -> None:
    """An engine holding ``max_live_requests`` refuses one more with EngineBusyError; the
    server answers that request 503 ``server_busy`` (HTTP) or a ``server_busy`` frame
    (WebSocket), not a 500, and serves again once the first request is done. The step
    gate holds the first request live (the toy model would finish it in a blink)."""
    from legato.engine import open_engine

    from .conftest import ENGINE_ARGS

    args = {**ENGINE_ARGS, "max_live_requests": 1}
    async with open_engine(str(toy_model_dir), executor="inproc", **args) as engine:
        gate = gate_steps(engine)
        async with serving(engine) as server:
            async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
                first_done: list[int] = []

                async def first_request() -> None:
                    body = {"model": MODEL, "prompt": "hi", "max_tokens": 40, "stream": True}
                    async with client.stream("POST", "/v1/completions", json=body) as first:
                        assert first.status_code == 200
                        first_done.append(len([line async for line in first.aiter_lines()]))

                async with trio.open_nursery() as nursery:
                    gate.close()
                    nursery.start_soon(first_request)
                    with trio.fail_after(10):
                        await gate.wait_held()  # the first request is live, its step held
                    assert engine.frontend.num_live == 1
                    second = await client.post(
                        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
                    )
                    assert_error(second, 503, "server_busy")
                    async with open_websocket_url(server.ws_url + "/") as ws:
                        frame = {"type": "generate", "request_id": "w", "prompt": "x"}
                        await ws.send_message(json.dumps(frame))
                        reply = json.loads(await ws.get_message())
                        assert reply["type"] == "error" and reply["code"] == "server_busy", reply
                    gate.open()
                assert first_done and first_done[0] > 0  # the first request ran to its end
                # Once the engine is idle, a request is admitted again.
                await engine.wait_until_idle()
                await assert_still_serving(client)
