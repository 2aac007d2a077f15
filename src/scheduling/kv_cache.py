"""The paged KV cache's bookkeeping: block pool, reference counts, prefix-cache hashes.

:class:`KVCacheManager` owns ``num_blocks`` blocks of ``block_size`` tokens each.
Block 0 is the null block: never handed out, so the model runner may use it for
padding. Every other block is either held (``ref_cnt > 0``, by one request or,
through a prefix-cache hit, by several) or free.

Free blocks sit in two queues, each in LRU order (head = next to go):

* *plain* blocks carry no prefix hash (never filled, or their hash was dropped);
* *cached* blocks keep the hash of the full block whose KV they still hold, so a
  later request with the same prefix can take them back (a hit).

Allocation takes plain blocks first and evicts cached ones (dropping their hash)
only when no plain block is left. A freed request returns its blocks in reverse
order of their position, so its tail blocks (the least shareable) are evicted
first.

Prefix hashes are chained: the hash of full block ``i`` is
``sha256(hash of block i-1 | token ids of block i)``, and the chain's root is
``sha256`` of the request's extra keys (LoRA name, cache salt), so equal hashes
mean equal whole prefixes under equal extra keys. A block is published in the
hash map only once its KV has been computed (``cache_full_blocks``, called after
the step), so a hit never reads KV that a running step is still writing. When
two requests compute the same block concurrently, the first to publish wins;
the other's copy stays unhashed and returns to the plain queue when freed.

Everything here is O(blocks touched) per call; nothing scans the whole pool on
the per-step path. Pure Python, driven synchronously: never imports torch or trio.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from .request_state import Request

NULL_BLOCK_ID = 0

_ROOT_HASH = hashlib.sha256(b"legato-prefix-v1").digest()


def root_block_hash(extra_keys: tuple[str | None, str | None] | None) -> bytes:
    """The chain's starting point for a request with these extra keys (None: none)."""
    if extra_keys is None:
        return _ROOT_HASH
    return hashlib.sha256(b"legato-prefix-v1" + repr(extra_keys).encode()).digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The prefix hash of a full block: sha256 over the parent hash and the token ids.

    The parent is a fixed 32 bytes and every block has the same length, so the
    encoding is unambiguous; sha256 makes a crafted collision (one user reading
    another's KV) impractical, which Python's ``hash`` would not.
    """
    digest = hashlib.sha256(parent_hash)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVBlock:
    """One block of the pool: its id, how many requests hold it, its prefix hash."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id: int = block_id
        self.ref_cnt: int = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        tag = self.block_hash.hex()[:8] if self.block_hash is not None else "-"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={tag})"


