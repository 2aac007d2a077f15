# @triton.jit kernels take untyped tensor/pointer arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton SwiGLU gate: ``silu(x[..., :d]) * x[..., d:]``.

Same contract as :func:`legato.kernels.reference.silu_and_mul` (fp32 math,
result in the input dtype). Imports triton at module import; reach it through
:func:`legato.kernels.get_kernels`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["silu_and_mul"]

_BLOCK = 2048


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid ``(rows, cdiv(d, BLOCK))``: each program gates ``BLOCK`` contiguous columns of one row."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dimension ``2d``; a new tensor."""
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0 or d == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(d))
    o2 = out.view(-1, d)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
        x2,
        o2,
        x2.stride(0),
        o2.stride(0),
        D=d,
        BLOCK=block,
        num_warps=min(8, max(1, block // 256)),
    )
    return out
