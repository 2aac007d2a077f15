"""What an engine step contributes to the metrics: ``StepStats`` and ``FinishedRequest``.

Plain data; never imports trio or torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..protocol.messages import SchedulerStats


@dataclass
class FinishedRequest:
    """One request's life, reported once when it ends."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class StepStats:
    """What one engine step contributes to the metrics."""

    timestamp: float
    scheduler: SchedulerStats | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
