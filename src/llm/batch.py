"""``LLM``: generate (or embed) for many prompts at once, synchronously.

The async engine runs underneath, in a thread of its own (``EngineThread``, the
one ``legato.aio`` uses too): the model loads once and every call reuses it.
Each call crosses into the engine's thread with ``trio.from_thread`` and runs
its prompts there as concurrent requests; chat templates render there too, so
the event loop's tokenizer is never used from the caller's thread.

Never imports torch (the engine's worker process holds the model).
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import trio

from ..engine import AsyncEngine
from ..engine.thread import EngineThread
from ..frontend.renderer import PromptType
from ..protocol.errors import ValidationError
from ..protocol.outputs import PoolingRequestOutput, RequestOutput
from ..protocol.params import LoRARequest, PoolingParams, RequestOutputKind, SamplingParams

T = TypeVar("T")
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None


class LLM:
    """Generate for many prompts at once, synchronously.

    ``LLM(model=None, **engine_args)`` starts the engine (None: the default model,
    SmolLM2-135M-Instruct; "toy": the toy model). Call ``shutdown()`` (or use it
    as a context manager) to stop it; an ``LLM`` dropped without it is stopped
    when it is garbage-collected.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        # Offline, no first token is waited for: the step budget is chosen for throughput
        # (EngineConfig.budget_for) unless the caller says otherwise.
        engine_args = {"budget_for": "throughput", **engine_args}
        runner = EngineThread(model, engine_args, name="legato-llm")
        runner.start()
        # The async engine this LLM drives; it lives in the engine's thread.
        self.engine: AsyncEngine = runner.wait_ready()
        self._runner = runner
        self._finalizer = weakref.finalize(self, runner.stop)

    @property
    def _token(self) -> trio.lowlevel.TrioToken | None:
        return self._runner.token

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in the prompts' order.

        A progress bar is shown for more than 16 prompts unless ``use_tqdm=False``.
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("sampling_params: need one per prompt, or a single one")
        loras = _per_prompt(lora_request, len(prompt_list))

        async def one(i: int, request_id: str) -> RequestOutput | None:
            final = params_list[i].clone(output_kind=RequestOutputKind.FINAL_ONLY)
            result = None
            async with self.engine.generate(
                prompt_list[i], final, request_id, lora_request=loras[i]
            ) as stream:
                async for out in stream:
                    result = out
            return result

        show = len(prompt_list) > 16 if use_tqdm is None else use_tqdm
        return self._run_all(len(prompt_list), one, show, "generating")

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool | None = None,
        lora_request: LoRAArg = None,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt's final hidden states (see ``AsyncEngine.encode``); outputs
        in the prompts' order, each vector in ``outputs.data``."""
        prompt_list = _as_prompt_list(prompts)
        params = pooling_params if pooling_params is not None else PoolingParams()
        loras = _per_prompt(lora_request, len(prompt_list))

        async def one(i: int, request_id: str) -> PoolingRequestOutput | None:
            result = None
            async for out in self.engine.encode(
                prompt_list[i], params, request_id, lora_request=loras[i]
            ):
                result = out
            return result

        show = len(prompt_list) > 16 if use_tqdm is None else use_tqdm
        return self._run_all(len(prompt_list), one, show, "embedding")

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool | None = None,
        lora_request: LoRAArg = None,
    ) -> list[PoolingRequestOutput]:
        """Embeddings (task "embed"): ``encode``; each vector is also ``outputs.embedding``."""
        return self.encode(
            prompts,
            pooling_params or PoolingParams(task="embed"),
            use_tqdm=use_tqdm,
            lora_request=lora_request,
        )

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or to several (a list of
        them), as vLLM's ``LLM.chat``. ``tools`` (OpenAI's shape) and ``chat_template_kwargs``
        reach the chat template; constrain the reply with ``SamplingParams.structured_outputs``.
        """
        conversations: list[Sequence[Mapping[str, Any]]]
        if messages and isinstance(messages[0], Mapping):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        render = functools.partial(
            self.engine.render_chat_prompt,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            template_kwargs=chat_template_kwargs,
        )
        # On the engine's own thread (a large chat in its render thread): the event
        # loop's tokenizer is never used from this thread while the loop uses it.
        prompts: list[PromptType] = [self._call(render, c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (see ``AsyncEngine.add_lora``)."""
        return self._call(self.engine.add_lora, lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._call(self.engine.remove_lora, lora_id)

    def list_loras(self) -> set[int]:
        return self._call(self.engine.list_loras)

    def pin_lora(self, lora_id: int) -> bool:
        return self._call(self.engine.pin_lora, lora_id)

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def _run_all(
        self,
        count: int,
        run_one: Callable[[int, str], Awaitable[T | None]],
        show_progress: bool,
        desc: str,
    ) -> list[T]:
        return trio.from_thread.run(
            self._run_all_async, count, run_one, show_progress, desc, trio_token=self._token
        )

    async def _run_all_async(
        self,
        count: int,
        run_one: Callable[[int, str], Awaitable[T | None]],
        show_progress: bool,
        desc: str,
    ) -> list[T]:
        """Run ``run_one(i, request_id)`` for every prompt; a prompt that fails raises
        its own error.

        On a failure the other requests are aborted, and the error is raised
        as it is (a ValidationError for a bad prompt), never wrapped in a group.
        """
        from tqdm import tqdm

        results: list[T | None] = [None] * count
        errors: dict[int, Exception] = {}
        batch = f"llm-{time.monotonic_ns()}"
        bar = tqdm(total=count, desc=desc, disable=not show_progress)

        # Never more at once than the engine admits (max_live_requests).
        limiter = trio.CapacityLimiter(self.engine.config.max_live_requests)

        async def one(i: int, cancel: trio.CancelScope) -> None:
            try:
                async with limiter:
                    results[i] = await run_one(i, f"{batch}-{i}")
            except Exception as exc:
                errors[i] = exc
                cancel.cancel()
                return
            bar.update(1)

        try:
            async with trio.open_nursery() as nursery:
                for i in range(count):
                    nursery.start_soon(one, i, nursery.cancel_scope)
        finally:
            bar.close()
        if errors:
            raise errors[min(errors)]
        return [r for r in results if r is not None]

    def shutdown(self) -> None:
        """Stop the engine and its thread. Idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _per_prompt(lora_request: LoRAArg, count: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a list of them."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValidationError("lora_request", "need one per prompt, or a single one")
    return loras


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str) or isinstance(prompts, dict):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(x, int) for x in items):
        return [[int(x) for x in items]]  # type: ignore[arg-type]  # one prompt as token ids
    return items  # type: ignore[return-value]
