"""The bodies of the endpoints around generation as pydantic models: ``/tokenize``,
``/detokenize``, ``/v1/embeddings`` and the LoRA routes.

The same rules as ``openai_protocol``: strict types, unknown fields ignored,
``null`` means "not given", errors naming the field as the client wrote it. Each
model is the only parser of its body (no hand checks beside it).

Pure code: never imports trio or torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ..protocol.errors import ValidationError
from ..protocol.params import PoolingParams
from .openai_protocol import (
    ChatMessage,
    Int64,
    OpenAIModel,
    Prompt,
    PromptInput,
    PromptItems,
    one_kind_of_prompt,
)


class TokenizeRequest(OpenAIModel):
    """``POST /tokenize``: ``prompt`` (text) or ``messages`` (a chat, rendered first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None

    def chat(self) -> list[dict[str, Any]] | None:
        """The messages as the chat template sees them (None: a text prompt)."""
        if self.messages is None:
            if self.prompt is None:
                raise ValidationError("prompt", "give 'prompt' or 'messages'")
            return None
        return [message.for_template() for message in self.messages]


class DetokenizeRequest(OpenAIModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[Int64]


class EmbeddingRequest(OpenAIModel):
    """``POST /v1/embeddings`` (and the WebSocket ``embed`` frame): OpenAI's fields and
    vLLM's extras ``add_special_tokens``, ``normalize`` (L2, default true), ``priority``."""

    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Int64 | None = Field(default=None, ge=1)
    user: str | None = None
    add_special_tokens: bool | None = None
    normalize: bool | None = None
    priority: Int64 | None = None

    @field_validator("input")
    @classmethod
    def _one_kind_of_input(cls, value: str | PromptItems) -> str | PromptItems:
        return one_kind_of_prompt(value, "inputs")

    def inputs(self) -> list[PromptInput]:
        """One engine prompt per input (token ids as ``{"prompt_token_ids"}``)."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if isinstance(value[0], int):
            return [{"prompt_token_ids": list(value)}]
        return [v if isinstance(v, str) else {"prompt_token_ids": v} for v in value]

    def pooling_params(self, *, hidden_size: int, matryoshka: bool = False) -> PoolingParams:
        """The engine's parameters. ``dimensions`` is refused unless the model is
        ``matryoshka`` (it may then be at most ``hidden_size``) or it equals
        ``hidden_size``."""
        dimensions = self.dimensions
        if dimensions is not None and dimensions != hidden_size:
            if not matryoshka:
                raise ValidationError(
                    "dimensions",
                    f"this model gives {hidden_size}-dimensional embeddings and was not "
                    "trained to be shortened (Matryoshka)",
                )
            if dimensions > hidden_size:
                raise ValidationError("dimensions", f"must be <= {hidden_size}, got {dimensions}")
        return PoolingParams(
            task="embed",
            dimensions=dimensions if dimensions != hidden_size else None,
            normalize=self.normalize is not False,
        )


class LoadLoRAAdapterRequest(OpenAIModel):
    """``POST /v1/load_lora_adapter``."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    """``POST /v1/unload_lora_adapter``."""

    lora_name: str
