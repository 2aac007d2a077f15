"""Triton weight-only matmul over GGUF-quantized weights against "dequantize, then F.linear".

The weights are random GGUF blocks of each kept type, repacked by
``legato.models.quantized.from_gguf`` as the model loader does; the reference
weight is ``gguf.quants.dequantize`` of the same blocks. Runs under
``TRITON_INTERPRET=1`` on CPU (fp32 and fp16 only: the interpreter's bf16 is
not the hardware's), on a GPU where one is present.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from legato.kernels.quantized_matmul import quantized_matmul
from legato.models.quantized import QuantizedWeight, from_gguf

_BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24)}
_BLOCK |= {"Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
_HALF_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2)}
_HALF_FIELDS |= {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fp16 scales / mins


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """``[rows, bytes]`` GGUF blocks of ``kind``: random codes and sub-scales, fp16
    scales in a sane range (random bytes there would be NaN or huge)."""
    rng = np.random.default_rng(seed)
    per, size = _BLOCK[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for at in _HALF_FIELDS[kind]:
        half = rng.uniform(-0.05, 0.05, size=(rows, cols // per)).astype(np.float16)
        blocks[..., at : at + 2] = half.view(np.uint8).reshape(rows, cols // per, 2)
    return blocks.reshape(rows, -1)


def gguf_weight(raw: np.ndarray, kind: str) -> torch.Tensor:
    """gguf's own dequantization of ``raw``: the fp32 weight the blocks stand for."""
    values = dequantize(raw, GGMLQuantizationType[kind])
    return torch.from_numpy(np.asarray(values, dtype=np.float32).copy())


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
    """fp32: only the summation order differs from the reference. Odd N and M > 16
    reach the masked edges of the tiles; 256 columns hold one K-quant super-block."""
    raw = random_blocks(kind, out_features, 256, seed=rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    weight = on(from_gguf(raw, kind, out_features, 256), device)
    got = quantized_matmul(x.to(device), weight)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    expected = F.linear(x, gguf_weight(raw, kind))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)


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
