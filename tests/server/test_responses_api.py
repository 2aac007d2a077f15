"""``POST /v1/responses`` with the official ``openai`` client on loopback (toy model).

The toy model writes nonsense, so what is checked is the API: the response and
its items, the streamed event sequence the client's ``responses.stream`` accumulates,
tools constrained by ``tool_choice``, ``text.format`` JSON schemas, limits and
errors naming the field.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from legato.server import Server

from .conftest import MODEL

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture
async def oai(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=server.http_url + "/v1", api_key="unused", max_retries=0
    ) as c:
        yield c


async def sse(response: httpx.Response) -> list[tuple[str, Any]]:
    """(event name, data) of each event of an SSE body."""
    events: list[tuple[str, Any]] = []
    name = ""
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: ") :])))
    return events


async def test_create_plain_text(oai: openai.AsyncOpenAI) -> None:
    response = await oai.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input="Hello there",
        max_output_tokens=6,
        temperature=0,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete"  # the toy model never stops in 6 tokens
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text  # the SDK joins the output_text parts
    assert response.usage is not None and response.usage.output_tokens == 6
    assert response.usage.input_tokens > 0
    again = await oai.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
        max_output_tokens=6,
        temperature=0,
    )
    assert again.output_text == response.output_text  # the same prompt, rendered the same


async def test_stream_event_sequence(oai: openai.AsyncOpenAI, server: Server) -> None:
    whole = await oai.responses.create(
        model=MODEL, input="Count", max_output_tokens=8, temperature=0
    )
    async with oai.responses.stream(
        model=MODEL, input="Count", max_output_tokens=8, temperature=0
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert final.output_text == whole.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        body = {"model": MODEL, "input": "Count", "max_output_tokens": 4, "stream": True}
        async with client.stream("POST", "/v1/responses", json=body) as raw:
            events = await sse(raw)
    numbers = [data["sequence_number"] for _, data in events]
    assert numbers == list(range(len(events)))
    assert all(name == data["type"] for name, data in events)


async def test_function_call_round_trip(oai: openai.AsyncOpenAI) -> None:
    ask: Any = [{"role": "user", "content": "Weather in Paris?"}]
    first = await oai.responses.create(
        model=MODEL,
        input=ask,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=1.0,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The call and its output go back in; the answer is text again.
    follow = ask + [
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]  # fmt: skip
    second = await oai.responses.create(
        model=MODEL, input=follow, tools=[WEATHER], tool_choice="none", max_output_tokens=4
    )
    assert [item.type for item in second.output] == ["message"]
    without_output = await oai.responses.create(
        model=MODEL, input=follow[:-1], tools=[WEATHER], tool_choice="none", max_output_tokens=1
    )
    assert second.usage is not None and without_output.usage is not None
    assert second.usage.input_tokens > without_output.usage.input_tokens  # the output is in
    # Streamed: the call's arguments arrive as deltas that add up to the whole.
    async with oai.responses.stream(
        model=MODEL,
        input=ask,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,
        temperature=1.0,
    ) as stream:
        deltas = [
            e.delta async for e in stream if e.type == "response.function_call_arguments.delta"
        ]
        final = await stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and "".join(deltas) == "".join(c.arguments for c in calls)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    size: Literal["small", "big"]  # bounded: the toy model would write digits forever


async def test_text_format_json_schema(oai: openai.AsyncOpenAI) -> None:
    parsed = await oai.responses.parse(
        model=MODEL, input="A city", text_format=City, max_output_tokens=120, temperature=1.0
    )
    assert isinstance(parsed.output_parsed, City)
    async with oai.responses.stream(
        model=MODEL, input="A city", text_format=City, max_output_tokens=120, temperature=1.0
    ) as stream:
        final = await stream.get_final_response()
    assert isinstance(final.output_parsed, City)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 3}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "image"}]}, "input[0]"),
        ({"input": "x", "temperature": -1}, "temperature"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "tools": [{**WEATHER, "name": "a b"}]}, "tools[0].name"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "no"}},
         "tool_choice.name"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}},
         "text.format.schema"),
        ({"input": "x", "model": "nope"}, None),
    ],
)  # fmt: skip
async def test_bad_input_names_the_field(
    client: httpx.AsyncClient, body: dict[str, Any], param: str | None
) -> None:
    response = await client.post("/v1/responses", json=body)
    error = response.json()["error"]
    if param is None:
        assert response.status_code == 404 and error["code"] == "model_not_found"
    else:
        assert response.status_code == 400, error
        assert error["param"] == param, error
