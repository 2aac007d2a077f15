"""Each body is parsed once, by its pydantic model: the server on loopback counts the model
validations each request makes, and the hand checkers that used to run beside the models
are gone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from trio_websocket import open_websocket_url

from legato.server import Server, openai_schemas
from legato.server.openai_protocol import OpenAIModel

from .conftest import MODEL

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The class names of every top-level model validation from now on."""
    calls: list[str] = []
    original = OpenAIModel.model_validate.__func__  # type: ignore[attr-defined]

    def counting(cls: type[OpenAIModel], obj: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(cls.__name__)
        return original(cls, obj, *args, **kwargs)

    monkeypatch.setattr(OpenAIModel, "model_validate", classmethod(counting))
    yield calls


@pytest.mark.parametrize(
    ("path", "body", "model"),
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, "CompletionRequest"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, "ChatCompletionRequest"),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}, "ResponsesRequest"),
        ("/v1/messages", {"model": MODEL, "messages": CHAT, "max_tokens": 2}, "MessagesRequest"),
        ("/v1/messages/count_tokens", {"model": MODEL, "messages": CHAT}, "MessagesRequest"),
        ("/tokenize", {"prompt": "Hi"}, "TokenizeRequest"),
        ("/tokenize", {"messages": CHAT}, "TokenizeRequest"),
        ("/detokenize", {"tokens": [5, 6]}, "DetokenizeRequest"),
        ("/v1/embeddings", {"input": "Hi"}, "EmbeddingRequest"),
        ("/v1/chat/completions/render", {"messages": CHAT}, "ChatCompletionRequest"),
        ("/v1/completions/render", {"prompt": "Hi"}, "CompletionRequest"),
    ],
)
async def test_each_http_body_is_parsed_once(
    client: httpx.AsyncClient, validations: list[str], path: str, body: Any, model: str
) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert validations == [model]


async def test_a_websocket_generate_frame_is_parsed_once(
    server: Server, validations: list[str]
) -> None:
    frame = {"type": "generate", "request_id": "a", "prompt": "Hi", "params": {"max_tokens": 2}}
    async with open_websocket_url(server.ws_url + "/") as ws:
        await ws.send_message(json.dumps(frame))
        while not json.loads(await ws.get_message()).get("finished"):
            pass
    assert validations == ["GenerateFrame"]


def test_the_hand_checkers_are_gone() -> None:
    for name in ("check_int", "check_bool", "check_str", "check_ints", "parse_messages",
                 "request_fields", "REQUEST_FIELDS"):  # fmt: skip
        assert not hasattr(openai_schemas, name), name
