"""The scheduler's figures for the metrics: counts since the last report, and the report.

``SchedulerCounters`` counts preemptions and scheduled prefill / decode tokens
as the scheduler works, and ``report`` turns them, with the queue lengths and
the block pool's figures, into one ``SchedulerStats`` (then starts counting
afresh). Pure Python; never imports torch or trio.
"""

from __future__ import annotations

from ..protocol.messages import SchedulerStats, SpecDecodingStats
from .kv_cache import KVCacheManager


class SchedulerCounters:
    """Counts since the previous ``report``."""

    __slots__ = (
        "preempted",
        "prefill_tokens",
        "decode_tokens",
        "spec",
        "_queries_base",
        "_hits_base",
    )

    def __init__(self) -> None:
        self.spec: SpecDecodingStats | None = None  # speculative decoding, once it verified
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
            spec_decoding=self.spec,
        )
        self.spec = None
        self._queries_base = kv.prefix_cache_queries
        self._hits_base = kv.prefix_cache_hits
        self.preempted = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        return stats

    def verified(self, num_drafts: int, num_accepted: int) -> None:
        """Count one request verified with ``num_drafts`` drafts, ``num_accepted`` of them
        accepted (the leading ones)."""
        spec = self.spec
        if spec is None:
            spec = self.spec = SpecDecodingStats()
        spec.num_drafts += 1
        spec.num_draft_tokens += num_drafts
        spec.num_accepted_tokens += num_accepted
        per_pos = spec.num_accepted_tokens_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1
