"""Size and count limits on what costs loop or GIL time per request (F2, F9, F14): each
is a 400 naming the field, and the server keeps answering."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from legato.engine import AsyncEngine
from legato.protocol.params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from legato.protocol.structured import SPEC_LIMITS
from legato.server.openai_protocol import MAX_TOOLS

from .conftest import MODEL, serving

BASE = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize(
    "route, body, param",
    [
        # F2: llguidance's sniffing regex is quadratic on blank lines and holds the GIL
        ("/v1/completions", {**BASE, "structured_outputs": {"grammar": "\n" * 200_000}},
         "structured_outputs.grammar"),
        ("/v1/completions", {**BASE, "structured_outputs": {"regex": "a" * 20_000}},
         "structured_outputs.regex"),
        # F9: stop strings are checked per step per sequence on the event loop
        ("/v1/completions", {**BASE, "stop": ["Z"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ("/v1/completions", {**BASE, "stop": ["Z" * (MAX_STOP_CHARS + 1)]}, "stop"),
        # F14: the duplicate check and the template grow with the tool count
        ("/v1/chat/completions", {**CHAT, "tools": [_tool(f"f{i}") for i in range(MAX_TOOLS + 1)]},
         "tools"),
        ("/v1/chat/completions", {**CHAT, "tools": [_tool("f"), _tool("g"), _tool("f")]}, "tools"),
    ],
)  # fmt: skip
async def test_a_costly_field_past_its_limit_is_a_400_naming_it(
    engine: AsyncEngine, route: str, body: dict[str, Any], param: str
) -> None:
    async with (
        serving(engine) as server,
        httpx.AsyncClient(base_url=server.http_url, timeout=60) as client,
    ):
        answer = await client.post(route, json=body)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param, answer.text
        assert (await client.get("/health")).status_code == 200


async def test_fields_at_their_limits_are_served(engine: AsyncEngine) -> None:
    grammar = 'root ::= "a"' + "\n" * (SPEC_LIMITS["grammar"] - 20)
    bodies = [
        ("/v1/completions", {**BASE, "structured_outputs": {"grammar": grammar}}),
        ("/v1/completions", {**BASE, "stop": ["Z" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}),
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [_tool(f"f{i}") for i in range(MAX_TOOLS)], "tool_choice": "none"},
        ),
    ]
    async with (
        serving(engine) as server,
        httpx.AsyncClient(base_url=server.http_url, timeout=60) as client,
    ):
        for route, body in bodies:
            answer = await client.post(route, json=body)
            assert answer.status_code == 200, answer.text
