# @triton.jit kernels take untyped tensor/pointer arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton rotary position embedding for query and key, neox and GPT-J styles.

Same contract as :func:`legato.kernels.reference.apply_rotary`: ``cos_sin_cache``
``[max_position, head_dim]`` holds cos in the first half of a row and sin in the
second (so llama3 and other scalings are already in it); the rotation covers
the whole head. Imports triton at module import; reach it through
:func:`legato.kernels.get_kernels`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["apply_rotary"]


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    stride_h,
    stride_out_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Rotate the ``[NUM_HEADS, head_dim]`` row of one token, read and written contiguously.

    Neox: the two halves are two ``[BLOCK_H, BLOCK_HALF]`` tiles. GPT-J: one
    ``[BLOCK_H, 2 * BLOCK_HALF]`` tile de-interleaved in registers
    (reshape + split, re-joined before the store), so loads stay vectorised.
    """
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h[:, None] < NUM_HEADS
    x_row = x_ptr + offs_h[:, None] * stride_h
    out_row = out_ptr + offs_h[:, None] * stride_out_h
    if IS_NEOX:
        offs = tl.arange(0, BLOCK_HALF)[None, :]
        mask = h_mask & (offs < HALF)
        x1 = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        out1 = x1 * cos[None, :] - x2 * sin[None, :]
        out2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(out_row + offs, out1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_row + HALF + offs, out2.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        offs = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        mask = h_mask & (offs < 2 * HALF)
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [BLOCK_H, BLOCK_HALF, 2]))
        out1 = x1 * cos[None, :] - x2 * sin[None, :]
        out2 = x2 * cos[None, :] + x1 * sin[None, :]
        out = tl.reshape(tl.join(out1, out2), [BLOCK_H, 2 * BLOCK_HALF])
        tl.store(out_row + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cache,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """One token per program: grid ``(T,)``.

    Loads the token's cos/sin row once and rotates all its query and key
    heads. Neox pairs column ``j`` with ``j + D/2``; GPT-J pairs ``2j`` with
    ``2j + 1``.
    """
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    half_mask = offs < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cache + offs, mask=half_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cache + HALF + offs, mask=half_mask, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_qt,
        q_out_ptr + token * stride_qot,
        stride_qh,
        stride_qoh,
        cos,
        sin,
        NUM_HEADS,
        BLOCK_HQ,
        HALF,
        BLOCK_HALF,
        IS_NEOX,
    )
    _rotate_heads(
        k_ptr + token * stride_kt,
        k_out_ptr + token * stride_kot,
        stride_kh,
        stride_koh,
        cos,
        sin,
        NUM_KV_HEADS,
        BLOCK_HK,
        HALF,
        BLOCK_HALF,
        IS_NEOX,
    )


def apply_rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``query`` ``[T, H, D]`` and ``key`` ``[T, Hkv, D]`` at ``positions`` ``[T]``.

    Returns new contiguous tensors in the inputs' dtypes; inputs may be strided
    views with a contiguous head dimension.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if cos_sin_cache.shape[-1] != head_dim or key.shape[2] != head_dim:
        raise ValueError("cos_sin_cache, query and key must share head_dim")
    if query.stride(2) != 1 or key.stride(2) != 1:
        raise ValueError("apply_rotary needs head_dim contiguous in query and key")
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    positions = positions.contiguous()
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        q_out,
        k_out,
        positions,
        cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        IS_NEOX=is_neox,
        num_warps=4,
    )
    return q_out, k_out
