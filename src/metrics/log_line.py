"""``LoggingStatLogger``: the periodic log line (throughput, queues, KV usage, hit rate).

Never imports trio or torch.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from ..protocol.messages import SchedulerStats
from .logger_base import StepStatLogger
from .records import StepStats

logger = logging.getLogger("legato.stats")


class LoggingStatLogger(StepStatLogger):
    """The periodic log line, as vLLM's: throughput over the last interval, the
    queues, KV-cache usage and the prefix-cache hit rate."""

    def __init__(self, interval: float = 10.0, log: logging.Logger = logger) -> None:
        self.interval = interval
        self._log = log
        self._last_scheduler = SchedulerStats()
        self._window: deque[tuple[float, int, int]] = deque()  # (time, prompt, generation)
        self._prefix_window: deque[tuple[float, int, int]] = deque()
        self._spec_window: deque[tuple[float, int, int, int]] = deque()  # drafts, tokens, accepted

    def record_step(self, step: StepStats) -> None:
        s = step.scheduler
        if s is not None:
            self._last_scheduler = s
            self._prefix_window.append(
                (step.timestamp, s.prefix_cache_queries, s.prefix_cache_hits)
            )
            spec = s.spec_decoding
            if spec is not None:
                self._spec_window.append(
                    (
                        step.timestamp,
                        spec.num_drafts,
                        spec.num_draft_tokens,
                        spec.num_accepted_tokens,
                    )
                )
        if step.num_prompt_tokens or step.num_generation_tokens:
            self._window.append(
                (step.timestamp, step.num_prompt_tokens, step.num_generation_tokens)
            )
        self._trim(step.timestamp)

    def _trim(self, now: float) -> None:
        for dq in (self._window, self._prefix_window, self._spec_window):
            while dq and dq[0][0] < now - self.interval:
                dq.popleft()

    def line(self, now: float | None = None) -> str:
        """The figures over the last ``interval`` seconds, as one line."""
        self._trim(time.monotonic() if now is None else now)
        prompt = sum(p for _, p, _ in self._window)
        generated = sum(g for _, _, g in self._window)
        queries = sum(q for _, q, _ in self._prefix_window)
        hits = sum(h for _, _, h in self._prefix_window)
        s = self._last_scheduler
        hit_rate = 100.0 * hits / queries if queries else 0.0
        return (
            f"Avg prompt throughput: {prompt / self.interval:.1f} tokens/s, "
            f"Avg generation throughput: {generated / self.interval:.1f} tokens/s, "
            f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
            f"KV cache usage: {100.0 * s.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )

    def spec_line(self, now: float | None = None) -> str | None:
        """Speculative decoding over the last interval, as vLLM's SpecDecoding metrics
        line; None when nothing was verified."""
        self._trim(time.monotonic() if now is None else now)
        drafts = sum(d for _, d, _, _ in self._spec_window)
        if not drafts:
            return None
        tokens = sum(t for _, _, t, _ in self._spec_window)
        accepted = sum(a for _, _, _, a in self._spec_window)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted: {accepted} tokens, Drafted: {tokens} tokens, "
            f"Draft acceptance rate: {100.0 * accepted / tokens if tokens else 0.0:.1f}%"
        )

    def idle(self, now: float | None = None) -> bool:
        """Nothing computed over the last interval, and nothing running or waiting."""
        self._trim(time.monotonic() if now is None else now)
        s = self._last_scheduler
        return not self._window and not s.num_running and not s.num_waiting

    def log(self) -> None:
        """The line at info level, or at debug level while idle, as vLLM does ("avoid log
        noise on an idle production system")."""
        now = time.monotonic()
        level = logging.DEBUG if self.idle(now) else logging.INFO
        self._log.log(level, "%s", self.line(now))
        spec = self.spec_line(now)
        if spec is not None:
            self._log.log(level, "%s", spec)
