"""What the output processor keeps per request, and what one step of it hands back.

``RequestState`` is a caller's request (one id, one slot, n completions);
``CompletionState`` one completion of it (a scheduler-level request): its
tokens, text, logprobs, finish and this step's news. ``ProcessedStep`` is what
the front end must pass on after a step (stop-string finishes and aborts for
the scheduler, pooled vectors, figures for the metrics).

Plain data with the small rules that belong to it. Never imports trio or torch
(the slot type is only named for type checking).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..metrics.records import FinishedRequest, StepStats
from ..protocol.messages import EngineCoreOutput, FinishReason
from ..protocol.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestMetrics,
    SampleLogprobs,
)
from ..protocol.params import LoRARequest, SamplingParams
from .detokenizer import Detokenizer
from .stop_strings import partial_stop_length

if TYPE_CHECKING:
    from .sink import OutputSink

Shortcut = Callable[["CompletionState", EngineCoreOutput, float, "ProcessedStep"], bool]
"""Handles one output of a completion whole (True), or declines it for the general path."""


@dataclass
class FinishedRequestStats:
    """One scheduler-level request (a child, for n>1) that ended, for the metrics."""

    request_id: str
    parent_id: str
    finish_reason: FinishReason
    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time


@dataclass
class ProcessedStep:
    """What the engine must pass on after the detokenizer handled a step (or an abort).

    ``requests_to_stop`` / ``requests_to_abort``: scheduler-level ids
    (children for n>1) that are finished here but still live in the
    scheduler: finish them there as STOP (a stop string) / ABORT (an abort, a
    sibling's error). ``pooled``: the vectors of pooling requests that ended
    in this step. The rest is for the metrics.
    """

    requests_to_stop: list[str] = field(default_factory=list)
    requests_to_abort: list[str] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # by scheduler-level id
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)

    def step_stats(self) -> StepStats:
        """The front end's figures of this step, for the stats collector."""
        return StepStats(
            timestamp=time.monotonic(),
            num_generation_tokens=self.num_generation_tokens,
            time_to_first_token=self.time_to_first_token,
            inter_token_latency=self.inter_token_latency,
            finished=[
                FinishedRequest(
                    str(f.finish_reason),
                    f.e2e_latency,
                    f.num_prompt_tokens,
                    f.num_generation_tokens,
                )
                for f in self.finished
            ],
        )


@dataclass(eq=False)
class CompletionState:
    """One completion's state: a child request for n>1, else the request itself."""

    request_id: str
    index: int
    parent: RequestState
    detokenizer: Detokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    released: int = 0  # characters of text made visible to the consumer
    logprobs: SampleLogprobs | None = None  # everything so far; unused for DELTA
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # DELTA without stop strings: each piece of text goes straight to ``new_text``;
    # ``text`` stays "" (nothing is held back, and no output needs all of it).
    streams_text: bool = False
    # The way its ordinary steps go, chosen once when it is added: a plain completion
    # (DELTA, no stop strings, n = 1, no logprobs of either kind) takes
    # OutputProcessor._stream_plain, which handles a step whole or declines it (False);
    # None: every step takes the general path.
    shortcut: Shortcut | None = None
    # This step's news, set by the processor and consumed when outputs are built.
    has_news: bool = False  # new tokens, or finished, this step
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: SampleLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def release(self) -> None:
        """Make the settled text visible: all of it once finished, else all but a partial stop.

        (Nothing to do where ``streams_text``: its text is visible as it comes.)"""
        params = self.parent.params
        visible = len(self.text)
        if not self.finished and params.stop and not params.include_stop_str_in_output:
            visible -= partial_stop_length(self.text, params.stop)
        visible = max(visible, self.released)
        self.new_text += self.text[self.released : visible]
        self.released = visible

    def clear_news(self) -> None:
        self.has_news, self.new_text, self.new_token_ids, self.new_logprobs = False, "", [], None

    def take_delta(self) -> CompletionOutput:
        """This step's news as a DELTA output; the news is cleared."""
        # Positional arguments: this runs per stream per step, and keywords cost double.
        finish_reason = self.finish_reason
        new_logprobs = self.new_logprobs
        if new_logprobs is None and self.parent.params.logprobs is not None:
            new_logprobs = []
        output = CompletionOutput(
            self.index,
            self.new_text,
            self.new_token_ids,
            self.cumulative_logprob,
            new_logprobs,
            None if finish_reason is None else str(finish_reason),
            self.stop_reason,
            self.parent.lora_request,
        )
        self.clear_news()
        return output

    def cumulative_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text[: self.released],
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=None if self.finish_reason is None else str(self.finish_reason),
            stop_reason=self.stop_reason,
            lora_request=self.parent.lora_request,
        )


@dataclass(eq=False)
class RequestState:
    """A caller's request: one id, one slot, n completions.

    ``request_id`` is the id the engine runs it under; ``output_id`` the one
    its outputs carry (the caller's).
    """

    request_id: str
    output_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    slot: OutputSink
    completions: list[CompletionState] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False
    # The adapter it runs through: every output (and each completion) names it, as vLLM's.
    lora_request: LoRARequest | None = None

    @property
    def finished(self) -> bool:
        completions = self.completions
        if len(completions) == 1:  # the common case, per output: no generator
            return completions[0].finish_reason is not None
        return all(c.finish_reason is not None for c in completions)

    def metrics(self, finished_time: float | None) -> RequestMetrics:
        if len(self.completions) == 1:  # the common case, once per output: no lists
            (c,) = self.completions
            return RequestMetrics(
                self.arrival_time, None, c.first_token_time, c.last_token_time, finished_time
            )
        first = [c.first_token_time for c in self.completions if c.first_token_time is not None]
        last = [c.last_token_time for c in self.completions if c.last_token_time is not None]
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_token_time=min(first, default=None),
            last_token_time=max(last, default=None),
            finished_time=finished_time,
        )
