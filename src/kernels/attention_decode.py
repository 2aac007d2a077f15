# @triton.jit kernels take untyped tensor/pointer arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call"
"""Flash-decoding for paged attention: each sequence's context is cut into splits,
one program per (sequence, kv head, split) computes a partial softmax, a second
kernel merges the splits. For batches whose every query length is at most 1.

Imports triton at module import, as :mod:`.attention` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_common import (
    LOG2E,
    check_inputs,
    dot_in_fp32,
    multiprocessor_count,
    scaled_scores,
    window_start,
)

_MIN_SPLIT_TOKENS = 128  # a decode split is never shorter than this (unless forced)


@dataclass(frozen=True, slots=True)
class DecodeTiles:
    """Launch shape of the decode split kernel: KV tokens per tile, warps, pipeline depth,
    and how many programs per multiprocessor the split planner aims for."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 2


# The default. On an H100 (bf16, head_dim 128, GQA 4) no other shape of
# benchmarks/gpu/roofline.py --sections tune beat it by more than 2% at batch 1..256 and
# context 512..2048 under CUDA graphs; it reads the KV at 72-99% of copy bandwidth
# from batch 64 up.
DECODE_TILES = DecodeTiles()


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    split_tokens,
    num_splits,
    num_heads,
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
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
):
    """Decode, pass 1: one (sequence, kv head, context split) per program.

    Grid ``(num_seqs, num_kv_heads, num_splits)``. The program loads the
    ``GROUP`` query heads of its kv head as a ``[BLOCK_G, BLOCK_D]`` tile (rows
    padded to >= 16 for ``tl.dot``), walks its split ``[s*split_tokens,
    min((s+1)*split_tokens, seq_len))`` (the last split: to ``seq_len``) in
    ``BLOCK_N``-token tiles gathered through the block table, and keeps an
    online softmax. With one split it writes the normalised output; otherwise
    the unnormalised ``acc`` and its ``(max, sum)`` in the log2 domain go to
    the partial buffers ``[num_seqs, num_heads, num_splits(, head_dim)]`` for
    the reduce pass. Sequences whose query length is not 1 are skipped. With a
    sliding ``window`` (> 0) the splits start at the window's first key,
    ``seq_len - window``, instead of 0.
    """
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = window_start(seq_len, window) + split * split_tokens
    if (q_end - q_row == 1) & (lo < seq_len):
        # The last split runs to the end, so an underestimated plan is slow, never wrong.
        hi = tl.where(split == num_splits - 1, seq_len, tl.minimum(lo + split_tokens, seq_len))
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + offs_g
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        q_mask = g_mask[:, None] & d_mask[None, :]
        q = tl.load(
            q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=q_mask,
            other=0.0,
        )
        if DOT_FP32:
            q = q.to(tl.float32)
        else:
            q = q.to(k_cache_ptr.dtype.element_ty)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(lo, hi, BLOCK_N):
            tokens = start + offs_n
            n_mask = tokens < hi
            blocks = tl.load(table_row + tokens // PAGE, mask=n_mask, other=0).to(tl.int64)
            in_page = tokens % PAGE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k_offs = blocks * stride_kb + in_page * stride_kt + kvh * stride_kh
            k = tl.load(k_cache_ptr + k_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if DOT_FP32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(
                n_mask[None, :],
                scaled_scores(s, scale_log2, softcap_in, softcap_out, SOFTCAP),
                float("-inf"),
            )
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_offs = blocks * stride_vb + in_page * stride_vt + kvh * stride_vh
            v = tl.load(v_cache_ptr + v_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if DOT_FP32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if SINGLE_SPLIT:
            out = acc / l_i[:, None]
            o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
            tl.store(o_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            part = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
            tl.store(part_m_ptr + part, m_i, mask=g_mask)
            tl.store(part_l_ptr + part, l_i, mask=g_mask)
            acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :]
            tl.store(acc_ptrs, acc, mask=q_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    split_tokens,
    num_splits,
    num_heads,
    window,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Decode, pass 2: merge the splits of one (sequence, query head) per program.

    Grid ``(num_seqs, num_heads)``. Reads the non-empty partials
    (``min(cdiv(seq_len, split_tokens), num_splits)``) as a ``[BLOCK_S, BLOCK_D]`` tile, rescales each by
    ``exp2(m_s - max)`` and writes ``sum(acc_s * w_s) / sum(l_s * w_s)``.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    if q_end - q_row == 1:
        seq_len = tl.load(seq_lens_ptr + seq)
        span = seq_len - window_start(seq_len, window)
        used = tl.minimum((span + split_tokens - 1) // split_tokens, num_splits)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < used
        d_mask = offs_d < HEAD_DIM
        part = (seq.to(tl.int64) * num_heads + head) * num_splits + offs_s
        m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
        l_s = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.where(s_mask, tl.exp2(m - m_max), 0.0)
        denom = tl.sum(l_s * w, axis=0)
        acc = tl.load(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        out = tl.sum(acc * w[:, None], axis=0) / denom
        o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + offs_d
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def plan_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_ctx: int,
    device: torch.device,
    tiles: DecodeTiles = DECODE_TILES,
) -> tuple[int, int]:
    """``(num_splits, split_tokens)`` so that the grid holds about ``tiles.programs_per_sm``
    programs per multiprocessor; ``split_tokens`` is a multiple of ``tiles.block_n``."""
    target_programs = tiles.programs_per_sm * multiprocessor_count(device)
    wanted = triton.cdiv(target_programs, max(1, num_seqs * num_kv_heads))
    splits = max(1, min(wanted, triton.cdiv(max_ctx, _MIN_SPLIT_TOKENS)))
    split_tokens = triton.cdiv(triton.cdiv(max_ctx, splits), tiles.block_n) * tiles.block_n
    return triton.cdiv(max_ctx, split_tokens), split_tokens


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    split_tokens: int | None = None,
    tiles: DecodeTiles | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Paged attention for a batch where every sequence has query length 1 (or 0).

    Same contract as the reference. ``max_seq_len`` (host-side bound of
    ``seq_lens``; default ``block_tables.shape[1] * block_size``) sizes the
    context splits: an underestimate stays correct but loads the last split;
    under CUDA graphs leave it None or fixed, since the plan is captured.
    ``split_tokens`` forces the split length (rounded up to the KV tile),
    mainly for tests; ``tiles`` overrides :data:`DECODE_TILES` (tuning).
    Sequences with query length other than 1 are left unwritten. Never syncs
    with the device.
    """
    check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0 or num_tokens == 0:
        return out
    tiles = tiles or DECODE_TILES
    max_ctx = max(1, max_seq_len if max_seq_len is not None else block_tables.shape[1] * page)
    if sliding_window is not None:
        max_ctx = min(max_ctx, sliding_window)
    window = sliding_window or 0
    if split_tokens is None:
        num_splits, split_tokens = plan_splits(num_seqs, num_kv_heads, max_ctx, query.device, tiles)
    else:
        split_tokens = triton.cdiv(split_tokens, tiles.block_n) * tiles.block_n
        num_splits = triton.cdiv(max_ctx, split_tokens)
    single = num_splits == 1
    part_shape = (num_seqs, num_heads, num_splits) if not single else (1,)
    part_m = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((*part_shape, head_dim), dtype=torch.float32, device=query.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        out,
        part_m,
        part_l,
        part_acc,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * LOG2E,
        split_tokens,
        num_splits,
        num_heads,
        window,
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
        BLOCK_D=block_d,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=tiles.block_n,
        PAGE=page,
        DOT_FP32=dot_in_fp32(key_cache.dtype),
        SOFTCAP=softcap is not None,
        SINGLE_SPLIT=single,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            part_m,
            part_l,
            part_acc,
            seq_lens,
            query_start_loc,
            split_tokens,
            num_splits,
            num_heads,
            window,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