class KVCacheManager:
    """Block pool with reference counts, LRU free queues and a prefix-hash map.

    Contract with the scheduler: a waiting request asks :meth:`get_computed_blocks`
    (no side effects), then :meth:`allocate_slots` with those blocks; a running
    request calls :meth:`allocate_slots` alone each step. After a step's KV is
    computed the scheduler calls :meth:`cache_full_blocks`; a finished or
    preempted request calls :meth:`free`. Requests are keyed by ``request_id``.

    It keeps ``request.num_kv_slots`` (tokens the request's blocks have room for)
    and ``request.num_cached_blocks`` (its leading blocks published) up to date,
    so the scheduler can skip :meth:`allocate_slots` and :meth:`cache_full_blocks`
    on the steps where they would do nothing.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        """``num_blocks`` includes the null block, so ``num_blocks - 1`` are usable."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks: need the null block plus one, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self._plain_free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._cached_free: OrderedDict[int, KVBlock] = OrderedDict()
        self._hash_to_block: dict[bytes, KVBlock] = {}
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # Cumulative prefix-cache figures, in tokens (the scheduler takes deltas).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------ figures

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._plain_free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return len(self._cached_free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, 0..1."""
        return self.num_used_blocks / self.num_usable_blocks

    def get_blocks(self, request_id: str) -> list[KVBlock]:
        """The request's block table (empty if it holds none). Do not mutate."""
        return self._req_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids (a fresh list)."""
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def holders(self) -> dict[str, list[KVBlock]]:
        """Every request holding blocks, with its block table (for checks; do not mutate)."""
        return self._req_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        """The block published under this hash, if any."""
        return self._hash_to_block.get(block_hash)

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order allocation would take them (plain, then cached LRU)."""
        return [*self._plain_free, *self._cached_free]

    # ---------------------------------------------------------- hashing

    def _block_hash(self, request: Request, index: int) -> bytes:
        """Hash of the request's full block ``index``, extending ``request.block_hashes``."""
        hashes = request.block_hashes
        size = self.block_size
        tokens = request.all_token_ids
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[-1] if hashes else root_block_hash(request.cache_extra_keys)
            hashes.append(hash_block_tokens(parent, tokens[i * size : (i + 1) * size]))
        return hashes[index]

    # ------------------------------------------------------- allocation

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks that prefixes the request's tokens.

        Returns the blocks and the number of tokens they cover. At least the last
        known token is always left to compute (it yields the next sample), so the
        hit never covers the whole sequence. No side effects on the pool: pass
        the blocks to :meth:`allocate_slots` to take them.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        lookup = self._hash_to_block.get
        for i in range(max_blocks):
            block = lookup(self._block_hash(request, i))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; return the new blocks' ids.

        The request needs ``ceil((computed + num_new_tokens) / block_size)``
        blocks, where computed is ``request.num_computed_tokens`` plus the tokens
        of ``computed_blocks`` (a prefix hit from :meth:`get_computed_blocks`,
        only on the request's first allocation). Returns the ids of the blocks
        added (``[]`` when none were needed), or None, changing nothing, when the
        free blocks do not suffice.
        """
        held = self._req_blocks.get(request.request_id)
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        if held is not None and num_needed <= len(held):
            return []  # the per-step decode path: the last block still has room
        num_new_blocks = num_needed - (len(held) if held is not None else 0) - len(computed_blocks)
        # Hit blocks that are free leave the free queues when taken.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_revived > self.num_free_blocks:
            return None
        if held is None:
            held = self._req_blocks[request.request_id] = []
            request.num_cached_blocks = len(computed_blocks)
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(computed_blocks) * self.block_size
        for block in computed_blocks:
            if block.ref_cnt == 0:
                del self._cached_free[block.block_id]
            block.ref_cnt += 1
            held.append(block)
        new_ids: list[int] = []
        for _ in range(num_new_blocks):
            block = self._pop_free()
            block.ref_cnt = 1
            held.append(block)
            new_ids.append(block.block_id)
        request.num_kv_slots = len(held) * self.block_size
        return new_ids

    def _pop_free(self) -> KVBlock:
        """Take the next free block: a plain one, else evict the LRU cached one."""
        if self._plain_free:
            return self._plain_free.popitem(last=False)[1]
        block = self._cached_free.popitem(last=False)[1]
        assert block.block_hash is not None
        del self._hash_to_block[block.block_hash]
        block.block_hash = None
        return block

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's full blocks whose KV is computed, for later hits.

        Covers blocks up to ``request.num_computed_tokens // block_size``; call
        after the step that computed them. A hash already published by another
        block is not published again (this block stays private).
        """
        if not self.enable_prefix_caching:
            return
        start = request.num_cached_blocks
        end = request.num_computed_tokens // self.block_size
        if end <= start:
            return
        blocks = self._req_blocks.get(request.request_id)
        if blocks is None:
            return
        hash_map = self._hash_to_block
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is None:
                block_hash = self._block_hash(request, i)
                if block_hash not in hash_map:
                    block.block_hash = block_hash
                    hash_map[block_hash] = block
        request.num_cached_blocks = end

    def free(self, request: Request) -> None:
        """Release the request's blocks (idempotent); unheld blocks join the free queues.

        Blocks go to the queues' tails last block first, so a request's tail is
        evicted before its head.
        """
        blocks = self._req_blocks.pop(request.request_id, None)
        request.num_kv_slots = request.num_cached_blocks = 0
        if blocks is None:
            return
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._cached_free[block.block_id] = block
                else:
                    self._plain_free[block.block_id] = block

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every prefix hash. Returns whether it did.

        While any request holds blocks this refuses (returns False, changes
        nothing) unless ``reset_running_requests``: then the hashes of held blocks
        are dropped too, and the caller must make sure no running request keeps
        relying on them (the scheduler preempts them all first). O(num_blocks).
        """
        if self._req_blocks and not reset_running_requests:
            return False
        for block in self._hash_to_block.values():
            block.block_hash = None
        self._hash_to_block.clear()
        self._plain_free.update(self._cached_free)
        self._cached_free.clear()
        return True
