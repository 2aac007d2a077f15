"""The OpenAPI document agrees with the pydantic models that validate requests; /docs is offline."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from legato.server.openai_protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ModelList,
)
from legato.server.openapi import Operation, docs_asset, docs_html, openapi_document

OPS = [
    Operation(
        "/v1/chat/completions",
        "post",
        "Chat",
        ChatCompletionRequest,
        ChatCompletionResponse,
        ChatCompletionChunk,
    ),
    Operation("/v1/models", "get", "Models", response=ModelList),
    Operation("/health", "get", "Health", response_type="text/plain", open=True),
]


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return openapi_document(OPS, title="legato", version="0.1.0")


def _validator(document: dict[str, Any], schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    resource = Resource.from_contents(document, default_specification=DRAFT202012)
    registry: Registry[Any] = Registry().with_resource("urn:doc", resource)
    ref = {"$ref": "urn:doc#" + schema["$ref"].removeprefix("#")}
    return jsonschema.Draft202012Validator(ref, registry=registry)


def test_every_ref_resolves(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None:
                assert ref.removeprefix("#/components/schemas/") in schemas, ref
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)
    assert document["openapi"] == "3.1.0"
    assert set(document["paths"]) == {"/v1/chat/completions", "/v1/models", "/health"}
    assert "security" not in document["paths"]["/health"]["get"]


def test_request_schema_agrees_with_validation(document: dict[str, Any]) -> None:
    op = document["paths"]["/v1/chat/completions"]["post"]
    validator = _validator(document, op["requestBody"]["content"]["application/json"]["schema"])
    good = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
        "structured_outputs": {"json": {"type": "object"}},
    }
    ChatCompletionRequest.model_validate(good)
    validator.validate(good)
    for bad in (
        {"messages": [{"role": "robot"}]},
        {"messages": [{"role": "user"}], "tool_choice": 3},
    ):
        assert not validator.is_valid(bad)


def test_docs_are_served_from_the_package() -> None:
    page = docs_html("/openapi.json", "/docs", "legato <x>")
    assert "/docs/swagger-ui-bundle.js" in page and "legato &lt;x&gt;" in page
    assert "http://" not in page and "https://" not in page  # nothing from outside
    script = docs_asset("swagger-ui-bundle.js")
    assert (
        script is not None and script[1].startswith("text/javascript") and len(script[0]) > 100_000
    )
    assert docs_asset("../../../etc/passwd") is None and docs_asset("index.j2") is None


def test_the_served_document_describes_the_agent_apis() -> None:
    """The bodies of /v1/responses, /v1/messages and the utility endpoints are documented by
    the models that parse them: a body the model accepts validates against the document's schema, one it refuses
    does not."""
    from legato.server.api_docs import OPERATIONS

    served = openapi_document(OPERATIONS, title="legato", version="0.1.0")
    for path, good, bad in (
        ("/v1/responses", {"input": [{"role": "user", "content": "hi"}]}, {"input": 3}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
         {"messages": [{"role": "system", "content": "hi"}]}),
        ("/tokenize", {"prompt": "hi"}, {"prompt": 3}),
        ("/detokenize", {"tokens": [1, 2]}, {"tokens": "x"}),
        ("/v1/embeddings", {"input": ["a", "b"]}, {"input": 3}),
    ):  # fmt: skip
        schema = served["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        validator = _validator(served, schema["schema"])
        assert validator.is_valid(good)
        assert not validator.is_valid(bad)
