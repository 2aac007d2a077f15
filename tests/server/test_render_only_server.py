"""The same HTTP app over a ``RenderOnlyClient`` (no model) on loopback: it tokenizes and
renders as a server over the real engine does, and refuses to generate with a clear 501."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from legato import RenderOnlyClient
from legato.engine import AsyncEngine
from legato.server import ServerSettings, open_server

from .conftest import MODEL, SETTINGS, serving

CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ],
}


@pytest.fixture
def render_client(toy_model_dir: Path) -> RenderOnlyClient:
    return RenderOnlyClient(str(toy_model_dir), max_model_len=512)


@pytest.fixture
async def render_http(render_client: RenderOnlyClient) -> AsyncIterator[httpx.AsyncClient]:
    settings = ServerSettings(**SETTINGS)
    async with open_server(render_client, settings, model_name=MODEL) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as client:
            yield client


async def test_tokenize_and_detokenize(
    render_http: httpx.AsyncClient, render_client: RenderOnlyClient
) -> None:
    tokens = (await render_http.post("/tokenize", json={"prompt": "Hello world"})).json()
    assert tokens["tokens"] == await render_client.tokenize("Hello world")
    assert tokens["max_model_len"] == 512
    text = (await render_http.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
    assert text == {"prompt": "Hello world"}
    chat = (await render_http.post("/tokenize", json={"messages": CHAT["messages"]})).json()
    assert chat["tokens"] == render_client.render_chat(CHAT["messages"])["prompt_token_ids"]
    assert (await render_http.get("/health")).status_code == 200
    assert (await render_http.get("/v1/models")).json()["data"][0]["id"] == MODEL


async def test_renders_as_the_engine_server_does(
    render_http: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    async with serving(engine) as server:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as full:
            for path, body in [
                ("/v1/chat/completions/render", CHAT),
                ("/v1/completions/render", {"model": MODEL, "prompt": ["Hi", "Bye"]}),
                ("/v1/completions/render", {"model": MODEL, "prompt": [[5, 6, 7]]}),
            ]:
                ours = await render_http.post(path, json=body)
                theirs = await full.post(path, json=body)
                assert ours.status_code == theirs.status_code == 200, ours.text
                assert ours.json() == theirs.json()
    chat = (await render_http.post("/v1/chat/completions/render", json=CHAT)).json()
    conversation, (prompt,) = chat
    assert [m["role"] for m in conversation] == ["system", "user"]
    assert prompt["prompt"].endswith("<|im_start|>assistant\n")
    (ids,) = (await render_http.post("/v1/completions/render", json={"prompt": [5, 6]})).json()
    assert ids["prompt_token_ids"] == [5, 6] and ids["prompt"]
    (text,) = (await render_http.post("/v1/completions/render", json={"prompt": "Hi"})).json()
    assert text["prompt"] == "Hi" and text["prompt_token_ids"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions/render", {**CHAT, "temperature": -1}, "temperature"),
        ("/v1/chat/completions/render", {"messages": "x"}, "messages"),
        ("/v1/completions/render", {"prompt": [[10**9]]}, "prompt"),
        ("/v1/completions/render", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ],
)
async def test_bad_render_bodies_name_the_field(
    render_http: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    response = await render_http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
        ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": CHAT["messages"][1:]}),
        ("/v1/embeddings", {"input": "Hi"}),
    ],
)
async def test_generation_is_refused_clearly(
    render_http: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    response = await render_http.post(path, json=body)
    assert response.status_code == 501, response.text
    assert "only renders" in response.text and "/v1/chat/completions/render" in response.text
    assert (await render_http.get("/health")).status_code == 200  # and it keeps serving
