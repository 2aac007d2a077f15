"""``POST /v1/messages`` (Anthropic) with the official ``anthropic`` client on loopback
(toy model).

The toy model writes nonsense, so what is checked is the API: the message and its
content blocks, the streamed event sequence the client's ``messages.stream``
accumulates, tool use constrained by ``tool_choice``, stop sequences, the key in
``x-api-key``, and errors in Anthropic's shape naming the field.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import MessageParam

from legato.engine import AsyncEngine
from legato.server import Server

from .conftest import MODEL, serving

WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
COLD: Any = {"temperature": 0}  # the SDK dropped temperature from its signature; the API has it
WARM: Any = {"temperature": 1.0}
ASK: list[MessageParam] = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
async def claude(server: Server) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(
        base_url=server.http_url, api_key="unused", max_retries=0
    ) as c:
        yield c


async def test_create_plain_text(claude: anthropic.AsyncAnthropic) -> None:
    message = await claude.messages.create(
        model=MODEL, system="Answer briefly.", messages=ASK, max_tokens=6, extra_body=COLD
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason == "max_tokens"
    (block,) = message.content
    assert block.type == "text" and block.text
    assert message.usage.output_tokens == 6 and message.usage.input_tokens > 0
    counted = await claude.messages.count_tokens(
        model=MODEL, system="Answer briefly.", messages=ASK
    )
    assert counted.input_tokens == message.usage.input_tokens


async def test_stop_sequence(claude: anthropic.AsyncAnthropic) -> None:
    free = await claude.messages.create(model=MODEL, messages=ASK, max_tokens=12, extra_body=COLD)
    text = free.content[0].text  # type: ignore[union-attr]
    stop = text[3:5]  # two characters the model is known to write (temperature 0)
    stopped = await claude.messages.create(
        model=MODEL, messages=ASK, max_tokens=12, extra_body=COLD, stop_sequences=[stop]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


async def test_stream_event_sequence(claude: anthropic.AsyncAnthropic) -> None:
    whole = await claude.messages.create(model=MODEL, messages=ASK, max_tokens=8, extra_body=COLD)
    async with claude.messages.stream(
        model=MODEL, messages=ASK, max_tokens=8, extra_body=COLD
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    raw = [k for k in kinds if k not in ("text",)]  # "text": the helper's own per-delta event
    assert raw[:2] == ["message_start", "content_block_start"]
    assert set(raw[2:-3]) == {"content_block_delta"}
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]


async def test_tool_use_round_trip(claude: anthropic.AsyncAnthropic) -> None:
    first = await claude.messages.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=40,
        extra_body=WARM,
    )
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    follow: list[MessageParam] = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump()]},  # type: ignore[list-item]
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
        },
    ]
    second = await claude.messages.create(
        model=MODEL, messages=follow, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=4
    )
    assert [block.type for block in second.content] == ["text"]
    asked = await claude.messages.count_tokens(model=MODEL, messages=follow[:2], tools=[WEATHER])
    assert second.usage.input_tokens > asked.input_tokens  # the call and its result are in
    # Streamed ("any": at least one call): the input arrives as JSON deltas.
    async with claude.messages.stream(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=60,
        extra_body=WARM,
    ) as stream:
        final = await stream.get_final_message()
    uses = [block for block in final.content if block.type == "tool_use"]
    assert uses and final.stop_reason == "tool_use"
    for block in uses:
        jsonschema.validate(block.input, WEATHER["input_schema"])


async def test_output_config_json_schema(claude: anthropic.AsyncAnthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "hot": {"type": "boolean"}},
        "required": ["city", "hot"],
        "additionalProperties": False,
    }
    message = await claude.messages.create(
        model=MODEL,
        messages=ASK,
        max_tokens=80,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=WARM,
    )
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_tokens": 4}, "messages"),
        ({"messages": ASK}, "max_tokens"),
        ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 4},
         "messages[0].content[0]"),
        ({"messages": ASK, "max_tokens": 4, "temperature": "hot"}, "temperature"),
        ({"messages": ASK, "max_tokens": 4, "stop_sequences": [""]}, "stop_sequences"),
        ({"messages": ASK, "max_tokens": 4, "tool_choice": {"type": "tool"}, "tools": [WEATHER]},
         "tool_choice.name"),
        ({"messages": ASK, "max_tokens": 4, "tools": [{"name": "x"}]}, "tools[0].input_schema"),
    ],
)  # fmt: skip
async def test_errors_in_anthropic_shape(
    client: httpx.AsyncClient, body: dict[str, Any], field: str
) -> None:
    response = await client.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    answer = response.json()
    assert answer["type"] == "error", answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"].startswith(field + ":"), answer


async def test_the_sdk_raises_on_errors(claude: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        await claude.messages.create(
            model=MODEL, messages=ASK, max_tokens=4, extra_body={"top_p": 7.0}
        )
    assert "top_p" in info.value.message
    with pytest.raises(anthropic.NotFoundError):
        await claude.messages.create(model="nope", messages=ASK, max_tokens=4)


async def test_x_api_key(engine: AsyncEngine) -> None:
    async with serving(engine, api_key="sekrit") as server:
        async with anthropic.AsyncAnthropic(
            base_url=server.http_url, api_key="sekrit", max_retries=0
        ) as good:
            message = await good.messages.create(model=MODEL, messages=ASK, max_tokens=2)
            assert message.usage.output_tokens == 2
        async with anthropic.AsyncAnthropic(
            base_url=server.http_url, api_key="wrong", max_retries=0
        ) as bad:
            with pytest.raises(anthropic.AuthenticationError) as info:
                await bad.messages.create(model=MODEL, messages=ASK, max_tokens=2)
            body = info.value.body
            assert isinstance(body, dict) and body["error"]["type"] == "authentication_error"
        async with httpx.AsyncClient(base_url=server.http_url) as client:
            raw = await client.post(
                "/v1/completions",
                headers={"x-api-key": "sekrit"},
                json={"prompt": "hi", "max_tokens": 1},
            )
            assert raw.status_code == 200, raw.text
            raw = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert raw.status_code == 401
