"""Offline inference: ``LLM`` (batch generate) and ``LLMEngine`` (add_request / step).

``LLM`` is synchronous and runs the async engine underneath: a background
thread owns a trio run with an open engine (worker process included), so the
model loads once and every ``generate`` call reuses it. ``LLMEngine`` is the
step-wise engine of vLLM: the same renderer, scheduler, model runner and
detokenizer, driven synchronously in this thread, one ``step()`` at a time.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from .actors.detokenizer import OutputProcessor
from .actors.output_slot import OutputSlot
from .actors.renderer import PromptType, Renderer, load_tokenizer
from .actors.scheduler import Scheduler
from .config import EngineConfig
from .protocol import messages as m
from .protocol.outputs import RequestOutput
from .protocol.params import RequestOutputKind, SamplingParams
from .structured.engine import EngineGrammars


class LLM:
    """Generate for many prompts at once, synchronously.

    ``LLM(model=None, **engine_args)`` starts the engine (None: the default model,
    SmolLM2-135M-Instruct; "toy": the toy model). Call ``shutdown()`` (or use it
    as a context manager) to stop it.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self._calls: (
            trio.MemorySendChannel[tuple[Callable[..., Any], tuple[Any, ...], Any]] | None
        ) = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._main, args=(model, engine_args), name="legato-llm", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def _main(self, model: str | None, engine_args: dict[str, Any]) -> None:
        from .engine import open_engine

        async def serve() -> None:
            try:
                async with open_engine(model, **engine_args) as engine:
                    self.engine = engine
                    self._stop = trio.Event()
                    self._token = trio.lowlevel.current_trio_token()
                    self._ready.set()
                    await self._stop.wait()
            except BaseException as exc:
                if not self._ready.is_set():
                    self._startup_error = exc
                    self._ready.set()
                    return
                raise

        trio.run(serve)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in the prompts' order.

        A progress bar is shown for more than 16 prompts unless ``use_tqdm=False``.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("sampling_params: need one per prompt, or a single one")
        show = len(prompt_list) > 16 if use_tqdm is None else use_tqdm
        return trio.from_thread.run(
            self._generate_all, prompt_list, params_list, show, trio_token=self._token
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
        renderer = self.engine.renderer
        prompts: list[PromptType] = [
            renderer.render_chat_prompt(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
                template_kwargs=chat_template_kwargs,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    async def _generate_all(
        self, prompts: list[PromptType], params: list[SamplingParams], show_progress: bool
    ) -> list[RequestOutput]:
        """Run every prompt; a prompt that fails raises its own error.

        On a failure the other requests are aborted, and the error is raised
        as it is (a ValidationError for a bad prompt), never wrapped in a group.
        """
        from tqdm import tqdm

        results: list[RequestOutput | None] = [None] * len(prompts)
        errors: dict[int, Exception] = {}
        batch = f"llm-{time.monotonic_ns()}"
        bar = tqdm(total=len(prompts), desc="generating", disable=not show_progress)

        async def one(i: int, cancel: trio.CancelScope) -> None:
            final = params[i].clone(output_kind=RequestOutputKind.FINAL_ONLY)
            try:
                async with self.engine.generate(prompts[i], final, f"{batch}-{i}") as stream:
                    async for out in stream:
                        results[i] = out
            except Exception as exc:
                errors[i] = exc
                cancel.cancel()
                return
            bar.update(1)

        try:
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i, nursery.cancel_scope)
        finally:
            bar.close()
        if errors:
            raise errors[min(errors)]
        return [r for r in results if r is not None]

    def shutdown(self) -> None:
        """Stop the engine and its thread. Idempotent."""
        if self._token is not None and self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(timeout=30)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str) or isinstance(prompts, dict):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(x, int) for x in items):
        return [[int(x) for x in items]]  # type: ignore[arg-type]  # one prompt as token ids
    return items  # type: ignore[return-value]


