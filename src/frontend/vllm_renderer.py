"""vLLM's ``BaseRenderer`` calls on legato's ``Renderer``, and the parameters they take.

Code written for vLLM reads ``engine.renderer`` and calls ``get_tokenizer()``,
``render_cmpl(prompts, tok_params)`` and ``render_chat(conversations,
chat_params, tok_params)``; their engine prompts (``{"type": "token",
"prompt_token_ids", "prompt", "arrival_time"}``) go to ``generate``. This
mixin gives legato's ``Renderer`` those calls, vLLM's ``ChatParams`` and
``TokenizeParams`` (the fields legato applies), and the multimodal cache's
calls as the null objects they are for a text-only model (``clear_mm_cache``,
``stat_mm_cache`` -> None, ``mm_processor_cache`` -> None).

Where legato differs: embeddings (``bytes`` prompts) and encoder/decoder prompts
are refused (ValidationError) as everywhere in legato; ``TokenizeParams``
padding is refused by name; a prompt longer than ``max_input_tokens`` is a
``PromptTooLongError`` (vLLM's is a ``VLLMValidationError``; both ValueErrors).
``render_prompt`` stays legato's (a ``RenderedPrompt``); vLLM's is the first,
internal step of ``render_cmpl`` and returns its input dict.

Never imports trio or torch: the ``*_async`` forms are coroutines that do no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..protocol.errors import PromptTooLongError, ValidationError

Conversation = list[dict[str, Any]]


@dataclass(frozen=True)
class ChatParams:
    """vLLM's ``ChatParams``: how chat messages are rendered. ``chat_template_kwargs``
    reach the template (``add_generation_prompt`` and ``tools`` included, as vLLM's)."""

    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenizeParams:
    """vLLM's ``TokenizeParams``: how prompts are tokenized and checked.

    ``truncate_prompt_tokens`` keeps the last N tokens (-1: ``max_input_tokens``),
    as vLLM does for a tokenizer truncating on the left (its default);
    ``pad_prompt_tokens`` is not supported (ValueError when set)."""

    max_total_tokens: int | None
    max_output_tokens: int = 0
    pad_prompt_tokens: int | None = None
    truncate_prompt_tokens: int | None = None
    do_lower_case: bool = False
    add_special_tokens: bool = True
    needs_detokenization: bool = False

    def __post_init__(self) -> None:
        if self.pad_prompt_tokens is not None:
            raise ValueError("pad_prompt_tokens: padding prompts is not supported")
        total, output = self.max_total_tokens, self.max_output_tokens
        if total is not None and output > total:
            raise ValidationError(
                "max_output_tokens", f"{output} cannot be greater than max_total_tokens={total}"
            )

    @property
    def max_input_tokens(self) -> int | None:
        """Maximum allowed number of input tokens."""
        total = self.max_total_tokens
        return None if total is None else total - self.max_output_tokens


class VllmRendererCalls:
    """Mixin of ``Renderer``: vLLM's ``BaseRenderer`` calls (see the module docstring).

    Built on ``Renderer``'s own ``render_prompt``, ``render_chat_text`` and
    ``_check_ids`` (reached through ``_own``: this module cannot import that one)."""

    tokenizer: Any
    max_model_len: int

    @property
    def _own(self) -> Any:
        return self
    mm_processor: None = None  # text-only: no multimodal processor

    # ---------------------------------------------------------- the tokenizer

    def get_tokenizer(self) -> Any:
        """vLLM's: the tokenizer (a transformers tokenizer)."""
        return self.tokenizer

    def get_bos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "bos_token_id", None)

    def get_eos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None)

    # --------------------------------------------- the multimodal cache (none)

    @property
    def mm_processor_cache(self) -> None:
        return None

    def stat_mm_cache(self) -> None:
        """vLLM's: the multimodal cache's stats since the last call; None (no cache)."""
        return None

    def clear_mm_cache(self) -> None:
        """vLLM's: clear the multimodal processor cache; nothing to clear here."""

    async def clear_mm_cache_async(self) -> None:
        """vLLM's async form (the async variants here do no I/O: not checkpoints)."""

    def shutdown(self) -> None:
        """vLLM's: release the multimodal cache; nothing held here."""

    # ------------------------------------------------------------- rendering

    @property
    def default_cmpl_tok_params(self) -> TokenizeParams:
        return TokenizeParams(max_total_tokens=self.max_model_len, add_special_tokens=True)

    @property
    def default_chat_tok_params(self) -> TokenizeParams:
        return TokenizeParams(max_total_tokens=self.max_model_len, add_special_tokens=False)

    def render_cmpl(
        self,
        prompts: Sequence[Mapping[str, Any] | bytes],
        tok_params: TokenizeParams | None = None,
        *,
        prompt_extras: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """vLLM's: text or token prompts (``{"prompt": ...}`` / ``{"prompt_token_ids":
        ...}``) -> engine prompts for ``generate``. Raises ValidationError (a ValueError)."""
        if len(prompts) == 0:
            raise ValueError("You must pass at least one prompt")
        params = tok_params or self.default_cmpl_tok_params
        arrival = time.time()
        return [self._engine_prompt(p, params, arrival, prompt_extras) for p in prompts]

    async def render_cmpl_async(
        self,
        prompts: Sequence[Mapping[str, Any] | bytes],
        tok_params: TokenizeParams | None = None,
        *,
        prompt_extras: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        return self.render_cmpl(prompts, tok_params, prompt_extras=prompt_extras)

    def render_vllm_chat(
        self,
        conversations: Sequence[Sequence[Mapping[str, Any]]],
        chat_params: ChatParams,
        tok_params: TokenizeParams | None = None,
        *,
        prompt_extras: dict[str, Any] | None = None,
    ) -> tuple[list[Conversation], list[dict[str, Any]]]:
        """vLLM's ``render_chat``: each conversation through the chat template, then
        tokenized (without adding special tokens: the template writes them). Returns
        the conversations and their engine prompts."""
        params = tok_params or self.default_chat_tok_params
        kwargs = dict(chat_params.chat_template_kwargs)
        generation = bool(kwargs.pop("add_generation_prompt", True))
        tools = kwargs.pop("tools", None)
        arrival = time.time()
        out: list[Conversation] = []
        engine_prompts = []
        for conversation in conversations:
            text = self._own.render_chat_text(
                conversation,
                add_generation_prompt=generation,
                chat_template=chat_params.chat_template,
                tools=tools,
                template_kwargs=kwargs,
            )
            out.append([dict(message) for message in conversation])
            prompt = {"prompt": text}
            engine_prompts.append(self._engine_prompt(prompt, params, arrival, prompt_extras))
        return out, engine_prompts

    async def render_chat_async(
        self,
        conversations: Sequence[Sequence[Mapping[str, Any]]],
        chat_params: ChatParams,
        tok_params: TokenizeParams | None = None,
        *,
        prompt_extras: dict[str, Any] | None = None,
    ) -> tuple[list[Conversation], list[dict[str, Any]]]:
        return self.render_vllm_chat(
            conversations, chat_params, tok_params, prompt_extras=prompt_extras
        )

    def _engine_prompt(
        self,
        prompt: Mapping[str, Any] | bytes,
        params: TokenizeParams,
        arrival_time: float,
        extras: dict[str, Any] | None,
    ) -> dict[str, Any]:
        if isinstance(prompt, bytes | bytearray):
            raise ValidationError("prompt_embeds", "embedding prompts are not supported")
        if not isinstance(prompt, Mapping):
            raise ValidationError("prompt", "render_cmpl takes dict prompts (TextPrompt, TokensPrompt)")
        if "prompt_token_ids" in prompt:
            ids: list[int] = self._own._check_ids(prompt["prompt_token_ids"])
            text = prompt.get("prompt")
        else:
            text = prompt.get("prompt")
            if not isinstance(text, str):
                raise ValidationError("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
            if params.do_lower_case:
                text = text.lower()
            kwargs = {"add_special_tokens": params.add_special_tokens}
            ids = self._own.render_prompt({"prompt": text}, tokenization_kwargs=kwargs).token_ids
        ids = self._fit(ids, params)
        if text is None and params.needs_detokenization:
            text = str(self.tokenizer.decode(ids))
        out: dict[str, Any] = {"type": "token", "prompt_token_ids": ids}
        if text is not None:
            out["prompt"] = text
        if prompt.get("cache_salt"):
            out["cache_salt"] = prompt["cache_salt"]
        out.update(extras or {})
        out["arrival_time"] = arrival_time
        return out

    @staticmethod
    def _fit(ids: list[int], params: TokenizeParams) -> list[int]:
        """vLLM's truncation (keep the last N) and length check."""
        keep, limit = params.truncate_prompt_tokens, params.max_input_tokens
        if keep is not None and keep < 0:
            keep = limit
        if keep is not None and keep < len(ids):
            ids = ids[-keep:] if keep else []
        if limit is not None and len(ids) > limit:
            raise PromptTooLongError(
                "prompt",
                f"You passed {len(ids)} input tokens and requested {params.max_output_tokens} "
                f"output tokens. However, the model's context length is only "
                f"{params.max_total_tokens} tokens, resulting in a maximum input length of "
                f"{limit} tokens. Please reduce the length of the input prompt.",
            )
        return ids
