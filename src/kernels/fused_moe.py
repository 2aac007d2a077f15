# @triton.jit kernels take untyped tensor/pointer arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton fused mixture-of-experts: grouped GEMMs over the (token, slot) pairs sorted by expert.

Same contract as :func:`legato.kernels.reference.fused_moe` (SwiGLU experts, the
top-k weights applied, fp32 accumulation, result in the input dtype). vLLM's
fused_moe idea, written afresh:

1. :func:`align_by_expert` sorts the ``T * k`` (token, slot) pairs by expert and
   pads each expert's run to a multiple of ``BLOCK_M`` (padding holds the
   sentinel ``T * k``), so every ``BLOCK_M`` block of the sorted list belongs to
   one expert; it runs on the device with no host sync (sizes are upper bounds
   known from the shapes), so the launch grid never depends on the routing.
2. One launch of :func:`_grouped_gemm_kernel` for gate_up: each program takes one
   block of one expert's pairs and one ``BLOCK_N`` column tile, and multiplies
   those tokens' rows of ``x`` by that expert's ``w13`` tile; programs past the
   padded total return at once.
3. The Triton SwiGLU gate (:mod:`legato.kernels.activation`).
4. One launch for down, which multiplies each pair's row by its routing weight;
   the ``k`` rows of each token are then summed (fp32).

Imports triton at module import; the model reaches it only from the Triton
backend (:mod:`legato.models.moe`). Never imports trio or the model code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul

__all__ = ["align_by_expert", "fused_moe"]

BLOCK_M = 16  # pairs per program (tl.dot's minimum); one expert per block


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    pair_weights_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    PAIRS_PER_ROW: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``c[pair, n] = (a[pair // PAIRS_PER_ROW] @ b[expert(pair)].T)[n]`` (times the pair's
    weight when ``MUL_WEIGHT``), for one block of sorted pairs and one column tile.

    Grid ``(num_blocks * cdiv(N, BLOCK_N),)``; ``b`` is ``[E, N, K]``.
    """
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = pairs // PAIRS_PER_ROW
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        weight = tl.load(pair_weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_experts, num_padded)`` for ``topk_ids`` ``[T, k]``.

    ``sorted_pairs`` (int32, length a multiple of ``block_m`` fixed by the shapes)
    lists the pair indices ``t * k + slot`` grouped by expert, each expert's run
    padded to a multiple of ``block_m`` with the sentinel ``T * k`` (also filling
    the unused tail); ``block_experts[b]`` is the expert of block ``b``;
    ``num_padded`` (one-element int32) is the padded length actually used.
    No host sync.
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    sorted_experts = flat[order]
    rank = (
        torch.arange(num_pairs, device=flat.device)
        - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    )
    dest = (padded_end - padded)[sorted_experts] + rank
    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pairs = torch.full(
        (capacity * block_m,), num_pairs, dtype=torch.int32, device=flat.device
    )
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity * block_m, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    block_experts = block_experts.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pairs, block_experts, padded_end[-1:].to(torch.int32)


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pairs_per_row: int,
    pair_weights: torch.Tensor | None,
) -> None:
    sorted_pairs, block_experts, num_padded = aligned
    n, k = b.shape[1], b.shape[2]
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    grid = (block_experts.numel() * triton.cdiv(n, block_n),)
    _grouped_gemm_kernel[grid](
        a,
        b,
        out,
        out if pair_weights is None else pair_weights,
        sorted_pairs,
        block_experts,
        num_padded,
        out.shape[0],
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        out.stride(0),
        out.stride(1),
        PAIRS_PER_ROW=pairs_per_row,
        MUL_WEIGHT=pair_weights is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` (SwiGLU experts).

    ``x`` ``[T, H]``; ``w13`` ``[E, 2I, H]`` (gate rows, then up rows); ``w2``
    ``[E, H, I]``, both in ``x``'s dtype; ``topk_weights`` / ``topk_ids`` ``[T, k]``.
    Two grouped-GEMM launches and one gate launch; no host sync.
    """
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        raise ValueError(
            f"fused_moe: x ({x.dtype}) and the expert weights ({w13.dtype}, {w2.dtype}) "
            "must share a dtype"
        )
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if tokens == 0:
        return torch.zeros_like(x)
    aligned = align_by_expert(topk_ids, w13.shape[0])
    num_pairs = tokens * top_k
    gate_up = torch.empty((num_pairs, w13.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, aligned, top_k, None)
    gated = silu_and_mul(gate_up)
    down = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(gated, w2, down, aligned, 1, weights)
    return down.view(tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
