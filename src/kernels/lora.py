# @triton.jit kernels take untyped tensor/pointer arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton multi-adapter LoRA (segmented gather matmul, punica's SGMV/BGMV idea).

Same contract as :func:`legato.kernels.reference.add_lora`: every token of a
flat batch carries the slot of its adapter (0 = the base model, no update),
and ``y += (x @ A[slot].T) @ B[slot].T`` is applied per token, many adapters in
one launch. Two kernels:

- **shrink** ``h[t] = x[t] @ A[slot(t)].T`` for all slices at once
  (``A`` stacks the slices' down-projections, ``[L, S * R, in]``), fp32 out.
  With few rows (decode) the ``in`` dimension is split into up to eight
  partial sums so that more programs run at once; the expand adds them up
  (deterministic: no atomics);
- **expand** ``y[t, cols_s] += h[t, s*R:(s+1)*R] @ B[slot(t), cols_s].T`` for
  every slice ``s`` at once (``B`` ``[L, out, R]`` keeps each slice's rows at
  its output columns).

Tokens are grouped by slot on the device (a stable argsort plus per-slot
counts and starts, :func:`lora_meta`), and the grid is ``(token blocks x
column blocks, [slices,] L - 1)``: a program axis over the non-base slots, each program
gathering up to ``BLOCK_M`` of that slot's token rows. Programs past a slot's
count return at once. Nothing reads a length back to the host, so a step can
be captured in a CUDA graph. Decode batches (one row per request) are the BGMV
case of the same kernels.

fp32 inputs use exact (IEEE) dot products; fp16/bf16 accumulate in fp32.
Imports triton at module import; set ``TRITON_INTERPRET=1`` first for the CPU
interpreter.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["LoRAKernelMeta", "add_lora", "lora_meta"]

_MAX_SPLIT_K = 8


@dataclass(frozen=True, slots=True)
class LoRAKernelMeta:
    """Tokens grouped by slot: ``order`` (token rows, slot-major), and each slot's
    ``counts`` and ``starts`` into ``order``. All on the tokens' device."""

    order: torch.Tensor  # [T] int64
    counts: torch.Tensor  # [L] int32
    starts: torch.Tensor  # [L] int32


def lora_meta(token_slots: torch.Tensor, num_slots: int) -> LoRAKernelMeta:
    """Group the tokens of one step by slot, on the device, without a host sync."""
    slots = token_slots.long()
    order = torch.argsort(slots, stable=True)
    counts = torch.zeros(num_slots, dtype=torch.int32, device=slots.device)
    counts.scatter_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
    starts = (torch.cumsum(counts, 0, dtype=torch.int32) - counts).to(torch.int32)
    return LoRAKernelMeta(order, counts, starts)


@triton.jit
def _slot_rows(order_ptr, counts_ptr, starts_ptr, slot, pid_m, BLOCK_M: tl.constexpr):
    """This program's token rows (and their mask) among ``slot``'s tokens."""
    count = tl.load(counts_ptr + slot)
    start = tl.load(starts_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(order_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    return rows, mask_m, count


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    order_ptr,
    counts_ptr,
    starts_ptr,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_al,
    stride_an,
    stride_hk,
    stride_hm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``h[split, rows, n] = x[rows, ks] @ a[slot, n, ks].T`` over one split ``ks`` of the
    input columns, for one (row block, column block, split, slot)."""
    num_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    pid_k = pid % SPLIT_K
    pid_m = pid // SPLIT_K // num_n
    pid_n = pid // SPLIT_K % num_n
    slot = tl.program_id(1).to(tl.int64) + 1
    rows, mask_m, count = _slot_rows(order_ptr, counts_ptr, starts_ptr, slot, pid_m, BLOCK_M)
    if pid_m * BLOCK_M >= count:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        a = tl.load(
            a_ptr + slot * stride_al + offs_n[None, :] * stride_an + offs_k[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc += tl.dot(x, a, input_precision=PRECISION)
    tl.store(
        h_ptr + pid_k * stride_hk + rows[:, None] * stride_hm + offs_n[None, :],
        acc,
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _expand_kernel(
    h_ptr,
    b_ptr,
    y_ptr,
    order_ptr,
    counts_ptr,
    starts_ptr,
    R,
    END0,
    END1,
    END2,
    num_n,
    stride_hk,
    stride_hm,
    stride_bl,
    stride_bn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``y[rows, cols] += h[rows, s*R:(s+1)*R] @ b[slot, cols].T`` for slice ``s``'s columns.

    ``h`` is the sum of the shrink's ``SPLIT_K`` partial results. Slice ``s``
    (program axis 1) owns output columns ``END[s-1] .. END[s]``; ``num_n``
    column blocks cover the widest slice.
    """
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    s = tl.program_id(1)
    slot = tl.program_id(2).to(tl.int64) + 1
    col_start = tl.where(s == 0, 0, tl.where(s == 1, END0, END1))
    col_end = tl.where(s == 0, END0, tl.where(s == 1, END1, END2))
    if col_start + pid_n * BLOCK_N >= col_end:
        return
    rows, mask_m, count = _slot_rows(order_ptr, counts_ptr, starts_ptr, slot, pid_m, BLOCK_M)
    if pid_m * BLOCK_M >= count:
        return
    offs_n = col_start + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < col_end
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    h_ptrs = h_ptr + rows[:, None] * stride_hm + s * R + offs_r[None, :]
    mask_h = mask_m[:, None] & mask_r[None, :]
    h = tl.load(h_ptrs, mask=mask_h, other=0.0)
    for k in tl.static_range(1, SPLIT_K):
        h += tl.load(h_ptrs + k * stride_hk, mask=mask_h, other=0.0)
    b = tl.load(
        b_ptr + slot * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None],
        mask=mask_r[:, None] & mask_n[None, :],
        other=0.0,
    )
    acc = tl.dot(h.to(b.dtype), b, input_precision=PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, int(triton.next_power_of_2(max(n, 1)))))


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_sizes: Sequence[int],
    *,
    meta: LoRAKernelMeta | None = None,
) -> None:
    """In-place ``y += `` each token's LoRA update; see the reference for shapes.

    Two launches whatever the number of adapters and slices (at most three).
    ``meta`` (from :func:`lora_meta`) may be computed once per step and shared
    by every layer. ``x``, ``lora_a`` and ``lora_b`` must be contiguous in
    their last dimension; ``y`` may be a column view of a wider tensor.
    """
    num_tokens = x.shape[0]
    num_slots = lora_a.shape[0]
    if num_tokens == 0 or num_slots < 2:
        return
    if not 1 <= len(slice_sizes) <= 3:
        raise ValueError(f"slice_sizes: 1 to 3 slices, got {len(slice_sizes)}")
    if meta is None:
        meta = lora_meta(token_slots, num_slots)
    stacked_rank = lora_a.shape[1]
    rank = stacked_rank // len(slice_sizes)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    block_m = 16
    m_blocks = triton.cdiv(num_tokens, block_m)
    in_features = x.shape[1]
    block_k = _block(in_features, 128)
    # Few rows make few programs, each walking all of ``in``: split it so more run at once.
    split_k = max(1, min(_MAX_SPLIT_K, in_features // (8 * block_k))) if num_tokens <= 256 else 1
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    h = torch.empty((split_k, num_tokens, stacked_rank), dtype=torch.float32, device=x.device)
    block_n = _block(stacked_rank, 64)
    grid = (m_blocks * triton.cdiv(stacked_rank, block_n) * split_k, num_slots - 1)
    _shrink_kernel[grid](
        x,
        lora_a,
        h,
        meta.order,
        meta.counts,
        meta.starts,
        stacked_rank,
        in_features,
        k_per_split,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        h.stride(0),
        h.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        PRECISION=precision,
    )
    ends = [int(e) for e in itertools.accumulate(slice_sizes)]
    ends += [ends[-1]] * (3 - len(ends))
    block_n = _block(max(slice_sizes), 64)
    num_n = triton.cdiv(max(slice_sizes), block_n)
    _expand_kernel[(m_blocks * num_n, len(slice_sizes), num_slots - 1)](
        h,
        lora_b,
        y,
        meta.order,
        meta.counts,
        meta.starts,
        rank,
        ends[0],
        ends[1],
        ends[2],
        num_n,
        h.stride(0),
        h.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=_block(rank, 128),
        SPLIT_K=split_k,
        PRECISION=precision,
    )
