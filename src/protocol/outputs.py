"""What a caller receives: RequestOutput, CompletionOutput, Logprob, PoolingRequestOutput.

Shapes follow vLLM so consumers carry over. Never imports torch or trio.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One candidate token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the sampled token first, then the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic() seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    """One completion of a request (index < n)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One step's report on a request; ``finished`` is True on the last one only."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None
    metrics: RequestMetrics | None = None


@dataclass
class PoolingOutput:
    data: list[float] = field(default_factory=list)

    @property
    def embedding(self) -> list[float]:
        """The vector, under the name vLLM's EmbeddingOutput gives it."""
        return self.data


@dataclass
class PoolingRequestOutput:
    """The result of an ``encode`` request."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
