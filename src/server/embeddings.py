"""OpenAI's ``POST /v1/embeddings``: the request body -> prompts and PoolingParams; vectors -> the response.

The body is OpenAI's: ``input`` is a string, a list of strings, a list of token
ids or a list of token-id lists; ``encoding_format`` is ``"float"`` (lists of
numbers, the default) or ``"base64"`` (each vector's little-endian float32
bytes, base64-encoded, as OpenAI's clients decode it); ``dimensions`` asks for
shorter vectors, which only a model trained for it (Matryoshka) can give, so
the caller says whether it may. vLLM's extras ``add_special_tokens``,
``normalize`` (L2, default true) and ``priority`` are understood. A known
field of the wrong type is a ``ValidationError`` naming it; unknown fields
are ignored. The body's model is ``utility_protocol.EmbeddingRequest``.

Pure code: never imports trio or torch.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..protocol.params import PoolingParams
from .openai_protocol import PromptInput, parse_request
from .utility_protocol import EmbeddingRequest

EncodingFormat = Literal["float", "base64"]


@dataclass
class ParsedEmbedding:
    """A parsed ``POST /v1/embeddings`` body, with the engine's parameters."""

    model: str | None
    inputs: list[PromptInput]
    params: PoolingParams
    encoding_format: EncodingFormat = "float"
    add_special_tokens: bool = True
    priority: int = 0


def parse_embedding_request(
    body: object, *, hidden_size: int, matryoshka: bool = False
) -> ParsedEmbedding:
    """Validate an embeddings body (its model, ``EmbeddingRequest``, is the only parser).
    Raises ValidationError naming the field. ``dimensions`` is refused unless the model is
    ``matryoshka`` (it may then be at most ``hidden_size``) or it equals ``hidden_size``."""
    typed: EmbeddingRequest = parse_request(EmbeddingRequest, body)
    return ParsedEmbedding(
        model=typed.model,
        inputs=typed.inputs(),
        params=typed.pooling_params(hidden_size=hidden_size, matryoshka=matryoshka),
        encoding_format=typed.encoding_format or "float",
        add_special_tokens=typed.add_special_tokens is not False,
        priority=typed.priority or 0,
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
