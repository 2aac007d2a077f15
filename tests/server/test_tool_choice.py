"""tool_choice -> constraint + parser; required / named outputs sampled under the grammar
(the toy tokenizer, random logits) always parse into calls whose arguments fit their schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from legato.protocol.errors import ValidationError
from legato.server.openai_protocol import ChatCompletionRequest, parse_request
from legato.server.tool_choice import plan_tools
from legato.server.tool_parsers import HermesToolParser
from legato.structured import GrammarCompiler

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "now",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


def _plan(tool_choice: Any, tools: list[Any] | None = None, **kw: Any) -> Any:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}]}
    if tools is not None:
        body["tools"] = tools
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    req = parse_request(ChatCompletionRequest, body)
    return plan_tools(
        req.tools,
        req.tool_choice,
        parallel_tool_calls=kw.get("parallel"),
        auto_parser=kw.get("auto_parser"),
    )


def test_none_and_no_tools() -> None:
    plan = _plan(None)
    assert plan.constraint is None and plan.parser is None and plan.template_tools is None
    plan = _plan("none", [WEATHER])
    assert plan.parser is None and plan.template_tools[0]["function"]["name"] == "get_weather"


def test_auto_needs_the_server_flag() -> None:
    with pytest.raises(ValidationError, match="enable-auto-tool-choice") as caught:
        _plan("auto", [WEATHER])
    assert caught.value.field == "tool_choice"
    assert _plan(None, [WEATHER], auto_parser=HermesToolParser).parser is HermesToolParser


@pytest.mark.parametrize(
    ("choice", "tools", "field"),
    [
        ("required", None, "tool_choice"),
        (
            {"type": "function", "function": {"name": "missing"}},
            [WEATHER],
            "tool_choice.function.name",
        ),
        ("required", [WEATHER, WEATHER], "tools"),
    ],
)
def test_refusals_name_the_field(choice: Any, tools: list[Any] | None, field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _plan(choice, tools)
    assert caught.value.field == field


def test_required_outputs_always_parse(
    grammar_compiler: GrammarCompiler, constrained_generate: Any
) -> None:
    for seed in range(6):
        plan = _plan("required", [WEATHER, CLOCK], parallel=False)
        text, _ = constrained_generate(
            grammar_compiler.compile(plan.constraint), seed, eos_bias=4.0, prefer='"}]'
        )
        calls = plan.parser().parse(text).tool_calls
        assert len(calls) == 1, text
        call = calls[0]
        schema = (WEATHER if call.name == "get_weather" else CLOCK)["function"]["parameters"]
        jsonschema.validate(json.loads(call.arguments), schema)


def test_named_outputs_always_parse(
    grammar_compiler: GrammarCompiler, constrained_generate: Any
) -> None:
    for seed in range(6):
        plan = _plan({"type": "function", "function": {"name": "get_weather"}}, [CLOCK, WEATHER])
        text, _ = constrained_generate(grammar_compiler.compile(plan.constraint), seed, prefer='"}')
        (call,) = plan.parser().parse(text).tool_calls
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])


def test_a_broken_tool_schema_is_named(grammar_compiler: GrammarCompiler) -> None:
    broken = {"type": "function", "function": {"name": "bad", "parameters": {"type": "wat"}}}
    plan = _plan({"type": "function", "function": {"name": "bad"}}, [WEATHER, broken])
    with pytest.raises(ValidationError) as caught:
        grammar_compiler.compile(plan.constraint)
    assert caught.value.field == "tools[1].function.parameters"
    with pytest.raises(ValidationError) as caught:
        grammar_compiler.compile(_plan("required", [WEATHER, broken]).constraint)
    assert caught.value.field == "tools"
