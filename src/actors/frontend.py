"""The front end's trio shell: a caller's request from prompt to output slot, and back.

``Frontend`` wraps the synchronous ``FrontendCore`` (render -> register ->
process outputs -> pass on; see ``frontend_core``) with what needs trio:

- ``add_request`` runs in the caller's task. It renders the prompt (on the
  event-loop thread when it is small, in a worker thread when it is large, so
  a 100k-token prompt never stalls the other streams), compiles a grammar in
  a thread, and registers the request right there. Nothing else touches a
  request between the two.
- ``deliver`` is the output-delivery actor ("detokenizer"): it feeds each
  step's ``EngineCoreOutputs`` to the core, which fills the slots and hands
  the finishes it decides (stop strings, a failed sibling) back to the engine
  core.

``render_chat_prompt`` renders a chat template the same way (inline when the
chat is small, in the worker thread when it is large) for the server, which
then gives the rendered prompt to ``add_request``.

A request is known to the caller by its own id and below the front end by an
engine id (``request_ids``), so a caller's id is free again the moment its
stream ends, whatever is still in flight for the old one.

Imports trio; never torch.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from ..frontend.frontend_core import FrontendCore, LiveRequest, RenderedRequest
from ..frontend.renderer import PromptType, RenderedPrompt, Renderer
from ..metrics.records import StepStats
from ..outputs.output_processor import OutputProcessor
from ..protocol import messages as m
from ..protocol.errors import EngineGenerateError
from ..protocol.inputs import EngineCoreRequest
from ..protocol.params import LoRARequest, PoolingParams, SamplingParams
from ..scheduling.core_steps import FrontendMessage
from .output_slot import OutputSlot

if TYPE_CHECKING:
    from ..structured.grammar import GrammarState

_T = TypeVar("_T")

INLINE_MAX_PROMPT_CHARS = 4096
"""A text prompt longer than this is tokenized in a worker thread. Tokenizing
4,096 characters takes from a fraction of a millisecond (a byte-level BPE with
a pre-tokenizer) to about 10 ms (the toy tokenizer, which has none) on one
core; a thread hop costs some tens of microseconds. Below it, rendering on the
event-loop thread is cheaper than the hop and delays the other streams by at
most that much."""

INLINE_MAX_PROMPT_TOKENS = 16384
"""A prompt given as more token ids than this is checked in a worker thread
(about 1 ms of Python per 16k ids)."""


def renders_inline(prompt: PromptType | EngineCoreRequest) -> bool:
    """Whether ``prompt`` is small enough to render on the event-loop thread."""
    if isinstance(prompt, EngineCoreRequest):
        ids = prompt.prompt_token_ids
        return not isinstance(ids, Sequence) or len(ids) <= INLINE_MAX_PROMPT_TOKENS
    if isinstance(prompt, str):
        return len(prompt) <= INLINE_MAX_PROMPT_CHARS
    if isinstance(prompt, Mapping):
        ids = prompt.get("prompt_token_ids")
        if ids is not None:
            return not isinstance(ids, Sequence) or len(ids) <= INLINE_MAX_PROMPT_TOKENS
        text = prompt.get("prompt")
        return not isinstance(text, str) or len(text) <= INLINE_MAX_PROMPT_CHARS
    return not isinstance(prompt, Sequence) or len(prompt) <= INLINE_MAX_PROMPT_TOKENS


def chat_renders_inline(messages: object) -> bool:
    """Whether a chat is small enough to render on the event-loop thread.

    The measure is the characters of its messages' roles and contents (a
    string, or the text of each text part) against ``INLINE_MAX_PROMPT_CHARS``:
    the template's output is about that long and is tokenized whole. Counting
    the roles makes many empty messages count too. Not counted: the
    template's own text, ``tools`` and tool calls (bounded by the request
    body's size). Messages that are not a list of mappings render inline
    (an error to report: cheap).
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        return True
    total = 0
    for message in messages:
        if not isinstance(message, Mapping):
            return True
        role, content = message.get("role"), message.get("content")
        total += len(role) if isinstance(role, str) else 0
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, Mapping) else None
                total += len(text) if isinstance(text, str) else 0
        if total > INLINE_MAX_PROMPT_CHARS:
            return False
    return True


