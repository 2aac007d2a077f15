"""Triton silu_and_mul against the reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from legato.kernels import activation, reference


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((2, 3, 2 * 100), torch.float32),
        ((5, 2 * 3000), torch.float16),
        ((4, 2 * 1000), torch.bfloat16),
    ],
)
def test_silu_and_mul(
    tol: Callable[[torch.dtype], dict[str, float]],
    device: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(4)
    x = (4 * torch.randn(shape, generator=gen)).to(dtype).to(device)
    out = activation.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out, reference.silu_and_mul(x), **tol(dtype))
