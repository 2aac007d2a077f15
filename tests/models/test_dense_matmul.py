"""The dense fp32 matmul over column panels (cpu_kernels.dense_matmul, cpu_linear.PanelLinear):
F.linear's product on both of its loops, which agree bit for bit, at a decode step's rows
and a prefill's."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from legato.models import cpu_kernels
from legato.models.cpu_linear import (
    PanelLinear,
    pack_linears,
    panels_preferred,
    weight_panels,
)
from legato.models.layers import Linear

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="the native CPU kernels did not build here"
)

CPU = torch.device("cpu")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@pytest.fixture
def portable_loop() -> Iterator[None]:
    """dense_matmul pinned to its portable loop for the test, then restored."""
    before = cpu_kernels.dense_matmul_avx512()
    cpu_kernels.dense_matmul_avx512(False)
    yield
    cpu_kernels.dense_matmul_avx512(before)


def test_weight_panels_hold_48_columns_a_panel_k_major_zero_padded() -> None:
    w = _randn(50, 7, seed=0)
    panels = weight_panels(w)
    assert panels.shape == (2, 7, 48) and panels.is_contiguous()
    assert torch.equal(panels[0, 3, 5], w[5, 3]) and torch.equal(panels[1, 6, 1], w[49, 6])
    assert torch.equal(panels[1, :, :2].T, w[48:]) and not panels[1, :, 2:].any()


# Sizes that leave partial panels, partial vector masks (N - 48 p < 16, < 32), partial row
# tiles (8 rows), partial k blocks (128), and several row passes (K = 2048: an x of over 1 MB,
# 150 rows, takes three passes of 56, 56 and 38 rows; 70 rows one pass).
SHAPES = [(29, 37), (48, 64), (97, 200), (130, 129), (50, 2048), (576, 576)]
ROWS = [1, 3, 8, 9, 17, 70, 150]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_both_loops_give_f_linear_and_the_same_bits(n: int, k: int, bias: bool) -> None:
    """Every row count against F.linear in fp64, and the AVX-512 loop (where the CPU has it)
    equal bit for bit to the portable one: both sum over k in order from the bias."""
    w = _randn(n, k, seed=n + k)
    b = _randn(n, seed=1) if bias else None
    panels = weight_panels(w)
    before = cpu_kernels.dense_matmul_avx512()
    try:
        for rows in ROWS:
            x = _randn(rows, k, seed=rows)
            results = []
            for avx512 in (False, True):
                if cpu_kernels.dense_matmul_avx512(avx512) != avx512:
                    continue  # no AVX-512 here: the portable loop alone
                results.append(cpu_kernels.dense_matmul(x, panels, n, b))
            for got in results:
                torch.testing.assert_close(got, _reference(x, w, b), atol=1e-4, rtol=1e-4)
            assert all(torch.equal(results[0], r) for r in results)
    finally:
        cpu_kernels.dense_matmul_avx512(before)


def test_strided_rows_and_an_output_view(portable_loop: None) -> None:
    """Rows of x with a stride past K, written into a column slice of a wider output."""
    w, b = _randn(61, 40, seed=2), _randn(61, seed=3)
    wide = _randn(5, 64, seed=4)
    x = wide[:, 3:43]
    out = torch.full((5, 80), 7.0)
    cpu_kernels.dense_matmul(x, weight_panels(w), 61, b, out=out[:, 10:71])
    torch.testing.assert_close(out[:, 10:71], _reference(x, w, b), atol=1e-4, rtol=1e-4)
    assert (out[:, :10] == 7.0).all() and (out[:, 71:] == 7.0).all()


def test_a_layout_it_does_not_take_is_refused_naming_the_kernel() -> None:
    w = _randn(30, 16, seed=5)
    x = _randn(2, 16, seed=6)
    with pytest.raises(ValueError, match="dense_matmul"):
        cpu_kernels.dense_matmul(x, weight_panels(w)[:, :15], 30)  # panels of another K
    with pytest.raises(ValueError, match="dense_matmul"):
        cpu_kernels.dense_matmul(x.double(), weight_panels(w).double(), 30)
    with pytest.raises(ValueError, match="dense_matmul"):
        cpu_kernels.dense_matmul(x, weight_panels(w), 30, bias=torch.zeros(29))


@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_linear_is_f_linear(rows: int, dtype: torch.dtype) -> None:
    """A 3-D input keeps its leading shape, and bf16 comes back as bf16."""
    w, b = _randn(100, 72, seed=7).to(dtype), _randn(100, seed=8).to(dtype)
    layer = PanelLinear.pack(w, b)
    x = _randn(1, rows, 72, seed=9).to(dtype)
    got = layer(x)
    assert got.shape == (1, rows, 100) and got.dtype == dtype and got.is_contiguous()
    want = _reference(x.float()[0], w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[0].float(), want, atol=tol, rtol=tol)
    assert layer.nbytes == (3 * 72 * 48 + 100) * 4  # 100 columns: 3 panels of 48


def test_pack_linears_holds_fp32_in_panels_where_the_cpu_runs_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """fp32 weights go in panels where the AVX-512 loop runs (oneDNN's layout elsewhere),
    the unpacked weight is freed, the log names the layout, and the outputs stay."""
    layer = Linear(37, 29, bias=True, dtype=torch.float32, device=CPU)
    layer.weight.data, layer.bias.data = _randn(29, 37, seed=10), _randn(29, seed=11)  # type: ignore[union-attr]
    model = nn.Sequential(layer)
    x = _randn(6, 37, seed=12)
    before = layer(x)
    caplog.set_level(logging.INFO, logger="legato.models.cpu_linear")
    total = pack_linears(model)
    if not panels_preferred():
        assert not isinstance(layer.packed, PanelLinear)
        pytest.skip("this CPU holds fp32 weights in oneDNN's layout (no AVX-512)")
    assert isinstance(layer.packed, PanelLinear) and layer.weight.numel() == 0
    assert total == layer.packed.nbytes
    assert "column panels" in caplog.text
    torch.testing.assert_close(layer(x), before, atol=1e-5, rtol=1e-5)
