# @triton.jit kernels take untyped tensor/pointer arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""What the paged-attention kernels share: input checks, the fp32-product rule, and
the score helpers both kernels inline (window start, scaling with an optional
soft cap in the log2 domain).

Imports triton at module import, as :mod:`.attention` does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import triton_interpreting

LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=8)
def multiprocessor_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 8


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the attention products must run in fp32 rather than in ``dtype``."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and triton_interpreting())


def check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Shape and layout checks that need no device sync."""
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("query must be [T, H, D] and the caches [num_blocks, block_size, Hkv, D]")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError("head_dim mismatch or num_heads not a multiple of num_kv_heads")
    if head_dim < 16:
        raise ValueError("the Triton attention kernels need head_dim >= 16")
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("the head dimension must be contiguous in query and caches")
    if block_tables.stride(1) != 1 or seq_lens.stride(0) != 1 or query_start_loc.stride(0) != 1:
        raise ValueError("block_tables rows, seq_lens and query_start_loc must be contiguous")
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError("query_start_loc must have num_seqs + 1 entries")


@triton.jit
def window_start(seq_len, window):
    """The first key a sequence's last query sees: ``seq_len - window``, or 0 (no window: 0)."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit
def scaled_scores(s, scale_log2, softcap_in, softcap_out, SOFTCAP: tl.constexpr):
    """Raw ``q.k`` scores into the log2 domain: ``s * scale * log2(e)``, or with a soft cap
    ``cap * tanh(s * scale / cap) * log2(e)`` (``softcap_in = scale / cap``,
    ``softcap_out = cap * log2(e)``; tanh as ``2 * sigmoid(2t) - 1``)."""
    if SOFTCAP:
        return (2.0 * tl.sigmoid(2.0 * s * softcap_in) - 1.0) * softcap_out
    return s * scale_log2