def thread_renderer(renderer: Renderer) -> Renderer:
    """A copy of ``renderer`` with a tokenizer of its own, for renders in a worker thread.

    A Hugging Face fast tokenizer keeps truncation settings on the shared Rust
    object and changes them per call (``tokenization_kwargs``), behind a lock:
    a call on the event-loop thread that changes them would wait for a long
    encode in a thread to finish, and two threads changing them would race.
    With its own copy, a thread render shares nothing with the event loop.
    Blocks (a deep copy of the tokenizer): call it in a thread.
    """
    twin = copy.copy(renderer)
    twin.tokenizer = copy.deepcopy(renderer.tokenizer)
    return twin


class Frontend:
    """The trio shell around ``FrontendCore`` for one engine: renders too large for
    the event-loop thread run in a worker thread, and ``deliver`` is the
    output-delivery actor.

    ``to_core`` queues a message for the engine core (never blocks);
    ``record`` takes each step's output-side figures; ``admit`` raises to refuse a
    new request before anything is held for it. Large renders run one at
    a time in a worker thread, through ``offload_renderer`` (default:
    ``thread_renderer(renderer)``, built on first use).

    All methods but ``add_request``, ``render_chat_prompt`` and ``deliver``
    are synchronous and never block. Once ``fail_all`` has run (the engine
    died or shut down), nothing is sent to the engine core any more and
    ``add_request`` raises that error.
    """

    def __init__(
        self,
        renderer: Renderer,
        processor: OutputProcessor,
        to_core: Callable[[FrontendMessage], None],
        record: Callable[[StepStats], None],
        *,
        offload_renderer: Renderer | None = None,
        admit: Callable[[], None] | None = None,
    ) -> None:
        self.core: FrontendCore[OutputSlot] = FrontendCore(renderer, processor, to_core, record)
        self._admit = admit
        self.renderer = renderer
        self.processor = processor
        self.offload_renderer = offload_renderer
        self._offload_limiter = trio.CapacityLimiter(1)
        # The core's synchronous operations, as they are.
        self.is_live = self.core.is_live
        self.release = self.core.release
        self.abort_quietly = self.core.abort_quietly
        self.abort = self.core.abort
        self.fail_all = self.core.fail_all
        self.take_pooled = self.core.take_pooled

    @property
    def num_live(self) -> int:
        return len(self.core.live)

    # ------------------------------------------------------------ requests

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType | EngineCoreRequest,
        params: SamplingParams,
        slot: OutputSlot,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        prompt_text: str | None = None,
    ) -> str:
        """Render the request and register it, in the caller's task; its engine id.

        A checkpoint. Either the request is registered (outputs reach ``slot``)
        or this raises and holds nothing (the id is free again): ValueError for
        a live duplicate ``request_id``, ``Cancelled`` if the caller is
        cancelled while a large prompt renders in its thread (the thread's
        result is dropped), the engine's EngineDeadError if it died meanwhile.
        A prompt that fails to render fails this request alone without
        raising: ``slot`` gets the ValueError (ValidationError), or
        EngineGenerateError for any other failure of the tokenizer, so the
        stream's first read raises it; the id stays held until the stream ends.
        ``admit`` (given at construction) may refuse the request before anything
        is held (``AsyncEngine.check_admission``: EngineBusyError).
        An ``abort`` while the prompt renders takes effect once it is registered.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        core = self.core
        if self._admit is not None:  # in the same synchronous stretch as begin: no race
            self._admit()
        live = core.begin(request_id, slot)
        engine_id = live.engine_id
        try:
            render = functools.partial(
                core.render,
                engine_id=engine_id,
                prompt=prompt,
                params=params,
                arrival_time=time.monotonic(),
                priority=priority,
                lora_request=lora_request,
                pooling_params=pooling_params,
                tokenization_kwargs=tokenization_kwargs,
                prompt_text=prompt_text,
            )
            done = await self._render(request_id, live, params, render, renders_inline(prompt))
            if core.failed is not None:  # died while the prompt was rendering
                raise core.failed
            if done is not None:
                core.register(request_id, live, params, done)
        except BaseException:
            core.release(request_id, engine_id)
            raise
        await trio.lowlevel.cancel_shielded_checkpoint()
        return engine_id

    async def _render(
        self,
        request_id: str,
        live: LiveRequest[OutputSlot],
        params: SamplingParams,
        render: Callable[..., tuple[RenderedPrompt, list[m.EngineRequest]]],
        inline: bool,
    ) -> RenderedRequest | None:
        """The rendered request with its grammar states, or None if it failed (the
        slot has the error). Only a large prompt or a grammar to compile checkpoints."""
        try:
            if inline:
                rendered, requests = render(renderer=self.renderer)
            else:
                rendered, requests = await trio.to_thread.run_sync(
                    self._render_offloaded,
                    lambda renderer: render(renderer=renderer),
                    abandon_on_cancel=True,
                    limiter=self._offload_limiter,
                )
            grammars: dict[str, GrammarState] = {}
            if self.renderer.grammars is not None and params.structured_outputs is not None:
                # Compiling may take from microseconds to a second: off the event loop.
                grammars = await trio.to_thread.run_sync(self.core.grammars, params, requests)
                await trio.lowlevel.checkpoint_if_cancelled()
        except ValueError as exc:
            live.slot.put_error(exc)
            return None
        except Exception as exc:
            # The caller sees the kind of failure; the detail (paths, internals) is logged.
            logging.getLogger("legato.engine").warning(
                "request %s: rendering failed", request_id, exc_info=exc
            )
            error = EngineGenerateError(request_id, f"rendering failed: {type(exc).__name__}")
            error.__cause__ = exc
            live.slot.put_error(error)
            return None
        return RenderedRequest(rendered, requests, grammars)

    async def render_chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``Renderer.render_chat_prompt`` in the caller's task: the chat as a ready
        prompt ``{"prompt", "prompt_token_ids"}``. A checkpoint.

        A chat too large for the event-loop thread (``chat_renders_inline``)
        renders in a worker thread with the thread renderer, under the limiter
        of ``add_request``'s large prompts. Raises what the renderer raises
        (ValidationError naming the field: a bad message, a failing template);
        ``Cancelled`` if the caller is cancelled while the chat renders in its
        thread (the thread's result is dropped; it reads ``messages`` until it
        ends). Registers nothing, and works after ``fail_all`` too: it is the
        tokenizer's work only.
        """

        def render(renderer: Renderer) -> dict[str, Any]:
            return renderer.render_chat_prompt(
                messages,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
                template_kwargs=template_kwargs,
            )

        if not chat_renders_inline(messages):
            return await trio.to_thread.run_sync(
                self._render_offloaded,
                render,
                abandon_on_cancel=True,
                limiter=self._offload_limiter,
            )
        await trio.lowlevel.checkpoint_if_cancelled()
        prompt = render(self.renderer)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return prompt

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``, in the caller's task. A checkpoint; a text over
        ``INLINE_MAX_PROMPT_CHARS`` is tokenized in the offload thread (as a large prompt
        is), so it never holds the event loop."""
        if len(text) > INLINE_MAX_PROMPT_CHARS:
            return await self._offload(
                lambda r: r.encode(text, add_special_tokens=add_special_tokens)
            )
        await trio.lowlevel.checkpoint()
        return self.renderer.encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids`` (ValidationError for ids outside the vocabulary). A
        checkpoint; more than a quarter of ``INLINE_MAX_PROMPT_TOKENS`` ids decode in the
        offload thread."""
        if len(token_ids) > INLINE_MAX_PROMPT_TOKENS // 4:
            return await self._offload(
                lambda r: r.decode(token_ids, skip_special_tokens=skip_special_tokens)
            )
        await trio.lowlevel.checkpoint()
        return self.renderer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    async def _offload(self, work: Callable[[Renderer], _T]) -> _T:
        return await trio.to_thread.run_sync(
            self._render_offloaded, work, abandon_on_cancel=True, limiter=self._offload_limiter
        )

    def _render_offloaded(self, render: Callable[[Renderer], _T]) -> _T:
        """``render`` with the thread's own renderer. Runs in a worker thread, one at a time."""
        if self.offload_renderer is None:
            self.offload_renderer = thread_renderer(self.renderer)
        return render(self.offload_renderer)

    # ------------------------------------------------------------- outputs

    async def deliver(self, inbox: trio.MemoryReceiveChannel[m.EngineCoreOutputs]) -> None:
        """The output-delivery actor: each step's outputs into the slots
        (``FrontendCore.process``); a checkpoint after each step. Runs until
        cancelled (or until ``inbox`` closes)."""
        process = self.core.process
        async for outputs in inbox:
            process(outputs)
            await trio.lowlevel.checkpoint()
