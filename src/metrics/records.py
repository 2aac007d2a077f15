"""What an engine step contributes to the metrics: ``StepStats`` and ``FinishedRequest``.

Both also answer to vLLM's names (``IterationStats`` and ``FinishedRequestStats``),
so a stat logger written for vLLM reads them unchanged.

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
    num_cached_tokens: int = 0


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

    # ---- vLLM's IterationStats names

    @property
    def iteration_timestamp(self) -> float:
        return self.timestamp

    @property
    def time_to_first_tokens_iter(self) -> list[float]:
        return self.time_to_first_token

    @property
    def inter_token_latencies_iter(self) -> list[float]:
        return self.inter_token_latency

    @property
    def finished_requests(self) -> list[FinishedRequest]:
        return self.finished

    @property
    def num_preempted_reqs(self) -> int:
        return 0 if self.scheduler is None else self.scheduler.num_preempted

    @property
    def waiting_lora_adapters(self) -> dict[str, int]:
        s = self.scheduler
        return {} if s is None or s.waiting_lora_adapters is None else s.waiting_lora_adapters

    @property
    def running_lora_adapters(self) -> dict[str, int]:
        s = self.scheduler
        return {} if s is None or s.running_lora_adapters is None else s.running_lora_adapters
