# @triton.jit kernels take untyped tensor/pointer arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
"""Paged attention for any flat batch (prefills, chunked prefills after a cached
prefix, decodes, mixed): online-softmax tiles, one program per (query tile, kv
head), GQA-aware.

Imports triton at module import, as :mod:`.attention` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_interpreting
from .attention_common import LOG2E, check_inputs, dot_in_fp32, scaled_scores, window_start


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, program, BLOCK_Q: tl.constexpr):
    """The sequence whose query-tile range ``[qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1)`` holds ``program``."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= program:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    num_seqs,
    window,
    softcap_in,
    softcap_out,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Causal paged attention for one (query tile, kv head) per program.

    Grid ``(T // BLOCK_Q + num_seqs, num_kv_heads)``: sequence ``i`` owns the
    query tiles ``qsl[i] // BLOCK_Q + i ...``, found by binary search over
    ``query_start_loc`` (no host sync); surplus programs exit. A tile is
    ``BLOCK_Q`` consecutive query tokens times the ``GROUP`` query heads of the
    kv head, packed as ``BLOCK_M = BLOCK_Q * GROUP`` (padded) rows, so each
    ``[BLOCK_N, BLOCK_D]`` K/V tile gathered through the block table serves the
    whole group. KV tiles run from position 0 to the tile's last query
    position; the causal mask ``key_pos <= query_pos`` covers both the cached
    prefix and the new tokens. A sliding ``window`` (> 0) adds
    ``key_pos > query_pos - window`` and starts the tiles at the tile's first
    query's window; a row with no visible key in a tile keeps its running max at
    -inf and adds nothing (``m_safe``).
    """
    program = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, program, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = program - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        first_pos = seq_len - q_len
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        tok = q_tile * BLOCK_Q + offs_m // GROUP
        heads = kvh * GROUP + offs_m % GROUP
        row_mask = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
        d_mask = offs_d < HEAD_DIM
        q_mask = row_mask[:, None] & d_mask[None, :]
        rows = (q_start + tok).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=q_mask,
            other=0.0,
        )
        if DOT_FP32:
            q = q.to(tl.float32)
        else:
            q = q.to(k_cache_ptr.dtype.element_ty)
        q_pos = first_pos + tok

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_end = tl.minimum(seq_len, first_pos + (q_tile + 1) * BLOCK_Q)
        kv_start = window_start(first_pos + q_tile * BLOCK_Q + 1, window) // BLOCK_N * BLOCK_N
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(kv_start, kv_end, BLOCK_N):
            keys = start + offs_n
            n_mask = keys < kv_end
            blocks = tl.load(table_row + keys // PAGE, mask=n_mask, other=0).to(tl.int64)
            in_page = keys % PAGE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k_offs = blocks * stride_kb + in_page * stride_kt + kvh * stride_kh
            k = tl.load(k_cache_ptr + k_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if DOT_FP32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            visible = (keys[None, :] <= q_pos[:, None]) & n_mask[None, :]
            if window > 0:
                visible = visible & (keys[None, :] > q_pos[:, None] - window)
            s = tl.where(
                visible,
                scaled_scores(s, scale_log2, softcap_in, softcap_out, SOFTCAP),
                float("-inf"),
            )
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # Without a window key 0 is visible to every row, so m_new is finite from the
            # first tile on; with one, a row may see nothing in a tile: keep it at zero.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_offs = blocks * stride_vb + in_page * stride_vt + kvh * stride_vh
            v = tl.load(v_cache_ptr + v_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if DOT_FP32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # 0: a padding row saw no key
        o_ptrs = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Paged attention for any flat batch (prefill, chunked prefill, decode, mixed).

    Same contract as the reference. ``block_m`` rows per program (query tokens
    times the GQA group, raised to a power of two >= the group) and ``block_n``
    KV tokens per tile are tuning knobs (powers of two >= 16); by default 64 and
    64, or 32 and 32 (8 warps) for fp32 products on a GPU, which run on FMA
    units and spill registers with larger tiles. Never syncs.
    """
    check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0 or num_tokens == 0:
        return out
    dot_fp32 = dot_in_fp32(key_cache.dtype)
    default_tile = 32 if dot_fp32 and not triton_interpreting() else 64
    block_n = block_n or default_tile
    block_m = max(16, block_m or default_tile, triton.next_power_of_2(group))
    block_q = block_m // group
    _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        query,
        key_cache,
        value_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * LOG2E,
        num_seqs,
        sliding_window or 0,
        scale / softcap if softcap else 0.0,
        (softcap or 0.0) * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PAGE=page,
        DOT_FP32=dot_fp32,
        SOFTCAP=softcap is not None,
        num_warps=4 if head_dim <= 64 and not dot_fp32 else 8,
        num_stages=2,
    )
    return out
