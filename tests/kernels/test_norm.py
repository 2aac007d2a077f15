"""Triton RMSNorm and fused add + RMSNorm against the reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from legato.kernels import norm, reference, triton_interpreting


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((3, 5, 100), torch.float32), ((7, 4096), torch.float16), ((2, 300), torch.bfloat16)],
)
def test_rms_norm(
    tol: Callable[[torch.dtype], dict[str, float]],
    device: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype).to(device)
    weight = torch.randn(shape[-1], generator=gen).to(dtype).to(device)
    out = norm.rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-6), **tol(dtype))


@pytest.mark.parametrize(
    ("hidden", "dtype"), [(96, torch.float32), (1000, torch.float16), (4096, torch.bfloat16)]
)
def test_fused_add_rms_norm(
    tol: Callable[[torch.dtype], dict[str, float]], device: str, hidden: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, hidden, generator=gen).to(dtype).to(device)
    residual = torch.randn(6, hidden, generator=gen).to(dtype).to(device)
    weight = torch.rand(hidden, generator=gen).to(torch.float32).to(device)  # fp32 weight
    x_before, r_before = x.clone(), residual.clone()
    out, new_residual = norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    exact: dict[str, float] = {"rtol": 0, "atol": 0}  # the same sum, rounded once
    if dtype == torch.bfloat16 and triton_interpreting():
        exact = {"rtol": 2**-7, "atol": 0}  # the interpreter's bf16 rounding is off by an ulp
    torch.testing.assert_close(new_residual, ref_residual, **exact)
    torch.testing.assert_close(out, ref_out, **tol(dtype))
    assert torch.equal(x, x_before) and torch.equal(residual, r_before)  # inputs untouched


def test_rms_norm_strided_rows(tol: Callable[[torch.dtype], dict[str, float]], device: str) -> None:
    x = torch.randn(5, 2 * 64, device=device)[:, :64]
    weight = torch.randn(64, device=device)
    torch.testing.assert_close(
        norm.rms_norm(x, weight, 1e-6),
        reference.rms_norm(x, weight, 1e-6),
        **tol(torch.float32),
    )
