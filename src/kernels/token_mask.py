# @triton.jit kernels take untyped tensor/pointer arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton kernel that applies structured outputs' token bitmask to logits rows.

Same contract as :func:`legato.kernels.reference.apply_token_bitmask`. One
program per (masked row, block of tokens): it reads the block's bitmask words
and stores ``-inf`` only where a token is disallowed. Imports triton at module
import; :func:`legato.structured.mask.apply_token_bitmask` reaches it on CUDA
(or under ``TRITON_INTERPRET``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["apply_token_bitmask"]

_BLOCK = 1024


@triton.jit
def _token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    logits_stride,
    bitmask_stride,
    vocab,
    words,
    BLOCK: tl.constexpr,
):
    """Grid ``(masked rows, token blocks)``; tokens past the bitmask's width are disallowed."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    word_idx = tokens // 32
    word = tl.load(
        bitmask_ptr + i.to(tl.int64) * bitmask_stride + word_idx,
        mask=in_vocab & (word_idx < words),
        other=0,
    )
    allowed = ((word >> (tokens % 32)) & 1) != 0
    neg_inf = tl.full((BLOCK,), float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride + tokens, neg_inf, mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """``logits[rows[i], t] = -inf`` where bit ``t`` of ``bitmask[i]`` is clear, in place."""
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    if bitmask.dtype != torch.int32:
        raise ValueError("bitmask must be int32")
    if rows.shape[0] != bitmask.shape[0]:
        raise ValueError("one bitmask row per masked logits row")
    if rows.shape[0] == 0:
        return
    vocab = logits.shape[-1]
    grid = (rows.shape[0], triton.cdiv(vocab, _BLOCK))
    _token_bitmask_kernel[grid](
        logits,
        bitmask,
        rows,
        logits.stride(0),
        bitmask.stride(0),
        vocab,
        bitmask.shape[-1],
        BLOCK=_BLOCK,
    )
