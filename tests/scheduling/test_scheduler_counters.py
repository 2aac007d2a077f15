"""The scheduler's figures: counts since the last report, and the block pool's deltas."""

from __future__ import annotations

from legato.scheduling.kv_cache import KVCacheManager
from legato.scheduling.scheduler_counters import SchedulerCounters


def test_a_report_gives_the_counts_since_the_last_one_and_starts_afresh() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=4, enable_prefix_caching=True)
    counters = SchedulerCounters()
    counters.preempted += 2
    counters.prefill_tokens += 30
    counters.decode_tokens += 5
    kv.prefix_cache_queries, kv.prefix_cache_hits = 40, 8
    first = counters.report(num_running=3, num_waiting=1, kv=kv)
    assert (first.num_running, first.num_waiting) == (3, 1)
    assert (first.num_preempted, first.num_prefill_tokens, first.num_decode_tokens) == (2, 30, 5)
    assert first.num_scheduled_tokens == 35
    assert (first.prefix_cache_queries, first.prefix_cache_hits) == (40, 8)
    assert first.num_blocks_total == kv.num_usable_blocks
    kv.prefix_cache_queries, kv.prefix_cache_hits = 50, 12  # the pool's totals only grow
    second = counters.report(num_running=0, num_waiting=0, kv=kv)
    assert (second.num_preempted, second.num_scheduled_tokens) == (0, 0)
    assert (second.prefix_cache_queries, second.prefix_cache_hits) == (10, 4)
