"""``EngineTokenizerCalls``: the engine's calls that need only its tokenizer and config
(tokenize, detokenize, render a chat, model info, the tokenizer itself). They work on a
dead engine too. A mixin of ``AsyncEngine``; never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import trio

from ..actors.frontend import Frontend
from ..config import EngineConfig
from ..frontend.renderer import Renderer
from ..protocol.client import ModelInfo, SupportedTask
from ..protocol.params import LoRARequest, check_lora_request


class EngineTokenizerCalls:
    """Mixin: the tokenizer's side of ``EngineClient``."""

    config: EngineConfig
    frontend: Frontend  # set at start-up
    renderer: Renderer  # set at start-up
    tokenizer: Any  # set at start-up

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.config.model or ""

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text`` (the base model's tokenizer). A checkpoint; a large
        text is tokenized in the front end's offload thread. Works on a dead engine too."""
        return await self.frontend.encode(text, add_special_tokens=add_special_tokens)

    async def detokenize(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``; ValidationError (field ``prompt_token_ids``) for ids
        outside the vocabulary. A checkpoint; many ids decode in the offload thread."""
        return await self.frontend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token, special tokens included. Synchronous and cheap (one
        token): for building logprob entries."""
        return self.renderer.decode([token_id], skip_special_tokens=False)

    def model_info(self) -> ModelInfo:
        tokens = self.renderer.tokenizer.special_tokens_map.items()
        special = {name: value for name, value in tokens if isinstance(value, str)}
        return ModelInfo(self.model_name, self.config.max_model_len, special)

    async def render_chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Chat messages as a ready prompt ``{"prompt", "prompt_token_ids"}`` for
        ``generate``, rendered with the chat template (``chat_template``, else the
        tokenizer's); ``tools`` and ``template_kwargs`` reach the template.

        A checkpoint. A large chat renders in a worker thread, so it never
        stalls other streams; cancelling the caller then drops the render (see
        ``Frontend.render_chat_prompt``). Bad messages or a failing template
        raise ValidationError naming the field. Works on a dead engine too: it
        is the tokenizer's work only.
        """
        return await self.frontend.render_chat_prompt(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            template_kwargs=template_kwargs,
        )

    async def get_tokenizer(self, lora_request: LoRARequest | None = None) -> Any:
        """The tokenizer requests are rendered with. A checkpoint.

        ``lora_request`` (vLLM's parameter) is accepted: an adapter runs with
        the base model's tokenizer here (adapters that add tokens are not
        served), so the answer is the same tokenizer. Anything but a
        LoRARequest or None raises ValidationError.
        """
        if lora_request is not None:
            check_lora_request(lora_request)
        await trio.lowlevel.checkpoint()
        return self.tokenizer

    async def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        """Generation and embeddings (pooled final hidden states) from the one model."""
        await trio.lowlevel.checkpoint()
        return ("generate", "embed")
