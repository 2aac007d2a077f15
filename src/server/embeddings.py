"""OpenAI's ``POST /v1/embeddings``: the request body -> prompts and PoolingParams; vectors -> the response.

The body is OpenAI's: ``input`` is a string, a list of strings, a list of token
ids or a list of token-id lists; ``encoding_format`` is ``"float"`` (lists of
numbers, the default) or ``"base64"`` (each vector's little-endian float32
bytes, base64-encoded, as OpenAI's clients decode it); ``dimensions`` asks for
shorter vectors, which only a model trained for it (Matryoshka) can give, so
the caller says whether it may. vLLM's extras ``add_special_tokens``,
``normalize`` (L2, default true) and ``priority`` are understood. A known
field of the wrong type is a ``ValidationError`` naming it; unknown fields
are ignored.

Pure code: never imports trio or torch.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..protocol.errors import ValidationError
from ..protocol.params import PoolingParams
from .openai_protocol import MAX_PROMPTS, PromptInput
from .openai_schemas import check_bool, check_int, check_str, show

EncodingFormat = Literal["float", "base64"]


@dataclass
class EmbeddingRequest:
    """A parsed ``POST /v1/embeddings`` body."""

    model: str | None
    inputs: list[PromptInput]
    params: PoolingParams
    encoding_format: EncodingFormat = "float"
    add_special_tokens: bool = True
    priority: int = 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_inputs(value: object) -> list[PromptInput]:
    """OpenAI's ``input``: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise ValidationError(
            "input",
            "must be a non-empty string, list of strings, list of token ids or list of "
            f"token id lists, got {show(value)}",
        )
    if all(isinstance(v, str) for v in value):
        inputs: list[PromptInput] = list(value)
    elif all(_is_int(v) for v in value):
        inputs = [{"prompt_token_ids": list(value)}]
    elif all(isinstance(v, list) and v and all(_is_int(t) for t in v) for v in value):
        inputs = [{"prompt_token_ids": list(v)} for v in value]
    else:
        raise ValidationError(
            "input",
            "must be a string, a list of strings, a list of token ids or a list of token id lists",
        )
    if len(inputs) > MAX_PROMPTS:
        raise ValidationError(
            "input", f"at most {MAX_PROMPTS} inputs per request, got {len(inputs)}"
        )
    return inputs


def parse_embedding_request(
    body: Mapping[str, Any], *, hidden_size: int, matryoshka: bool = False
) -> EmbeddingRequest:
    """Validate an embeddings body. Raises ValidationError naming the field.

    ``dimensions`` is refused unless the model is ``matryoshka`` (it may then be
    at most ``hidden_size``) or it equals ``hidden_size``.
    """
    if body.get("input") is None:
        raise ValidationError("input", "is required")
    inputs = parse_inputs(body["input"])
    model = check_str("model", body["model"]) if body.get("model") is not None else None
    fmt: EncodingFormat
    given = body.get("encoding_format")
    if given is None or given == "float":
        fmt = "float"
    elif given == "base64":
        fmt = "base64"
    else:
        raise ValidationError("encoding_format", f'must be "float" or "base64", got {show(given)}')
    dimensions = None
    if body.get("dimensions") is not None:
        dimensions = check_int("dimensions", body["dimensions"])
        if dimensions < 1:
            raise ValidationError("dimensions", f"must be >= 1, got {dimensions}")
        if dimensions != hidden_size:
            if not matryoshka:
                raise ValidationError(
                    "dimensions",
                    f"this model gives {hidden_size}-dimensional embeddings and was not "
                    "trained to be shortened (Matryoshka)",
                )
            if dimensions > hidden_size:
                raise ValidationError("dimensions", f"must be <= {hidden_size}, got {dimensions}")
    if body.get("user") is not None:
        check_str("user", body["user"])
    add_special = body.get("add_special_tokens")
    priority = body.get("priority")
    normalize = body.get("normalize")
    return EmbeddingRequest(
        model=model,
        inputs=inputs,
        params=PoolingParams(
            task="embed",
            dimensions=dimensions if dimensions != hidden_size else None,
            normalize=True if normalize is None else check_bool("normalize", normalize),
        ),
        encoding_format=fmt,
        add_special_tokens=True
        if add_special is None
        else check_bool("add_special_tokens", add_special),
        priority=0 if priority is None else check_int("priority", priority),
    )


def encode_vector(vector: Sequence[float], encoding_format: EncodingFormat) -> list[float] | str:
    """A vector as the response carries it: the numbers, or base64 of little-endian float32."""
    if encoding_format == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embedding_response(
    model: str,
    vectors: Sequence[Sequence[float]],
    prompt_tokens: int,
    encoding_format: EncodingFormat,
) -> dict[str, Any]:
    """OpenAI's embeddings response (plus vLLM's ``id`` and ``created``)."""
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