class LLMEngine:
    """vLLM's step-wise engine: ``add_request``, ``step``, ``abort_request``.

    Everything runs in the calling thread; the model runs in this process.
    """

    def __init__(self, config: EngineConfig) -> None:
        from .engine import resolve_model
        from .models.runner import ModelRunner

        config = resolve_model(config)
        self.runner = ModelRunner(config)
        blocks = self.runner.num_kv_blocks
        max_len = min(self.runner.max_model_len, (blocks - 1) * config.block_size)  # block 0: null
        self.config = config.resolved(max_model_len=max_len, num_kv_blocks=blocks)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model or "")
        eos = list(self.runner.eos_token_ids)
        self.renderer = Renderer(
            self.tokenizer,
            max_model_len=self.config.max_model_len or 0,
            vocab_size=self.runner.vocab_size,
            eos_token_ids=eos,
            max_logprobs=config.max_logprobs,
        )
        self.grammars = EngineGrammars(self.tokenizer, self.runner.vocab_size, eos)
        self.renderer.grammars = self.grammars
        self.scheduler = Scheduler(self.config)
        self.processor = OutputProcessor(self.tokenizer)
        # Live requests by the caller's id: the engine id each runs under, and its slot.
        self._live: dict[str, tuple[str, OutputSlot]] = {}
        self._engine_ids = itertools.count(1)
        self._stats = m.SchedulerStats()

    @classmethod
    def from_engine_args(cls, model: str | None = None, **engine_args: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model=model, **engine_args))

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
        prompt_text: str | None = None,
    ) -> None:
        """Render and queue a request. Raises ValueError for bad input or a live duplicate id.

        ``tokenization_kwargs`` and ``prompt_text``: as for ``AsyncEngine.generate``.
        """
        if request_id in self._live:
            raise ValueError(f"request_id: {request_id!r} is already running")
        params = params or SamplingParams()
        rendered = self.renderer.render_prompt(
            prompt, tokenization_kwargs=tokenization_kwargs, prompt_text=prompt_text
        )
        engine_id = f"{request_id}-{next(self._engine_ids)}"
        requests = self.renderer.make_requests(
            engine_id, rendered, params, priority=priority, arrival_time=arrival_time
        )
        self.grammars.compile(requests)  # ValidationError naming the field if it cannot
        slot = OutputSlot(params.output_kind)
        self.processor.add_request(
            engine_id,
            rendered.text,
            requests[0].prompt_token_ids,
            params,
            requests[0].arrival_time,
            slot=slot,
            child_ids=[r.request_id for r in requests],
            output_id=request_id,
        )
        self._live[request_id] = (engine_id, slot)
        for request in requests:
            self.scheduler.add_request(request)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests; each one's last output (finish_reason "abort") comes from the next step()."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        step = self.processor.abort_requests([self._live[i][0] for i in ids if i in self._live])
        self.scheduler.finish_requests(step.requests_to_abort, m.FinishReason.ABORT)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs it produced (finished ones included)."""
        plan = self.scheduler.schedule()
        if plan.total_num_scheduled_tokens > 0 or plan.finished_req_ids:
            requests = self.scheduler.requests
            plan.grammar_bitmask, failed = self.grammars.bitmasks(plan, requests)
            runner_out = self.runner.execute(plan)
            core_out = self.scheduler.update_from_output(plan, runner_out)
            failed.update(self.grammars.accept(core_out.outputs, requests))
            core_out.outputs += self.scheduler.fail(failed)
            if core_out.scheduler_stats is not None:
                self._stats = core_out.scheduler_stats
            step = self.processor.process_outputs(core_out)
            if step.requests_to_abort:
                self.scheduler.finish_requests(list(step.requests_to_abort), m.FinishReason.STOP)
        results = []
        for rid, (_, slot) in list(self._live.items()):
            out = slot.get_nowait()
            if out is None:
                continue
            results.append(out)
            if out.finished:
                del self._live[rid]
        return results

    def has_unfinished_requests(self) -> bool:
        return bool(self._live) or self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self._live)

    def get_metrics(self) -> dict[str, float]:
        s = self._stats
        return {
            "num_requests_running": s.num_running,
            "num_requests_waiting": s.num_waiting,
            "kv_cache_usage": s.kv_cache_usage,
            "kv_cache_blocks_used": s.num_blocks_used,
        }
