"""The front end's synchronous core: render -> register -> process outputs -> pass on.

``FrontendCore`` owns the live requests (by the caller's id), their engine ids,
the output processor and the pooled vectors not yet read. Every driver uses
it: the trio shell ``Frontend`` (which adds thread offload and the delivery
actor) for ``AsyncEngine``, and ``LLMEngine`` directly, in its own thread.

The life of a request here:

- ``begin`` holds the caller's id and gives the request an engine id;
- ``render`` turns the prompt into whole ``EngineRequest``s (and ``grammars``
  compiles their grammar states); both may block, so the shell may run them in
  a worker thread;
- ``register`` gives the request to the output processor, then to the engine
  core (``to_core``, with its grammar states beside it);
- ``process`` turns a step's ``EngineCoreOutputs`` into the slots' outputs and
  passes the finishes the output side decided (stop strings, aborts) back;
- ``release`` forgets it once its stream has ended.

Synchronous and never blocking except where a method says so; it never awaits
(the slots it fills are trio's, and wake their consumers). Never imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..metrics.records import StepStats
from ..outputs.output_processor import OutputProcessor, ProcessedStep
from ..outputs.sink import OutputSink
from ..protocol import messages as m
from ..protocol.errors import EngineDeadError, ValidationError
from ..protocol.params import LoRARequest, PoolingParams, SamplingParams
from ..protocol.request_ids import EngineIds
from ..scheduling.core_steps import AddRequests, FinishRequests, FrontendMessage
from .renderer import PromptType, RenderedPrompt, Renderer

if TYPE_CHECKING:
    from ..structured.grammar import GrammarState

SinkT = TypeVar("SinkT", bound=OutputSink)
"""The sink kind a driver gives ``begin``: the trio ``OutputSlot`` for every driver today."""


@dataclass(slots=True)
class LiveRequest(Generic[SinkT]):
    """One caller's request, from ``begin`` until its stream ends."""

    engine_id: str
    slot: SinkT
    registered: bool = False  # the output processor and the engine core know it
    abort_asked: bool = False  # abort() came while it was still being rendered


@dataclass(slots=True)
class RenderedRequest:
    """A prompt rendered into whole engine requests, and their grammar states."""

    rendered: RenderedPrompt
    requests: list[m.EngineRequest]
    grammars: dict[str, GrammarState]


