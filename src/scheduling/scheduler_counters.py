"""The scheduler's figures for the metrics: counts since the last report, and the report.

``SchedulerCounters`` counts preemptions and scheduled prefill / decode tokens
as the scheduler works, and ``report`` turns them, with the queue lengths and
the block pool's figures, into one ``SchedulerStats`` (then starts counting
afresh). Pure Python; never imports torch or trio.
"""

from __future__ import annotations

from ..protocol.messages import SchedulerStats
from .kv_cache import KVCacheManager


class SchedulerCounters:
    """Counts since the previous ``report``."""

    __slots__ = ("preempted", "prefill_tokens", "decode_tokens", "_queries_base", "_hits_base")

    def __init__(self) -> None:
        self.preempted = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self._queries_base = 0  # the block pool's totals at the previous report
        self._hits_base = 0

    def report(self, num_running: int, num_waiting: int, kv: KVCacheManager) -> SchedulerStats:
        """Current queue and cache figures, plus the counts since the previous report
        (prefix-cache queries / hits in tokens, preemptions, scheduled tokens)."""
        stats = SchedulerStats(
            num_running=num_running,
            num_waiting=num_waiting,
            kv_cache_usage=kv.usage,
            num_blocks_total=kv.num_usable_blocks,
            num_blocks_used=kv.num_used_blocks,
            prefix_cache_queries=kv.prefix_cache_queries - self._queries_base,
            prefix_cache_hits=kv.prefix_cache_hits - self._hits_base,
            num_preempted=self.preempted,
            num_scheduled_tokens=self.prefill_tokens + self.decode_tokens,
            num_prefill_tokens=self.prefill_tokens,
            num_decode_tokens=self.decode_tokens,
        )
        self._queries_base = kv.prefix_cache_queries
        self._hits_base = kv.prefix_cache_hits
        self.preempted = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        return stats
