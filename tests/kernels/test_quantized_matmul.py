"""Triton weight-only matmul over GGUF-quantized weights against "dequantize, then F.linear".

The weights are random GGUF blocks of each kept type, repacked by
``legato.models.quantized.from_gguf`` as the model loader does; the reference
weight is ``gguf.quants.dequantize`` of the same blocks. Runs under
``TRITON_INTERPRET=1`` on CPU (fp32 and fp16 only: the interpreter's bf16 is
not the hardware's), on a GPU where one is present.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from legato.kernels.quantized_matmul import LaunchConfig, launch_config, quantized_matmul
from legato.models.quantized import QuantizedWeight, from_gguf
from legato.testing.gguf_blocks import random_blocks
from legato.testing.gguf_blocks import reference_weight as gguf_weight


def on(weight: QuantizedWeight, device: str) -> QuantizedWeight:
    offsets = weight.offsets.to(device) if weight.offsets is not None else None
    return QuantizedWeight(
        weight.codes.to(device),
        weight.scales.to(device),
        offsets,
        weight.bits,
        weight.group,
        weight.kind,
    )


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize(("rows", "out_features"), [(1, 37), (17, 70)])
def test_fp32_matches_dequantize_then_linear(
    device: str, kind: str, rows: int, out_features: int
) -> None:
    """fp32: only the summation order differs from the reference, so each output is within
    fp32 rounding of the sum of its products' magnitudes (random K-quant sub-scales make
    large terms that cancel). Odd N and M > 16 reach the masked edges of the tiles; 256
    columns hold one K-quant super-block."""
    raw = random_blocks(kind, out_features, 256, seed=rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    weight = on(from_gguf(raw, kind, out_features, 256), device)
    got = quantized_matmul(x.to(device), weight)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    reference = gguf_weight(raw, kind).double()
    expected = F.linear(x.double(), reference)
    bound = 1e-5 * F.linear(x.double().abs(), reference.abs()) + 1e-6
    assert ((got.cpu().double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_fp16_multiplies_the_weight_rounded_to_fp16(device: str, kind: str) -> None:
    """fp16 inputs: the product of fp16 operands summed in fp32, rounded to fp16 once."""
    raw = random_blocks(kind, 40, 512, seed=3)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3)).half()
    got = quantized_matmul(x.to(device), on(from_gguf(raw, kind, 40, 512), device))
    assert got.dtype == torch.float16
    expected = F.linear(x.float(), gguf_weight(raw, kind).half().float()).half()
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-3, atol=2e-3)


def test_strided_input_and_empty_batch(device: str) -> None:
    """A column slice of a wider activation is read through its row stride; M = 0 is empty."""
    raw = random_blocks("Q4_0", 20, 64, seed=5)
    weight = on(from_gguf(raw, "Q4_0", 20, 64), device)
    wide = torch.randn(4, 96, generator=torch.Generator().manual_seed(5))
    x = wide[:, 16:80]
    got = quantized_matmul(wide.to(device)[:, 16:80], weight)
    expected = F.linear(x, gguf_weight(raw, "Q4_0"))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)
    assert quantized_matmul(torch.empty(0, 64, device=device), weight).shape == (0, 20)


def test_refuses_what_it_cannot_take(device: str) -> None:
    weight = on(from_gguf(random_blocks("Q8_0", 4, 64, seed=6), "Q8_0", 4, 64), device)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        quantized_matmul(torch.zeros(2, 32, device=device), weight)
    with pytest.raises(ValueError, match="x must be fp32, fp16 or bf16"):
        quantized_matmul(torch.zeros(2, 64, dtype=torch.float64, device=device), weight)
    bad = QuantizedWeight(weight.codes, weight.scales[:, :1], None, 8, 32, "Q8_0")
    with pytest.raises(ValueError, match="scales must be fp32"):
        quantized_matmul(torch.zeros(2, 64, device=device), bad)


@pytest.mark.parametrize(
    ("kind", "config"),
    [
        ("Q4_1", LaunchConfig(16, 16, 64, split_k=4)),
        ("Q6_K", LaunchConfig(16, 32, 32, split_k=2)),
        ("Q8_0", LaunchConfig(32, 128, 128)),
        ("Q4_K", launch_config(1, 50, 512, 4, "cuda")),  # CUDA's decode default: split K
        ("Q5_K", launch_config(1, 50, 512, 8, "cuda")),
    ],
)
def test_launch_configs_agree(device: str, kind: str, config: LaunchConfig) -> None:
    """Every tiling the GPU sweep may pick (split K summed atomically in fp32, wide tiles
    masked at the edges) gives the reference's result; fp16 in, fp16 out."""
    raw = random_blocks(kind, 50, 512, seed=7)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(7)).half()
    weight = on(from_gguf(raw, kind, 50, 512), device)
    got = quantized_matmul(x.to(device), weight, config)
    assert got.dtype == torch.float16
    expected = F.linear(x.float(), gguf_weight(raw, kind).half().float())
    torch.testing.assert_close(got.cpu().float(), expected, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="does not divide in_features 512"):
        quantized_matmul(x.to(device), weight, config._replace(split_k=3))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize(("rows", "block_m", "split"), [(1, 1, 1), (3, 4, 2), (2, 2, 1)])
def test_fp32_rows_summed_in_registers(
    device: str, kind: str, rows: int, block_m: int, split: int
) -> None:
    """``gemv`` (fp32 rows; CUDA's default for one) takes the products of
    the 16-row dot in another summation order: within fp32 rounding of the reference,
    odd N masked, K split too; any other dtype is refused, naming it."""
    raw = random_blocks(kind, 37, 512, seed=10 + rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    weight = on(from_gguf(raw, kind, 37, 512), device)
    config = LaunchConfig(block_m, 16, 64, split, gemv=True)
    got = quantized_matmul(x.to(device), weight, config)
    reference = gguf_weight(raw, kind).double()
    expected = F.linear(x.double(), reference)
    bound = 1e-5 * F.linear(x.double().abs(), reference.abs()) + 1e-6
    assert got.shape == (rows, 37)
    assert ((got.cpu().double() - expected).abs() <= bound).all()
    with pytest.raises(ValueError, match="gemv is for fp32 x, got torch.float16"):
        quantized_matmul(x.half().to(device), weight, config)


def test_cuda_decode_default_sums_one_fp32_row_in_registers() -> None:
    """A 16-row IEEE dot would pad one fp32 row 16 times on the CUDA cores: one fp32 row
    takes ``gemv`` tiles of 16 weight rows, K split into as many slices (up to 8, any
    count dividing its steps) as keep to 2048 programs; 16-bit rows and 2 or more keep
    the dot."""
    one = launch_config(1, 960, 576, 4, "cuda", fp32=True)
    assert one == LaunchConfig(1, 16, 64, 3, gemv=True)  # 9 steps of 64: 60 tiles x 3
    assert launch_config(1, 4096, 4096, 4, "cuda", fp32=True).split_k == 8
    assert launch_config(1, 28672, 4096, 4, "cuda", fp32=True).split_k == 1  # 1792 tiles
    assert not launch_config(2, 960, 576, 4, "cuda", fp32=True).gemv
    assert not launch_config(1, 960, 576, 4, "cuda").gemv
