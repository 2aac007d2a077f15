# @triton.jit kernels take untyped tensor/pointer arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton RMSNorm and fused residual-add + RMSNorm.

Same contracts as :func:`legato.kernels.reference.rms_norm` and
:func:`legato.kernels.reference.fused_add_rms_norm`: statistics in fp32, results
in the input dtype. A row must fit in one tile (hidden size up to 65536).
Imports triton at module import; reach it through
:func:`legato.kernels.get_kernels`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fused_add_rms_norm", "rms_norm"]

_MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    """One row per program: grid ``(rows,)``, the whole row as one ``BLOCK`` tile.

    With ``ADD_RESIDUAL`` the row is ``x + residual``, rounded to the input
    dtype (stored as the new residual) before it is normalised, as the
    reference does.
    """
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + offs, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, hidden]`` with a contiguous last dimension (a view when possible)."""
    flat = t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"rms_norm supports hidden sizes up to {_MAX_HIDDEN}, got {hidden}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else None
    x2 = _rows(x)
    if x2.shape[0] == 0:
        return out, new_residual
    r2 = _rows(residual) if residual is not None else x2
    o2 = out.view(-1, hidden)
    nr2 = new_residual.view(-1, hidden) if new_residual is not None else o2
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight.contiguous(),
        o2,
        nr2,
        x2.stride(0),
        r2.stride(0),
        o2.stride(0),
        nr2.stride(0),
        eps,
        HIDDEN=hidden,
        BLOCK=block,
        ADD_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 512)),
    )
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension; a new tensor in ``x``'s dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``; return ``(rms_norm(residual), residual)`` as new tensors."""
    if residual.shape != x.shape:
        raise ValueError("x and residual must have the same shape")
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual
