"""The Responses API's state with the official ``openai`` client on loopback (toy model):
``store``, ``previous_response_id``, ``responses.retrieve`` / ``delete``, background
responses and ``responses.cancel``, and the store's bounds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import trio

from legato.engine import AsyncEngine
from legato.server import Server
from legato.server.response_store import ResponseStore, StoredResponse

from .conftest import MODEL, metric, serving, wait_until


@pytest.fixture
async def oai(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=server.http_url + "/v1", api_key="unused", max_retries=0
    ) as c:
        yield c


async def rendered_tokens(client: httpx.AsyncClient, messages: list[dict[str, Any]]) -> int:
    """How many tokens the chat template makes of ``messages`` (with the generation prompt)."""
    response = await client.post("/tokenize", json={"messages": messages})
    assert response.status_code == 200, response.text
    count: int = response.json()["count"]
    return count


async def test_chained_by_previous_response_id(
    oai: openai.AsyncOpenAI, client: httpx.AsyncClient
) -> None:
    first = await oai.responses.create(
        model=MODEL, instructions="Be brief.", input="My name is Ada.", max_output_tokens=4
    )
    second = await oai.responses.create(
        model=MODEL, previous_response_id=first.id, input="What is my name?", max_output_tokens=4
    )
    assert second.previous_response_id == first.id and second.store is True
    # The prompt was the earlier input and output, then the new input (no instructions).
    conversation = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage is not None
    assert second.usage.input_tokens == await rendered_tokens(client, conversation)
    third = await oai.responses.create(
        model=MODEL, previous_response_id=second.id, input="Again?", max_output_tokens=4
    )
    conversation += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Again?"},
    ]
    assert third.usage is not None
    assert third.usage.input_tokens == await rendered_tokens(client, conversation)


async def test_retrieve_and_delete(oai: openai.AsyncOpenAI) -> None:
    made = await oai.responses.create(model=MODEL, input="Hello", max_output_tokens=5)
    got = await oai.responses.retrieve(made.id)
    assert got.id == made.id and got.status == made.status
    assert got.output_text == made.output_text
    async with oai.responses.stream(model=MODEL, input="Hi", max_output_tokens=3) as stream:
        streamed = await stream.get_final_response()
    assert (await oai.responses.retrieve(streamed.id)).output_text == streamed.output_text
    await oai.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(made.id)


async def test_store_false_is_not_kept(oai: openai.AsyncOpenAI) -> None:
    made = await oai.responses.create(model=MODEL, input="Hello", max_output_tokens=2, store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError) as caught:
        await oai.responses.retrieve(made.id)
    assert caught.value.body["param"] == "response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as caught:
        await oai.responses.create(
            model=MODEL, input="More", previous_response_id=made.id, max_output_tokens=2
        )
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


async def test_background_runs_to_the_end(oai: openai.AsyncOpenAI) -> None:
    whole = await oai.responses.create(
        model=MODEL, input="Count", max_output_tokens=6, temperature=0
    )
    queued = await oai.responses.create(
        model=MODEL, input="Count", max_output_tokens=6, temperature=0, background=True
    )
    assert queued.status in ("queued", "in_progress") and queued.background is True

    async def finished() -> bool:
        return (await oai.responses.retrieve(queued.id)).status not in ("queued", "in_progress")

    await wait_until(finished)
    done = await oai.responses.retrieve(queued.id)
    assert done.status == "incomplete" and done.output_text == whole.output_text


async def test_background_cancel_aborts_the_engine_request(
    server: Server,
    oai: openai.AsyncOpenAI,
    client: httpx.AsyncClient,
    engine: AsyncEngine,
    gate_steps: Any,
) -> None:
    gate = gate_steps(engine)
    gate.close()
    queued = await oai.responses.create(
        model=MODEL, input="Go on", max_output_tokens=400, background=True
    )
    await gate.wait_held()  # the engine has it, and computes nothing
    assert (await oai.responses.retrieve(queued.id)).status == "queued"
    gate.allow(3)  # prefill and a couple of tokens: accepted, far from done
    await gate.wait_passed(3)

    async def in_progress() -> bool:
        return (await oai.responses.retrieve(queued.id)).status == "in_progress"

    await wait_until(in_progress)
    assert metric((await client.get("/metrics")).text, "legato:kv_cache_blocks_used") > 0
    cancelled = await oai.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    # The abort reached the engine: with the gate open again it stops within a step or
    # two (not 400 tokens later), holding no KV block.
    with trio.fail_after(10):
        await server.state.wait_idle()
    gate.open()
    with trio.fail_after(10):
        await engine.wait_until_idle()
    assert gate.num_passed <= 5 and engine.num_kv_blocks_used == 0
    text = (await client.get("/metrics")).text
    assert metric(text, "legato:kv_cache_blocks_used") == 0
    assert metric(text, "legato:num_requests_running") == 0
    assert (await oai.responses.retrieve(queued.id)).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # only a running one can be cancelled
        await oai.responses.cancel(queued.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "background": True, "stream": True}, "stream"),
        ({"input": "x", "previous_response_id": 3}, "previous_response_id"),
    ],
)
async def test_bad_state_fields_name_the_field(
    client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_unknown_id_is_404_naming_the_field(client: httpx.AsyncClient) -> None:
    for method, path in [("GET", "/v1/responses/resp_nope"), ("POST", "/v1/responses/x/cancel")]:
        response = await client.request(method, path)
        assert response.status_code == 404, response.text
        assert response.json()["error"]["param"] == "response_id"


async def test_eviction_by_count(engine: AsyncEngine) -> None:
    async with serving(engine, responses_store_max_entries=2) as server:
        async with openai.AsyncOpenAI(
            base_url=server.http_url + "/v1", api_key="unused", max_retries=0
        ) as oai:
            ids = [
                (await oai.responses.create(model=MODEL, input="Hi", max_output_tokens=1)).id
                for _ in range(3)
            ]
            with pytest.raises(openai.NotFoundError):
                await oai.responses.retrieve(ids[0])
            for kept in ids[1:]:
                assert (await oai.responses.retrieve(kept)).id == kept
        assert len(server.state.responses) == 2


def test_eviction_by_age() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=10, max_age=60.0, clock=lambda: now[0])
    store.put("old", StoredResponse({"status": "completed"}))
    now[0] = 30.0
    store.put("new", StoredResponse({"status": "completed"}))
    assert store.get("old") is not None
    now[0] = 61.0
    assert store.get("old") is None and store.get("new") is not None
    now[0] = 91.0
    assert store.get("new") is None and len(store) == 0


def test_eviction_by_size() -> None:
    store = ResponseStore(max_entries=10, max_age=60.0, max_chars=1000)
    turn = [{"role": "user", "content": "x" * 300}]
    for name in ("a", "b", "c"):
        store.put(name, StoredResponse({"status": "completed"}, list(turn)))
    assert store.get("a") is not None and 900 < store.chars <= 1000
    store.put("d", StoredResponse({"status": "completed"}, list(turn)))
    assert store.get("a") is None and store.get("b") is not None and store.chars <= 1000
    running = StoredResponse({"status": "in_progress"}, scope=trio.CancelScope())
    store.put("e", running)
    # A background run that ends with a long conversation pushes the oldest out.
    store.update("e", running, {"status": "completed"}, turn * 2)
    assert store.get("b") is None and store.get("c") is None and store.chars <= 1000
    for name in ("d", "e"):
        store.pop(name)
    assert store.chars == 0 and len(store) == 0
    store.put("huge", StoredResponse({"status": "completed"}, turn * 4))
    assert store.get("huge") is None and store.chars == 0  # alone past the bound: not kept


async def test_evicting_a_running_background_response_cancels_it() -> None:
    store = ResponseStore(max_entries=1, max_age=60.0)
    running = StoredResponse({"status": "in_progress"}, scope=trio.CancelScope())
    store.put("running", running)
    store.put("next", StoredResponse({"status": "completed"}))
    assert running.scope is not None and running.scope.cancel_called
