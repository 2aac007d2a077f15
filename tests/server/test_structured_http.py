"""Structured outputs, tools, CORS and the API's docs through `legato serve` on the real default
model (SmolLM2-135M-Instruct), driven by the official openai client on loopback.

The server runs with the examples' Hermes chat template (SmolLM2's own template ignores
``tools``) and ``--enable-auto-tool-choice --tool-call-parser hermes``. Every output checked
here comes from the model at temperature 1.0: only the grammar makes it valid.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "examples" / "tool_chat_template_chatml_hermes.jinja"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS: Any = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server_url(smollm2_dir: Path) -> Iterator[str]:
    """`legato serve` (the default model) with the Hermes tool template, for this module."""
    command = [
        sys.executable, "-m", "legato.cli", "serve", "--port", "0", "--ws-port", "0",
        "--max-model-len", "1024", "--num-kv-blocks", "400", "--disable-log-stats",
        "--chat-template", str(TEMPLATE), "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--allowed-origins", '["http://app.example"]',
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert process.stdout is not None
    lines = []
    try:
        for raw in process.stdout:  # the server prints this line once it listens
            line = raw.decode(errors="replace")
            lines.append(line)
            match = re.search(r"listening on (http://\S+) and", line)
            if match:
                break
        else:
            pytest.fail("legato serve exited: " + "".join(lines))
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


def _arguments(call: Any) -> Any:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    """The official client's structured-outputs helper: response_format is a json_schema."""
    completion = client.beta.chat.completions.parse(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person,
        temperature=1.0,
        max_tokens=60,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Person), message.content


def test_json_object_and_guided_choice(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "A JSON object about a cat, please."}],
        response_format={"type": "json_object"},
        temperature=1.0,
        max_tokens=80,
    )
    text = answer.choices[0].message.content or ""
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert text.startswith("{")
    choices = ["red", "green", "blue"]
    completion = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="My favourite colour is",
        n=4,
        temperature=1.0,
        max_tokens=8,
        extra_body={"guided_choice": choices},
    )
    assert sorted(c.index for c in completion.choices) == [0, 1, 2, 3]
    assert all(c.text in choices for c in completion.choices), completion.choices


def test_regex_streamed_on_completions(client: openai.OpenAI) -> None:
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="A product code:",
        temperature=1.0,
        max_tokens=12,
        stream=True,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert re.fullmatch(pattern, text), text


def test_a_broken_schema_is_a_400_naming_it_and_the_next_request_is_served(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=ASK,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        )
    error = info.value.body
    assert isinstance(error, dict)
    assert error["param"] == "response_format.json_schema.schema", error
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="x",
            extra_body={"guided_grammar": "start: NOPE"},
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "guided_grammar"
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=4, temperature=0
    )
    assert answer.choices[0].message.content


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required(client: openai.OpenAI, parallel: bool) -> None:
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=1.0,
        max_tokens=120,
        n=3,
    )
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        calls = choice.message.tool_calls or []
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            _arguments(call)
            assert call.id.startswith("call_") and call.type == "function"


def _stream_calls(stream: Any) -> tuple[dict[int, dict[str, str]], str | None, str]:
    """A streamed answer's tool calls by index (OpenAI's deltas put together), its finish
    reason and its content."""
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                if piece.id:
                    assert not call["id"], "a call's header comes once"
                    call["id"], call["name"] = piece.id, piece.function.name
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish, content


def test_named_tool_streamed_and_whole(client: openai.OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    kwargs: Any = dict(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        tools=TOOLS,
        tool_choice=named,
        temperature=1.0,
        max_tokens=60,
    )
    answer = client.chat.completions.create(**kwargs)
    (call,) = answer.choices[0].message.tool_calls or []
    assert call.function.name == "get_time"
    _arguments(call)
    calls, finish, _ = _stream_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls"
    (streamed,) = calls.values()
    assert streamed["name"] == "get_time" and streamed["id"].startswith("call_")
    jsonschema.validate(json.loads(streamed["arguments"]), SCHEMAS["get_time"])


def test_auto_tool_choice_reads_hermes_calls(client: openai.OpenAI) -> None:
    """With tool_choice="auto" the hermes parser reads the calls out of the text. The model is
    steered into writing one (a regex on the output), so the parse is what is tested."""
    steer = (
        r'<tool_call>\n\{"name": "get_weather", "arguments": '
        r'\{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}\n</tool_call>'
    )
    kwargs: Any = dict(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        tools=TOOLS,
        tool_choice="auto",
        temperature=1.0,
        max_tokens=60,
        extra_body={"structured_outputs": {"regex": steer}},
    )
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    whole = _arguments(call)
    calls, finish, content = _stream_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and not content.strip()
    (streamed,) = calls.values()
    assert streamed["name"] == "get_weather"
    assert json.loads(streamed["arguments"]).keys() == whole.keys()
    # tool_choice="none" with the same tools: plain text, no calls.
    plain = client.chat.completions.create(
        **{**kwargs, "tool_choice": "none", "extra_body": None, "max_tokens": 8}
    )
    assert not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason in ("stop", "length")


def test_tool_errors_name_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert isinstance(info.value.body, dict)
    assert info.value.body["param"] == "tool_choice.function.name"
    bad: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=ASK, tools=bad, tool_choice="required"
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "tools"


def test_cors_request_id_openapi_and_docs(server_url: str) -> None:
    with httpx.Client(base_url=server_url, timeout=30) as http:
        preflight = http.options(
            "/v1/chat/completions",
            headers={
                "Origin": "http://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        refused = http.options(
            "/v1/models",
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "GET"},
        )
        assert refused.status_code == 400
        assert "access-control-allow-origin" not in refused.headers
        models = http.get(
            "/v1/models", headers={"Origin": "http://app.example", "X-Request-Id": "abc-123"}
        )
        assert models.headers["access-control-allow-origin"] == "http://app.example"
        assert models.headers["x-request-id"] == "abc-123"
        assert len(http.get("/v1/models").headers["x-request-id"]) == 32  # one made up
        document = http.get("/openapi.json").json()
        chat = document["paths"]["/v1/chat/completions"]["post"]
        assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert "ChatCompletionRequest" in document["components"]["schemas"]
        docs = http.get("/docs")
        assert docs.status_code == 200 and "swagger-ui-bundle.js" in docs.text
        bundle = http.get("/docs/swagger-ui-bundle.js")
        assert bundle.status_code == 200 and len(bundle.content) > 100_000