class FrontendCore(Generic[SinkT]):
    """See the module docstring. ``to_core`` queues a message for the engine core
    (never blocks); ``record`` takes each step's output-side figures.

    Once ``fail_all`` has run (the engine died or shut down), nothing is sent
    to the engine core any more and ``begin`` raises that error.
    """

    def __init__(
        self,
        renderer: Renderer,
        processor: OutputProcessor,
        to_core: Callable[[FrontendMessage], None],
        record: Callable[[StepStats], None],
    ) -> None:
        self.renderer = renderer
        self.processor = processor
        self._to_core = to_core
        self._record = record
        self.live: dict[str, LiveRequest[SinkT]] = {}  # by the caller's id
        self._engine_ids = EngineIds()
        self._pooled: dict[str, list[float]] = {}  # engine id -> its vector, until taken
        self.failed: EngineDeadError | None = None

    # ------------------------------------------------------------ requests

    def begin(self, request_id: str, slot: SinkT) -> LiveRequest[SinkT]:
        """Hold ``request_id`` for a new request whose outputs go to ``slot``.

        Raises the engine's EngineDeadError once it failed, ValidationError for a
        live duplicate id. The caller must ``register`` or ``release`` it.
        """
        if self.failed is not None:
            raise self.failed
        if request_id in self.live:
            raise ValidationError("request_id", f"{request_id!r} is already running")
        live = self.live[request_id] = LiveRequest(self._engine_ids.next(request_id), slot)
        return live

    def render(
        self,
        renderer: Renderer,
        engine_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        prompt_text: str | None = None,
    ) -> tuple[RenderedPrompt, list[m.EngineRequest]]:
        """The prompt rendered by ``renderer`` (this core's, or a thread's own copy)
        into whole engine requests. Blocks (tokenizing); raises what the renderer
        raises (ValidationError naming the field)."""
        rendered = renderer.render_prompt(
            prompt, tokenization_kwargs=tokenization_kwargs, prompt_text=prompt_text
        )
        requests = renderer.make_requests(
            engine_id,
            rendered,
            params,
            priority=priority,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            lora_request=lora_request,
            pooling_params=pooling_params,
        )
        return rendered, requests

    def grammars(
        self, params: SamplingParams, requests: list[m.EngineRequest]
    ) -> dict[str, GrammarState]:
        """The grammar states of constrained requests (empty for the others). Blocks
        from microseconds to a second; ValidationError naming the constraint's field."""
        compiler = self.renderer.grammars
        if compiler is None or params.structured_outputs is None:
            return {}
        return compiler.compile(requests)

    def register(
        self,
        request_id: str,
        live: LiveRequest[SinkT],
        params: SamplingParams,
        done: RenderedRequest,
    ) -> None:
        """Give a rendered request to the output processor, then (with its grammar
        states beside it) to the engine core."""
        requests = done.requests
        self.processor.add_request(
            live.engine_id,
            done.rendered.text,
            requests[0].prompt_token_ids,
            params,
            requests[0].arrival_time,
            slot=live.slot,
            child_ids=[r.request_id for r in requests],
            output_id=request_id,
            lora_request=requests[0].lora_request,
        )
        live.registered = True
        self._to_core(AddRequests(requests, done.grammars))
        if live.abort_asked:
            self._pass_on(self.processor.abort_requests([live.engine_id]))

    def is_live(self, request_id: str, engine_id: str) -> bool:
        """Whether ``request_id`` is live as ``engine_id`` (not a later namesake)."""
        live = self.live.get(request_id)
        return live is not None and live.engine_id == engine_id

    def release(self, request_id: str, engine_id: str) -> None:
        """Forget a request whose stream has ended (only this one: not a later namesake)."""
        if self.is_live(request_id, engine_id):
            del self.live[request_id]

    def abort_quietly(self, request_id: str, engine_id: str) -> None:
        """The consumer left: forget the request and abort it in the engine core."""
        self.release(request_id, engine_id)
        if self.failed is None:
            self._pass_on(self.processor.abort_requests([engine_id]))

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort live requests (the caller's ids): each stream ends with a last output
        whose finish_reason is "abort". Unknown or finished ids are ignored; so is
        everything once the engine has failed."""
        if self.failed is not None:
            return
        engine_ids = []
        for request_id in request_ids:
            live = self.live.get(request_id)
            if live is None:
                continue
            if live.registered:
                engine_ids.append(live.engine_id)
            else:
                live.abort_asked = True
        self._pass_on(self.processor.abort_requests(engine_ids))

    def fail_all(self, error: EngineDeadError) -> None:
        """The engine died or shut down: every open stream raises ``error``; nothing
        more reaches the engine core. Idempotent (the first error stays)."""
        if self.failed is None:
            self.failed = error
        for live in list(self.live.values()):
            live.slot.put_error(error)

    def take_pooled(self, engine_id: str) -> list[float] | None:
        """The pooled vector of a finished embedding request, once; None if there is none."""
        return self._pooled.pop(engine_id, None)

    # ------------------------------------------------------------- outputs

    def process(self, outputs: m.EngineCoreOutputs) -> None:
        """One step's outputs into the slots; the finishes the output side decided
        (stop strings, a failed sibling) go back to the engine core."""
        step = self.processor.process_outputs(outputs)
        if step.pooled:  # read by encode() (or LLMEngine.step) when the request ends
            self._pooled.update(step.pooled)
        self._pass_on(step)

    def _pass_on(self, step: ProcessedStep) -> None:
        """Finish in the engine core what the output side finished, and record the figures."""
        if step.requests_to_stop:
            self._to_core(FinishRequests(step.requests_to_stop, m.FinishReason.STOP))
        if step.requests_to_abort:
            self._to_core(FinishRequests(step.requests_to_abort, m.FinishReason.ABORT))
        self._record(step.step_stats())
