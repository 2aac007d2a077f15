"""Tokenizing for the server's own routes (``/tokenize``, ``/detokenize``, a request's
own chat template), off the event loop when the input is large.

Generation already renders large prompts in a thread (``actors.frontend``); these
routes follow the same rule with the same thresholds: text up to
``INLINE_MAX_PROMPT_CHARS`` characters or ``INLINE_MAX_PROMPT_TOKENS`` ids is
handled inline (cheaper than a thread hop), anything larger in one worker thread
with a tokenizer of its own (``thread_renderer``), one at a time.

Never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

from ..actors.frontend import INLINE_MAX_PROMPT_CHARS, INLINE_MAX_PROMPT_TOKENS, thread_renderer
from ..frontend.renderer import Renderer

_T = TypeVar("_T")


class TokenizerOffload:
    """Encodes and decodes for one server; large inputs in its worker thread."""

    def __init__(self) -> None:
        self._limiter = trio.CapacityLimiter(1)
        self._source: Renderer | None = None
        self._twin: Renderer | None = None

    async def encode(self, renderer: Renderer, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``. A checkpoint; large texts tokenize in the thread."""
        if len(text) <= INLINE_MAX_PROMPT_CHARS:
            await trio.lowlevel.checkpoint()
            return renderer.encode(text, add_special_tokens=add_special_tokens)
        return await self._offload(
            renderer, lambda twin: twin.encode(text, add_special_tokens=add_special_tokens)
        )

    async def decode(self, renderer: Renderer, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (ValidationError for ids outside the vocabulary)."""
        if len(token_ids) <= INLINE_MAX_PROMPT_TOKENS // 4:
            await trio.lowlevel.checkpoint()
            return renderer.decode(token_ids)
        return await self._offload(renderer, lambda twin: twin.decode(token_ids))

    async def _offload(self, renderer: Renderer, work: Callable[[Renderer], _T]) -> _T:
        def run() -> _T:
            if self._source is not renderer or self._twin is None:  # a restarted engine
                self._twin, self._source = thread_renderer(renderer), renderer
            return work(self._twin)

        return await trio.to_thread.run_sync(run, abandon_on_cancel=True, limiter=self._limiter)
