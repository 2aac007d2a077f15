"""The OpenAI-compatible HTTP API with real clients: the official ``openai`` package and httpx."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import trio
import trio.testing

from legato import __version__
from legato.actors.frontend import INLINE_MAX_PROMPT_CHARS
from legato.engine import AsyncEngine, open_engine
from legato.server import Server

from .conftest import ENGINE_ARGS, MODEL, metric, serving, wait_kv_used, wait_until


@pytest.fixture
async def oai(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=server.http_url + "/v1", api_key="unused", max_retries=0
    ) as c:
        yield c


async def sse_events(response: httpx.Response) -> list[Any]:
    """The JSON events of an SSE body; the terminating [DONE] is checked and dropped."""
    events: list[Any] = []
    done = False
    async for line in response.aiter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "an event after [DONE]"
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
        else:
            events.append(json.loads(data))
    assert done, "no [DONE]"
    return events


# ------------------------------------------------------------------ completions


async def test_completion_with_the_openai_client(oai: openai.AsyncOpenAI) -> None:
    result = await oai.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert result.object == "text_completion"
    assert result.id.startswith("cmpl-")
    assert result.model == MODEL
    assert len(result.choices) == 1
    choice = result.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert result.usage is not None
    assert result.usage.completion_tokens == 5
    assert result.usage.total_tokens == result.usage.prompt_tokens + 5

    again = await oai.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].text == choice.text  # greedy is deterministic


async def test_completion_prompt_forms_n_and_logprobs(oai: openai.AsyncOpenAI) -> None:
    result = await oai.completions.create(
        model=MODEL,
        prompt=[[5, 6, 7], [8, 9]],
        n=2,
        max_tokens=3,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    assert result.usage is not None
    assert result.usage.prompt_tokens == 5
    assert result.usage.completion_tokens == 12
    for choice in result.choices:
        assert choice.logprobs is not None
        assert len(choice.logprobs.tokens or []) == 3
        assert len(choice.logprobs.token_logprobs or []) == 3
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs or [])
        assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs or [])
        assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset or [])

    strings = await oai.completions.create(model=MODEL, prompt=["a b", "c d", "e f"], max_tokens=2)
    assert sorted(c.index for c in strings.choices) == [0, 1, 2]


async def test_completion_streaming_with_the_openai_client(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, reasons, usage = "", [], None
    async with stream:
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                reasons.append(choice.finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    assert usage is not None and usage.completion_tokens == 8

    whole = await oai.completions.create(
        model=MODEL, prompt="Hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].text == text


async def test_completion_echo(oai: openai.AsyncOpenAI) -> None:
    result = await oai.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=3, echo=True
    )
    assert result.choices[0].text.startswith("Hello there")
    stream = await oai.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=3, echo=True, stream=True
    )
    async with stream:
        chunks = [c.choices[0].text async for c in stream if c.choices]
    assert chunks[0].startswith("Hello there")


async def test_raw_sse_shapes_and_usage_chunk(client: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "some_future_field": {"ignored": True},
    }
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = await sse_events(response)
    ids = {e["id"] for e in events}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": last["usage"]["prompt_tokens"],
        "completion_tokens": 4,
        "total_tokens": last["usage"]["prompt_tokens"] + 4,
    }
    for chunk in chunks:
        assert chunk["object"] == "text_completion" and chunk["model"] == MODEL
        assert chunk["usage"] is None
        (choice,) = chunk["choices"]
        assert set(choice) >= {"index", "text", "logprobs", "finish_reason"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_stop_string_ends_with_stop(client: httpx.AsyncClient) -> None:
    first = await client.post(
        "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    )
    text = first.json()["choices"][0]["text"]
    stop = text.strip()[:2] if len(text.strip()) >= 2 else text
    second = await client.post(
        "/v1/completions",
        json={
            "prompt": "Hello",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "stop": [stop],
        },
    )
    choice = second.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert stop not in choice["text"]


# ------------------------------------------------------------------ chat


async def test_chat_with_the_openai_client(oai: openai.AsyncOpenAI) -> None:
    messages: Any = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
    ]
    result = await oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0
    )
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    (choice,) = result.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert result.usage is not None and result.usage.prompt_tokens > 0

    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    roles, content, reasons, usage = [], "", [], None
    async with stream:
        async for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            for c in chunk.choices:
                roles.append(c.delta.role)
                content += c.delta.content or ""
                reasons.append(c.finish_reason)
            usage = chunk.usage or usage
    assert roles[0] == "assistant"
    assert content == choice.message.content
    assert reasons[-1] == choice.finish_reason
    assert usage is not None and usage.completion_tokens == result.usage.completion_tokens


async def test_a_large_chat_renders_off_the_event_loop_and_answers_as_its_prompt(
    toy_model_dir: Any, held_tokenizer: Any
) -> None:
    """A chat too large to render inline goes through the engine's chat path, in its
    thread (held there, a plain request is served end to end meanwhile), and answers as
    the same conversation given as prompt token ids; a failing template is still a 400
    naming ``messages``. Rendered by the server on the event loop, the held tokenizer is
    never reached and the wait for it fails."""
    chat = [{"role": "user", "content": "the " * 1100}]
    assert len(chat[0]["content"]) > INLINE_MAX_PROMPT_CHARS
    args = {**ENGINE_ARGS, "max_model_len": 2048}
    async with (
        open_engine(str(toy_model_dir), executor="inproc", **args) as engine,
        serving(engine) as server,
        httpx.AsyncClient(base_url=server.http_url, timeout=30) as client,
    ):
        assert engine.frontend.offload_renderer is not None
        engine.frontend.offload_renderer.tokenizer = held_tokenizer
        greedy = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(
                await client.post("/v1/chat/completions", json={**greedy, "messages": chat})
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            with trio.fail_after(30):
                await held_tokenizer.entered.wait()
            small = await client.post("/v1/completions", json={**greedy, "prompt": "hello"})
            assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 8
            assert not answers  # still rendering in its thread
            held_tokenizer.release.set()
        (answer,) = answers
        assert answer.status_code == 200, answer.text
        ids = engine.renderer.render_chat_prompt(chat)["prompt_token_ids"]
        plain = await client.post("/v1/completions", json={**greedy, "prompt": ids})
        assert plain.status_code == 200, plain.text
        assert answer.json()["usage"]["prompt_tokens"] == len(ids) > 1100
        assert (
            answer.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["text"]
        )

        bad = {**greedy, "messages": chat, "chat_template": "{{ raise_exception('no') }}"}
        refused = await client.post("/v1/chat/completions", json=bad)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "chat_template"  # not trusted by default


async def test_chat_logprobs_and_max_completion_tokens(oai: openai.AsyncOpenAI) -> None:
    result = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=2,
        n=2,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in result.choices] == [0, 1]
    for choice in result.choices:
        assert choice.finish_reason == "length"
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 4
        for item in choice.logprobs.content:
            assert item.logprob <= 0 and len(item.top_logprobs) == 2


# ------------------------------------------------------------------ companions


async def test_models_version_tokenize_detokenize_metrics(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert (await client.get("/version")).json() == {"version": __version__}
    assert (await client.get("/health")).status_code == 200

    tokens = (await client.post("/tokenize", json={"prompt": "Hello world"})).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 512
    text = (await client.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
    assert text == {"prompt": "Hello world"}
    chat = (
        await client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
    ).json()
    assert chat["count"] > tokens["count"] - 3

    response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    assert "legato:kv_cache_blocks_total" in response.text


async def assert_freed_and_reported(server: Server, client: httpx.AsyncClient, gate: Any) -> None:
    """Once the server has let go of the request, one engine step at most frees its blocks
    (the request had hundreds of tokens to go), and /metrics says so at once."""
    with trio.fail_after(10):
        await server.state.wait_idle()
    await gate.assert_done_within_one_step()
    text = (await client.get("/metrics")).text
    assert metric(text, "legato:kv_cache_blocks_used") == 0
    assert metric(text, "legato:num_requests_running") == 0


async def test_client_disconnect_mid_stream_aborts_the_request(
    server: Server, client: httpx.AsyncClient, engine: AsyncEngine, gate_steps: Any
) -> None:
    gate = gate_steps(engine)
    body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as other:
        async with other.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async with contextlib.aclosing(response.aiter_lines()) as lines:
                await lines.__anext__()
                await wait_kv_used(client)
        # leaving the block closes the connection mid-stream
    await assert_freed_and_reported(server, client, gate)


async def test_non_streaming_disconnect_aborts_too(
    server: Server, client: httpx.AsyncClient, engine: AsyncEngine, gate_steps: Any
) -> None:
    gate = gate_steps(engine)
    body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as other:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(other.post, "/v1/completions", json=body))
            await wait_kv_used(client)
            nursery.cancel_scope.cancel()
    await assert_freed_and_reported(server, client, gate)


# ------------------------------------------------------------------ shutdown


async def test_drain_finishes_streams_and_refuses_new_requests(engine: AsyncEngine) -> None:
    async with serving(engine, shutdown_grace=30.0) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as c:
            body = {"prompt": "Hi", "max_tokens": 30, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                await lines.__anext__()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(server.shutdown)
                    await trio.testing.wait_all_tasks_blocked()
                    assert (await c.get("/health")).status_code == 503
                    refused = await c.post("/v1/completions", json={"prompt": "x"})
                    assert refused.status_code == 503
                    assert refused.json()["error"]["code"] == "shutting_down"
                    rest = [line async for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"


async def test_drain_aborts_streams_after_the_grace_period(engine: AsyncEngine) -> None:
    async with serving(engine, shutdown_grace=0.0) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as c:
            body = {"prompt": "Hi", "max_tokens": 450, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                await lines.__anext__()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(server.shutdown)
                    rest = [line async for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"

    async def freed() -> bool:  # within one engine step of the abort
        return engine.num_kv_blocks_used == 0

    await wait_until(freed, 5)


async def prefix_cache_hits(client: httpx.AsyncClient) -> float:
    response = await client.get("/metrics")
    return metric(response.text, "legato:prefix_cache_hits_total", default=0.0)


async def test_cache_salt_keeps_tenants_apart(client: httpx.AsyncClient) -> None:
    ids = list(range(5, 205))

    async def hits_gained(path: str, body: dict[str, Any]) -> float:
        before = await prefix_cache_hits(client)
        response = await client.post(path, json={**body, "max_tokens": 2})
        assert response.status_code == 200, response.text
        return await prefix_cache_hits(client) - before

    completion = {"prompt": ids}
    assert await hits_gained("/v1/completions", {**completion, "cache_salt": "tenant-a"}) == 0
    assert await hits_gained("/v1/completions", {**completion, "cache_salt": "tenant-b"}) == 0
    assert await hits_gained("/v1/completions", completion) == 0
    assert await hits_gained("/v1/completions", {**completion, "cache_salt": "tenant-a"}) >= 192
    chat = {"messages": [{"role": "user", "content": "a long shared question " * 12}]}
    assert await hits_gained("/v1/chat/completions", {**chat, "cache_salt": "tenant-a"}) == 0
    assert await hits_gained("/v1/chat/completions", {**chat, "cache_salt": "tenant-b"}) == 0
    assert await hits_gained("/v1/chat/completions", {**chat, "cache_salt": "tenant-b"}) > 0
    for salt in ("", 7):
        response = await client.post("/v1/completions", json={**completion, "cache_salt": salt})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "cache_salt"
