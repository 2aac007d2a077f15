"""The agent APIs through `legato serve` on the real default model (SmolLM2-135M-Instruct),
driven by the official ``openai`` and ``anthropic`` clients on loopback.

The server runs with the examples' Hermes chat template (SmolLM2's own template ignores
``tools``). Tool calls are constrained by ``tool_choice``, so their arguments always
satisfy the schema; the plain answers are the model's own words.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow  # starts `legato serve` on the default model once

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "examples" / "tool_chat_template_chatml_hermes.jinja"
MODEL = "SmolLM2-135M-Instruct"
SCHEMA: Any = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server_url(smollm2_dir: Path) -> Iterator[str]:
    """`legato serve` (the default model) with the Hermes tool template, for this module."""
    command = [
        sys.executable, "-m", "legato.cli", "serve", "--port", "0", "--ws-port", "0",
        "--max-model-len", "1024", "--num-kv-blocks", "400", "--disable-log-stats",
        "--chat-template", str(TEMPLATE),
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


def test_responses_with_the_openai_client(server_url: str) -> None:
    client = openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)
    answer = client.responses.create(
        model=MODEL, input="What is the capital of France?", max_output_tokens=24, temperature=0
    )
    assert "Paris" in answer.output_text
    with client.responses.stream(
        model=MODEL, input="What is the capital of France?", max_output_tokens=24, temperature=0
    ) as stream:
        final = stream.get_final_response()
    assert final.output_text == answer.output_text
    tool: Any = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
    asked: Any = [{"role": "user", "content": ASK}]
    first = client.responses.create(
        model=MODEL,
        input=asked,
        tools=[tool],
        tool_choice="required",
        max_output_tokens=60,
        parallel_tool_calls=False,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    second = client.responses.create(
        model=MODEL,
        input=[*asked, *first.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[tool],
        tool_choice="none",
        max_output_tokens=24,
        temperature=0,
    )  # fmt: skip
    assert second.status in ("completed", "incomplete") and second.output_text
    # Chained by previous_response_id: the stored turn is part of the new prompt.
    chained = client.responses.create(
        model=MODEL,
        previous_response_id=answer.id,
        input="What is the capital of France?",
        max_output_tokens=24,
        temperature=0,
    )
    assert chained.output_text
    assert chained.usage is not None and answer.usage is not None
    assert chained.usage.input_tokens > answer.usage.input_tokens + answer.usage.output_tokens
    # text.format with a JSON schema: the answer parses and satisfies it.
    formatted = client.responses.create(
        model=MODEL,
        input="Name a city, as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    assert formatted.status == "completed", formatted
    jsonschema.validate(json.loads(formatted.output_text), SCHEMA)


def test_messages_with_the_anthropic_client(server_url: str) -> None:
    client = anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0)
    cold: Any = {"temperature": 0}
    question: Any = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.messages.create(model=MODEL, messages=question, max_tokens=24, extra_body=cold)
    text = answer.content[0].text  # type: ignore[union-attr]
    assert "Paris" in text
    with client.messages.stream(
        model=MODEL, messages=question, max_tokens=24, extra_body=cold
    ) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == text
    tool: Any = {"name": "get_weather", "input_schema": SCHEMA}
    asked: Any = [{"role": "user", "content": ASK}]
    first = client.messages.create(
        model=MODEL,
        messages=asked,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=60,
    )
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    jsonschema.validate(use.input, SCHEMA)
    second = client.messages.create(
        model=MODEL,
        messages=[*asked, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}],
        tools=[tool],
        tool_choice={"type": "none"},
        max_tokens=24,
        extra_body=cold,
    )  # fmt: skip
    assert second.content[0].type == "text" and second.content[0].text
