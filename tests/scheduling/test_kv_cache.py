"""KVCacheManager: block pool, reference counts, LRU free queues, prefix-cache hashes."""

from __future__ import annotations

import itertools

import pytest

from legato.protocol.messages import EngineRequest
from legato.protocol.params import SamplingParams
from legato.scheduling.kv_cache import (
    NULL_BLOCK_ID,
    KVCacheManager,
    hash_block_tokens,
    root_block_hash,
)
from legato.scheduling.request_state import Request

_seq = itertools.count()


def make_request(
    request_id: str,
    tokens: list[int],
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> Request:
    engine_request = EngineRequest(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=None),
        arrival_time=0.0,
        lora_name=lora_name,
        cache_salt=cache_salt,
    )
    return Request(engine_request, next(_seq))


def compute(kv: KVCacheManager, req: Request, num_tokens: int) -> None:
    """Pretend a step computed ``num_tokens`` more tokens, then publish full blocks."""
    req.num_computed_tokens += num_tokens
    assert req.num_computed_tokens <= req.num_tokens
    kv.cache_full_blocks(req)


def admit(kv: KVCacheManager, req: Request) -> list[int]:
    """Prefix lookup plus allocation for the whole remaining prompt; returns the block table."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = num_hit
    return kv.get_block_ids(req.request_id)


def check_counts(kv: KVCacheManager) -> None:
    holders: dict[int, int] = {}
    for blocks in kv.holders().values():
        for block in blocks:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
    for block in kv.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0)
    assert NULL_BLOCK_ID not in holders
    assert kv.num_free_blocks + kv.num_used_blocks == kv.num_usable_blocks
    assert kv.num_used_blocks == len(holders)


PROMPT = list(range(100, 155))  # 55 tokens


def test_55_token_prompt_gets_4_blocks_and_3_hashes() -> None:
    kv = KVCacheManager(num_blocks=11, block_size=16, enable_prefix_caching=True)
    req = make_request("a", PROMPT)
    assert kv.get_computed_blocks(req) == ([], 0)
    assert kv.allocate_slots(req, 55) == [1, 2, 3, 4]
    compute(kv, req, 55)
    blocks = kv.get_blocks("a")
    assert len(req.block_hashes) == 3
    assert [b.block_hash for b in blocks[:3]] == req.block_hashes
    assert blocks[3].block_hash is None  # partial block: never hashed
    assert all(kv.lookup(h) is b for h, b in zip(req.block_hashes, blocks))
    assert kv.num_used_blocks == 4 and kv.usage == pytest.approx(0.4)
    check_counts(kv)


def test_shared_prefix_hits_three_blocks() -> None:
    kv = KVCacheManager(num_blocks=11, block_size=16, enable_prefix_caching=True)
    a = make_request("a", PROMPT)
    admit(kv, a)
    compute(kv, a, 55)
    b = make_request("b", PROMPT[:48] + [7, 8, 9, 10, 11])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 48
    assert hits == kv.get_blocks("a")[:3]
    new = kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert new == [5]
    assert [blk.ref_cnt for blk in kv.get_blocks("a")] == [2, 2, 2, 1]
    assert kv.get_block_ids("b") == [1, 2, 3, 5]
    assert kv.prefix_cache_queries == 55 + 53
    assert kv.prefix_cache_hits == 48
    check_counts(kv)


def test_eviction_order_after_free() -> None:
    kv = KVCacheManager(num_blocks=11, block_size=16, enable_prefix_caching=True)
    a = make_request("a", PROMPT)
    admit(kv, a)
    compute(kv, a, 55)
    b = make_request("b", PROMPT[:48] + [7, 8, 9, 10, 11])
    admit(kv, b)
    compute(kv, b, 5)
    kv.free(b)  # block 5 (plain) back; 1..3 still held by a
    assert [blk.ref_cnt for blk in kv.get_blocks("a")] == [1, 1, 1, 1]
    kv.free(a)
    check_counts(kv)
    # Never-used plain blocks first, then freed plain ones (tail first), then the
    # cached ones in LRU order: a's tail block before its head.
    assert kv.free_block_ids() == [6, 7, 8, 9, 10, 5, 4, 3, 2, 1]
    assert kv.num_cached_free_blocks == 3
    hashes = list(a.block_hashes)
    c = make_request("c", list(range(1000, 1000 + 16 * 8)))
    assert kv.allocate_slots(c, 16 * 8) == [6, 7, 8, 9, 10, 5, 4, 3]
    # Evicting block 3 dropped its hash; blocks 1 and 2 are still cached.
    assert kv.lookup(hashes[2]) is None
    assert kv.lookup(hashes[0]) is kv.blocks[1] and kv.lookup(hashes[1]) is kv.blocks[2]
    assert kv.blocks[3].block_hash is None
    check_counts(kv)


def test_hit_on_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    compute(kv, a, 9)
    kv.free(a)
    assert kv.num_free_blocks == 5 and kv.num_cached_free_blocks == 2
    b = make_request("b", list(range(9)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and [h.ref_cnt for h in hits] == [0, 0]
    assert kv.allocate_slots(b, 1, hits) is not None
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    assert kv.num_cached_free_blocks == 0
    assert kv.num_free_blocks == 2
    check_counts(kv)


def test_allocation_counts_revived_hit_blocks_against_free_space() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(8)) + [99])
    admit(kv, a)
    compute(kv, a, 9)
    kv.free(a)  # 3 free: two cached, one plain
    b = make_request("b", list(range(8)) + [5, 6, 7, 8, 9])  # needs 2 hits + 2 new
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is None
    assert [blk.ref_cnt for blk in hits] == [0, 0] and kv.num_free_blocks == 3
    check_counts(kv)


def test_full_prompt_hit_still_leaves_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=11, block_size=16, enable_prefix_caching=True)
    a = make_request("a", PROMPT[:48])
    admit(kv, a)
    compute(kv, a, 48)
    assert len(a.block_hashes) == 3
    b = make_request("b", PROMPT[:48])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32 and len(hits) == 2
    assert kv.allocate_slots(b, 16, hits) == [4]


def test_extra_keys_separate_caches() -> None:
    kv = KVCacheManager(num_blocks=11, block_size=16, enable_prefix_caching=True)
    a = make_request("a", PROMPT)
    admit(kv, a)
    compute(kv, a, 55)
    for other in (
        make_request("salted", PROMPT, cache_salt="s"),
        make_request("lora", PROMPT, lora_name="l"),
    ):
        assert kv.get_computed_blocks(other) == ([], 0)
    assert root_block_hash(("l", None)) != root_block_hash((None, "l"))
    same_salt = make_request("s1", PROMPT, cache_salt="s")
    admit(kv, same_salt)
    compute(kv, same_salt, 55)
    hits, num_hit = kv.get_computed_blocks(make_request("s2", PROMPT, cache_salt="s"))
    assert num_hit == 48 and hits == kv.get_blocks("s1")[:3]


def test_chained_hash_depends_on_the_whole_prefix() -> None:
    root = root_block_hash(None)
    first = hash_block_tokens(root, [1, 2, 3, 4])
    assert first == hash_block_tokens(root, [1, 2, 3, 4])
    assert first != hash_block_tokens(root, [1, 2, 3, 5])
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(root, [5, 6, 7, 8])
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, a)
    compute(kv, a, 9)
    # Same second block after a different first block: no hit at all.
    b = make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b) == ([], 0)


def test_allocate_slots_none_when_short_and_null_block_never_handed_out() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) == [1, 2, 3]
    b = make_request("b", list(range(50, 58)))
    assert kv.allocate_slots(b, 8) is None  # needs 2, 1 free
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1
    assert kv.allocate_slots(b, 4) == [4]
    assert kv.num_free_blocks == 0 and kv.usage == 1.0
    assert NULL_BLOCK_ID not in kv.get_block_ids("a") + kv.get_block_ids("b")
    check_counts(kv)


def test_decode_allocates_only_when_a_block_fills_and_hashes_it() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    req = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(kv, req)
    compute(kv, req, 6)
    assert len(kv.get_blocks("a")) == 2 and len(req.block_hashes) == 1
    new_per_step = []
    for token in (7, 8, 9, 10):
        req.append_output_token(token)  # sampled last step
        new_per_step.append(kv.allocate_slots(req, 1))
        compute(kv, req, 1)
    # Tokens 7 and 8 fit the second block; 9 opens a third; 10 fits it.
    assert new_per_step == [[], [], [3], []]
    assert len(req.block_hashes) == 2
    second = kv.get_blocks("a")[1]
    assert second.block_hash == req.block_hashes[1]
    assert second.block_hash == hash_block_tokens(req.block_hashes[0], [5, 6, 7, 8])
    assert kv.get_blocks("a")[2].block_hash is None
    check_counts(kv)


def test_concurrent_duplicate_block_stays_private() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    b = make_request("b", [1, 2, 3, 4, 5])
    admit(kv, a)
    admit(kv, b)  # both miss: neither is computed yet
    compute(kv, a, 5)
    compute(kv, b, 5)
    first_a, first_b = kv.get_blocks("a")[0], kv.get_blocks("b")[0]
    assert first_a.block_hash is not None and first_b.block_hash is None
    assert kv.lookup(a.block_hashes[0]) is first_a
    kv.free(b)
    kv.free(a)
    assert kv.num_cached_free_blocks == 1
    check_counts(kv)


def test_free_is_idempotent() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    kv.free(a)
    kv.free(a)
    assert kv.num_free_blocks == 3
    check_counts(kv)


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    compute(kv, a, 9)
    assert kv.reset_prefix_cache() is False  # a holds blocks
    assert kv.lookup(a.block_hashes[0]) is not None
    assert kv.reset_prefix_cache(reset_running_requests=True) is True
    assert kv.lookup(a.block_hashes[0]) is None
    assert all(b.block_hash is None for b in kv.get_blocks("a"))
    kv.free(a)
    assert kv.num_cached_free_blocks == 0
    b = make_request("b", list(range(9)))
    admit(kv, b)
    compute(kv, b, 9)
    kv.free(b)
    assert kv.num_cached_free_blocks == 2
    assert kv.reset_prefix_cache() is True
    assert kv.num_cached_free_blocks == 0 and kv.num_free_blocks == 7
    assert kv.get_computed_blocks(make_request("c", list(range(9)))) == ([], 0)
    check_counts(kv)


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    compute(kv, a, 9)
    assert a.block_hashes == [] and all(b.block_hash is None for b in kv.blocks)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert kv.prefix_cache_queries == 0


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=1, block_size=4, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0, enable_prefix_caching=True)
