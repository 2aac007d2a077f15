"""Hostile structured-output fields and tools on the HTTP API: JSON schemas (deep nesting,
huge enums, bad ``$ref``, wrong types), regexes (invalid, catastrophic), choice lists, grammars,
``tools`` with bad parameter schemas, ``tool_choice`` naming unknown tools, ``response_format``
variants.

Each request must get a 400 whose ``param`` names the field that was sent (its first
component: ``response_format.json_schema.schema`` names ``response_format``), or a valid
answer; never a 500. The engine must survive every example and serve the next request.

One server per module (the toy model, hermes tool parser), as in test_fuzz_http. Examples are
few (``LEGATO_FUZZ_STRUCTURED_EXAMPLES``, default 12 per test): each compiles a grammar.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from .test_fuzz_http import MODEL, ServerThread, check_answer, post_json

TEMPLATE = Path(__file__).parents[2] / "examples" / "tool_chat_template_chatml_hermes.jinja"
FUZZ = settings(
    max_examples=int(os.environ.get("LEGATO_FUZZ_STRUCTURED_EXAMPLES", "12")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "model": MODEL}
COMPLETION = {"prompt": "hi", "max_tokens": 4, "model": MODEL}


@pytest.fixture(scope="module")
def fuzz_server(toy_model_dir: Path) -> Iterator[ServerThread]:
    settings = dict(
        max_body_bytes=1 << 20,
        chat_template=str(TEMPLATE),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    with ServerThread(toy_model_dir, **settings) as server:
        yield server


@pytest.fixture(scope="module")
def http(fuzz_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_server.http_url, timeout=120) as client:
        yield client


def check(
    fuzz_server: ServerThread, http: httpx.Client, path: str, body: dict[str, Any]
) -> httpx.Response:
    """POST ``body``; a 400 naming one of the fields sent beyond the base body, or a 200.
    Then the engine is alive and serves the next request."""
    response = post_json(http, path, body)
    check_answer(response, allowed={200, 400})
    if response.status_code == 400:
        base = CHAT if path == "/v1/chat/completions" else COMPLETION
        sent = set(body) - set(base)
        param = response.json()["error"]["param"]
        assert param is not None, response.text
        assert re.split(r"[.\[]", param)[0] in sent, (param, sent, response.text)
    fuzz_server.assert_engine_alive()
    follow = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 2})
    assert follow.status_code == 200, follow.text
    return response


# ------------------------------------------------------------------ strategies

NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)
SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | NAMES
TYPES = st.sampled_from(
    ["object", "string", "integer", "number", "boolean", "array", "null", "nonsense", ""]
) | st.lists(st.sampled_from(["string", "null", "integer", "x"]), max_size=3)
KEYWORD_VALUES = (
    SCALARS | st.lists(SCALARS, max_size=3) | st.dictionaries(NAMES, SCALARS, max_size=2)
)


def nested(depth: int, leaf: dict[str, Any]) -> dict[str, Any]:
    schema = leaf
    for level in range(depth):
        if level % 2:
            schema = {"type": "array", "items": schema}
        else:
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


BAD_REFS = st.sampled_from(
    [
        {"$ref": "#/definitions/missing"},
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},  # a cycle
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
        {"$ref": "http://example.com/schema.json"},
        {"$ref": 5},
        {"$ref": "#"},
        {"type": "object", "properties": {"self": {"$ref": "#"}}},
        {"$ref": "#/properties/x/../../"},
    ]
)


@st.composite
def json_schemas(draw: st.DrawFn) -> Any:
    """Schemas a user (or an attacker) might send: plausible, broken, huge or not a schema."""
    leaf = draw(
        st.fixed_dictionaries({"type": TYPES})
        | st.fixed_dictionaries({"type": st.just("string"), "maxLength": KEYWORD_VALUES})
        | st.fixed_dictionaries({"type": st.just("integer"), "minimum": SCALARS})
        | st.fixed_dictionaries({"pattern": st.sampled_from(["(", "a+", "[z-a]", "(a+)+$"])})
        | st.fixed_dictionaries({"enum": st.lists(SCALARS, max_size=4)})
    )
    kind = draw(st.sampled_from(["nested", "enum", "ref", "keywords", "not a schema"]))
    if kind == "nested":
        return nested(draw(st.integers(0, 120)), leaf)
    if kind == "enum":
        size = draw(st.sampled_from([0, 1, 50, 3000]))
        values = draw(st.sampled_from(["ints", "strings", "mixed"]))
        enum: list[Any] = (
            list(range(size))
            if values == "ints"
            else [f"v{i}" for i in range(size)]
            if values == "strings"
            else [i if i % 3 else {"k": i} for i in range(size)]
        )
        return {"type": "object", "properties": {"e": {"enum": enum}}, "required": ["e"]}
    if kind == "ref":
        return draw(BAD_REFS)
    if kind == "keywords":
        keyword = draw(
            st.sampled_from(
                ["properties", "required", "items", "additionalProperties", "minItems",
                 "maxItems", "anyOf", "oneOf", "allOf", "format", "const", "type"]
            )
        )  # fmt: skip
        return {"type": "object", keyword: draw(KEYWORD_VALUES)}
    return draw(SCALARS | st.lists(SCALARS, max_size=3))


REGEXES = st.sampled_from(
    [
        "(", ")", "[z-a]", "\\", "a{5,2}", "(?P<x>a", "(?=a)b", "(a)\\1", "a**", "[[:alpha:]]",
        "(a+)+b", "(a|aa)*c", "(.*a){20}", "(x+x+)+y", "a{1000}{1000}", "[^\\x00-\\x{10FFFF}]",
        "", ".*", "[0-9]{2}-[a-c]{2}", "\\d{3}", "\\p{L}+", "(?i)yes|no",
    ]
) | st.text(max_size=12)  # fmt: skip
CHOICES = (
    st.just([])
    | st.just([""])
    | st.lists(NAMES, max_size=6)
    | st.just([f"choice {i}" for i in range(2000)])
    | st.lists(SCALARS | st.lists(SCALARS, max_size=2), min_size=1, max_size=4)
    | SCALARS
)
GRAMMARS = st.sampled_from(
    [
        'start: "yes" | "no"',
        "start: (",
        'root ::= "a" root | "b"',  # GBNF
        "start: x\nx: x",  # left recursion with no end
        "start: /[a-z]+/",
        "start: /(/",
        "%import common.WORD\nstart: WORD",
        "",
        'start: "a"{1000}',
    ]
) | st.text(max_size=30)


@st.composite
def tools(draw: st.DrawFn) -> Any:
    """A ``tools`` list with hostile entries (or not a list at all)."""

    def tool() -> Any:
        name = draw(st.sampled_from(["get_time", "get_weather", ""]) | NAMES)
        function: dict[str, Any] = {"name": name}
        if draw(st.booleans()):
            function["parameters"] = draw(json_schemas())
        if draw(st.booleans()):
            function["description"] = draw(SCALARS)
        return draw(
            st.just({"type": "function", "function": function})
            | st.just({"type": draw(SCALARS), "function": function})
            | st.just({"function": function})
            | st.just({"type": "function"})
            | SCALARS
        )

    if draw(st.integers(0, 9)) == 0:
        return draw(SCALARS)
    return [tool() for _ in range(draw(st.integers(0, 3)))]


TOOL_CHOICES = (
    st.sampled_from(["none", "auto", "required", "any", ""])
    | st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAMES})}
    )
    | st.just({"type": "function", "function": {"name": "not_a_tool"}})
    | st.just({"type": "function"})
    | SCALARS
)
GOOD_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 4}},
            "required": ["zone"],
        },
    },
}


@st.composite
def response_formats(draw: st.DrawFn) -> Any:
    schema = draw(json_schemas())
    return draw(
        st.sampled_from(
            [
                {"type": "json_object"},
                {"type": "text"},
                {"type": "json_schema"},
                {"type": "json_schema", "json_schema": {"name": "x"}},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                {"type": "json_schema", "json_schema": {"schema": schema, "strict": True}},
                {"type": "json_schema", "json_schema": schema},
                {"type": "grammar", "grammar": "start: x"},
                {"type": None},
                {},
            ]
        )
        | SCALARS
    )


# ------------------------------------------------------------------ the fuzzers


@FUZZ
@given(schema=json_schemas(), where=st.sampled_from(["guided_json", "structured_outputs"]))
def test_hostile_json_schemas(
    fuzz_server: ServerThread, http: httpx.Client, schema: Any, where: str
) -> None:
    value = schema if where == "guided_json" else {"json": schema}
    response = check(fuzz_server, http, "/v1/completions", {**COMPLETION, where: value})
    if response.status_code == 200:  # a schema that compiled: the output is a JSON prefix
        text = response.json()["choices"][0]["text"]
        assert isinstance(text, str)


@FUZZ
@given(fmt=response_formats())
def test_hostile_response_formats(fuzz_server: ServerThread, http: httpx.Client, fmt: Any) -> None:
    check(fuzz_server, http, "/v1/chat/completions", {**CHAT, "response_format": fmt})


@FUZZ
@given(regex=REGEXES, where=st.sampled_from(["guided_regex", "structured_outputs"]))
# Compiles, then passes the grammar engine's limits a few tokens in: 400, not 500.
@example(regex="a{1000}{1000}", where="guided_regex")
def test_hostile_regexes(
    fuzz_server: ServerThread, http: httpx.Client, regex: str, where: str
) -> None:
    value = regex if where == "guided_regex" else {"regex": regex}
    check(fuzz_server, http, "/v1/completions", {**COMPLETION, where: value})


@FUZZ
@given(choice=CHOICES, where=st.sampled_from(["guided_choice", "structured_outputs"]))
def test_hostile_choice_lists(
    fuzz_server: ServerThread, http: httpx.Client, choice: Any, where: str
) -> None:
    value = choice if where == "guided_choice" else {"choice": choice}
    response = check(fuzz_server, http, "/v1/chat/completions", {**CHAT, where: value})
    if response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "stop":
        assert response.json()["choices"][0]["message"]["content"] in choice


@FUZZ
@given(grammar=GRAMMARS, where=st.sampled_from(["guided_grammar", "structured_outputs"]))
def test_hostile_grammars(
    fuzz_server: ServerThread, http: httpx.Client, grammar: str, where: str
) -> None:
    value = grammar if where == "guided_grammar" else {"grammar": grammar}
    check(fuzz_server, http, "/v1/completions", {**COMPLETION, where: value})


@FUZZ
@given(
    tool_list=tools(),
    tool_choice=st.none() | TOOL_CHOICES,
    parallel=st.none() | st.booleans() | SCALARS,
)
def test_hostile_tools_and_tool_choice(
    fuzz_server: ServerThread, http: httpx.Client, tool_list: Any, tool_choice: Any, parallel: Any
) -> None:
    body: dict[str, Any] = {**CHAT, "tools": tool_list}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    check(fuzz_server, http, "/v1/chat/completions", body)


@FUZZ
@given(tool_choice=TOOL_CHOICES, stream=st.booleans())
def test_tool_choice_against_a_good_tool(
    fuzz_server: ServerThread, http: httpx.Client, tool_choice: Any, stream: bool
) -> None:
    body = {**CHAT, "tools": [GOOD_TOOL], "tool_choice": tool_choice, "stream": stream}
    response = check(fuzz_server, http, "/v1/chat/completions", body)
    if response.status_code == 200 and not stream and tool_choice == "required":
        choice = response.json()["choices"][0]
        if choice["finish_reason"] != "length":  # a constrained call that finished parses
            for call in choice["message"]["tool_calls"]:
                json.loads(call["function"]["arguments"])
