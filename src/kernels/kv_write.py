# @triton.jit kernels take untyped tensor/pointer arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton KV-cache write: store each token's new K/V rows at its slot in the paged cache.

Same contract as :func:`legato.kernels.reference.write_kv`. Imports triton at
module import; reach it through :func:`legato.kernels.get_kernels`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_kv"]


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_block,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_block,
    stride_vc_tok,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
):
    """One token per program: grid ``(T,)``.

    Copies the token's ``[num_kv_heads, head_dim]`` K and V rows as one
    ``[BLOCK_H, BLOCK_D]`` tile each (contiguous along ``head_dim``), casting to
    the cache dtype. A negative slot is padding: nothing is written.
    """
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // PAGE
        in_page = slot % PAGE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        row = token.to(tl.int64)
        k = tl.load(
            key_ptr + row * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
        )
        v = tl.load(
            value_ptr + row * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
        )
        kc = key_cache_ptr + block * stride_kc_block + in_page * stride_kc_tok
        vc = value_cache_ptr + block * stride_vc_block + in_page * stride_vc_tok
        kc_ptrs = kc + offs_h[:, None] * stride_kc_head + offs_d[None, :]
        vc_ptrs = vc + offs_h[:, None] * stride_vc_head + offs_d[None, :]
        tl.store(kc_ptrs, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptrs, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[T]``.

    Slots < 0 are skipped; the caches are written in place. ``key``/``value``
    may be strided views (e.g. slices of a fused QKV output) as long as
    ``head_dim`` is contiguous.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("write_kv needs head_dim contiguous in key and value")
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("write_kv needs head_dim contiguous in the caches")
    slot_mapping = slot_mapping.contiguous()
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        PAGE=key_cache.shape[1],
        num_warps=max(1, min(8, block_h * block_d // 256)),  # >= 8 elements per thread
    )
