"""RenderOnlyClient: tokenizer, chat templates and detokenization without a model.

The GPU-less client: a front end that renders prompts (and counts tokens)
while the model runs elsewhere. It speaks EngineClient so it can stand where
an engine would, as vLLM's ``LaunchEngineClient``, a null object: ``generate``
and ``encode`` raise a clear NotImplementedError; every control call (pause,
sleep, profile, caches) does nothing, ``reset_prefix_cache`` answers True and
``add_lora`` False; it never stops or dies, so ``shutdown`` does nothing and
``dead_error`` is the RuntimeError vLLM's gives.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import trio

from .actors.frontend import (
    INLINE_MAX_PROMPT_CHARS,
    INLINE_MAX_PROMPT_TOKENS,
    chat_renders_inline,
    thread_renderer,
)
from .config import EngineConfig
from .config_views import VllmConfigViews
from .frontend.input_processor import InputProcessor
from .frontend.renderer import PromptType, RenderedPrompt, Renderer
from .protocol.client import (
    EngineClient,
    ModelInfo,
    OutputStream,
    PauseModeName,
    SupportedTask,
)
from .protocol.errors import EngineDeadError
from .protocol.outputs import PoolingRequestOutput
from .protocol.params import LoRARequest, PoolingParams, SamplingParams
from .tokenizer_loading import load_tokenizer
from .vllm_config import VllmConfig

_T = TypeVar("_T")


def _no_model(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what}: RenderOnlyClient has no model; use open_engine for inference"
    )


class RenderOnlyClient(VllmConfigViews, EngineClient):
    """Render prompts for a model. ``vllm_config``: vLLM's constructor argument, a
    ``VllmConfig`` (its model, tokenizer and max_model_len), or legato's shorthand, the
    model itself (a local HF directory or GGUF file; None: the default model, "toy":
    the toy model; see legato.model_source) with ``tokenizer`` / ``max_model_len``."""

    def __init__(
        self,
        vllm_config: VllmConfig | str | None = None,
        *,
        tokenizer: str | None = None,
        max_model_len: int | None = None,
    ):
        if isinstance(vllm_config, VllmConfig):
            model_config = vllm_config.model_config
            model: str | None = model_config.model
            tokenizer = tokenizer or model_config.tokenizer
            max_model_len = max_model_len or model_config.max_model_len
        else:
            model = vllm_config
        if tokenizer is None:
            from .model_source import resolve_model_source

            model = resolve_model_source(model).path
        path = tokenizer or model
        assert path is not None
        self.tokenizer = load_tokenizer(path)
        limit = (
            max_model_len
            or _max_positions(model)
            or int(getattr(self.tokenizer, "model_max_length", 0))
        )
        max_model_len = limit if 0 < limit < 10**9 else 2048
        self.config = EngineConfig(model=model, tokenizer=tokenizer, max_model_len=max_model_len)
        self.renderer = Renderer(
            self.tokenizer,
            max_model_len=max_model_len,
            vocab_size=len(self.tokenizer),
            eos_token_ids=[]
            if self.tokenizer.eos_token_id is None
            else [self.tokenizer.eos_token_id],
        )
        # vLLM's: the input processor renders for process_inputs; io_processor is what
        # get_io_processor gives a model with no IO plugin configured, None.
        self.input_processor = InputProcessor(self.renderer)
        self._thread_renderer: Renderer | None = None  # built on the first large chat
        self._offload_limiter = trio.CapacityLimiter(1)
        self.io_processor: None = None

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig) -> RenderOnlyClient:
        """vLLM's constructor: a client for ``vllm_config``'s model, tokenizer and
        max_model_len (legato.vllm_config; ``EngineArgs.create_engine_config()``)."""
        return cls(vllm_config)

    # ------------------------------------------------------------ configuration

    @property
    def vllm_config(self) -> VllmConfig:
        """vLLM's read-only view of the client's configuration (legato.vllm_config);
        ``model_config`` and the ``get_*_config`` calls derive from it (VllmConfigViews)."""
        return VllmConfig.of(self.config)

    # ------------------------------------------------------------ rendering

    def render(self, prompt: PromptType) -> RenderedPrompt:
        """Text and token ids of a prompt. Raises ValidationError for bad input."""
        return self.renderer.render_prompt(prompt)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> dict[str, Any]:
        """Chat messages as ``{"prompt", "prompt_token_ids"}`` via the chat template."""
        return self.renderer.render_chat_prompt(
            messages, add_generation_prompt=add_generation_prompt
        )

    async def render_chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """EngineClient's render: the chat as ``{"prompt", "prompt_token_ids"}``. A
        checkpoint; a large chat renders in a worker thread (with a tokenizer of its own,
        one render at a time), as the engine's front end does."""

        def render(renderer: Renderer) -> dict[str, Any]:
            return renderer.render_chat_prompt(
                messages,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
                template_kwargs=template_kwargs,
            )

        if chat_renders_inline(messages):
            await trio.lowlevel.checkpoint()
            return render(self.renderer)
        return await self._offload(render)

    async def _offload(self, work: Callable[[Renderer], _T]) -> _T:
        """``work`` with the worker thread's own renderer, one at a time (the rule of the
        engine's front end: a large input never holds the event loop)."""
        if self._thread_renderer is None:
            self._thread_renderer = thread_renderer(self.renderer)
        return await trio.to_thread.run_sync(
            work, self._thread_renderer, abandon_on_cancel=True, limiter=self._offload_limiter
        )

    def model_info(self) -> ModelInfo:
        tokens = self.tokenizer.special_tokens_map.items()
        special = {name: value for name, value in tokens if isinstance(value, str)}
        return ModelInfo(self.config.model or "", self.config.max_model_len, special)

    def metrics_text(self) -> bytes:
        """No engine runs here, so there is nothing to measure: an empty exposition."""
        return b""

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``. A checkpoint; a large text is tokenized in the worker
        thread, as the engine does."""
        if len(text) > INLINE_MAX_PROMPT_CHARS:
            return await self._offload(
                lambda r: r.encode(text, add_special_tokens=add_special_tokens)
            )
        await trio.lowlevel.checkpoint()
        return self.renderer.encode(text, add_special_tokens=add_special_tokens)

    async def detokenize(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``. A checkpoint; many ids decode in the worker thread."""
        if len(token_ids) > INLINE_MAX_PROMPT_TOKENS // 4:
            return await self._offload(
                lambda r: r.decode(token_ids, skip_special_tokens=skip_special_tokens)
            )
        await trio.lowlevel.checkpoint()
        return self.renderer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.renderer.decode([token_id], skip_special_tokens=False)

    async def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        return ("render",)

    # ------------------------------------------------------ EngineClient

    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False

    @property
    def dead_error(self) -> EngineDeadError:
        """A RuntimeError (EngineDeadError is one), with vLLM's LaunchEngineClient's message."""
        return EngineDeadError("RenderOnlyClient does not support inference")

    async def get_tokenizer(self, lora_request: LoRARequest | None = None) -> Any:
        """The tokenizer prompts are rendered with (adapters share it). A checkpoint."""
        await trio.lowlevel.checkpoint()
        return self.tokenizer

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **_: Any,
    ) -> OutputStream:
        raise _no_model("generate")

    def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> AsyncIterator[PoolingRequestOutput]:
        raise _no_model("encode")

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        await trio.lowlevel.checkpoint()  # nothing runs here, so nothing to abort

    async def check_health(self) -> None:
        await trio.lowlevel.checkpoint()

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        await trio.lowlevel.checkpoint()

    async def start_profile(self) -> None:
        await trio.lowlevel.checkpoint()  # nothing runs here, so nothing to profile

    async def stop_profile(self) -> None:
        await trio.lowlevel.checkpoint()

    async def reset_mm_cache(self) -> None:
        await trio.lowlevel.checkpoint()

    async def reset_encoder_cache(self) -> None:
        await trio.lowlevel.checkpoint()

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """True: there is no prefix cache, so it is empty."""
        await trio.lowlevel.checkpoint()
        return True

    async def sleep(self, level: int = 1, mode: PauseModeName = "abort") -> None:
        await trio.lowlevel.checkpoint()  # no accelerator memory to free

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await trio.lowlevel.checkpoint()

    async def is_sleeping(self) -> bool:
        return False

    async def add_lora(self, lora_request: Any) -> bool:
        """False: no model, so no adapter is loaded."""
        await trio.lowlevel.checkpoint()
        return False

    async def pause_generation(
        self,
        *,
        mode: PauseModeName = "abort",
        wait_for_inflight_requests: bool = False,
        clear_cache: bool = True,
    ) -> None:
        await trio.lowlevel.checkpoint()  # nothing generates here

    async def resume_generation(self) -> None:
        await trio.lowlevel.checkpoint()

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        """Nothing to stop: the client holds no process or task."""


def _max_positions(model: str | None) -> int:
    if model is None:
        return 0
    try:
        with open(os.path.join(model, "config.json")) as f:
            return int(json.load(f).get("max_position_embeddings") or 0)
    except (OSError, ValueError):
        return 0
