"""Paged attention in Triton: flash-decoding for decode, online-softmax tiles for prefill.

Same contract as :func:`legato.kernels.reference.paged_attention` (flat batch,
``query_start_loc`` / ``seq_lens``, causal, GQA, paged KV cache
``[num_blocks, block_size, num_kv_heads, head_dim]``). :func:`paged_attention`
dispatches: every sequence with query length <= 1 goes to the decode kernels
(:func:`paged_attention_decode`), anything else to the prefill kernel
(:func:`paged_attention_prefill`), which handles mixed batches of prefills,
chunked prefills after a cached prefix, and decodes.

Both kernels are GQA-aware: one program handles all query heads that share a
kv head, so every K/V tile is read once per group. Scores use ``exp2`` with
``scale * log2(e)`` folded in; softmax state and accumulators are fp32.
Products run on ``tl.dot``: in the cache dtype (fp16/bf16) with fp32
accumulation on a GPU, in fp32 (``ieee``) for fp32 caches and for bf16 under
the interpreter, whose bf16 arithmetic is broken. ``head_dim`` is padded to a
power of two with masks (so 80, 96 ... work); it must be at least 16.

The kernels live in :mod:`.attention_decode` and :mod:`.attention_prefill`, their
shared checks and score helpers in :mod:`.attention_common`; this module is the
dispatcher. Imports triton (through them) at module import: import it only through
:func:`legato.kernels.get_kernels` or after ``TRITON_INTERPRET`` is decided.
"""

from __future__ import annotations

import torch

from .attention_decode import DECODE_TILES, DecodeTiles, paged_attention_decode
from .attention_prefill import paged_attention_prefill

__all__ = [
    "DECODE_TILES",
    "DecodeTiles",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_prefill",
]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention; the reference's contract, on the Triton kernels.

    ``max_query_len`` (host-side upper bound of the per-sequence query lengths)
    picks the kernel: 1 means decode. Without it the lengths are read back
    from the device (one sync) unless ``T`` exceeds ``num_seqs``, which proves
    a prefill. ``max_seq_len`` is passed on to the decode planner. ``softcap``: scores
    become ``softcap * tanh(scores / softcap)`` (Gemma 2), as in the reference.
    """
    if max_query_len is not None:
        decode = max_query_len <= 1
    elif query.shape[0] > seq_lens.shape[0]:
        decode = False
    else:
        decode = seq_lens.shape[0] == 0 or int(torch.diff(query_start_loc).max().item()) <= 1
    if decode:
        return paged_attention_decode(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_seq_len=max_seq_len,
            sliding_window=sliding_window,
            softcap=softcap,
        )
    return paged_attention_prefill(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window=sliding_window,
        softcap=softcap,
    )
