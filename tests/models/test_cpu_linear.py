"""legato.models.cpu_linear: packed oneDNN linears, on both kinds of CPU.

The bf16 path depends on the CPU: packed bf16 where it computes bf16 natively, fp32
instructions over widened weights elsewhere. The ``cpu_bf16`` fixture runs each test
as on both kinds, so one machine checks the path the other kind takes.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from legato.models.cpu_linear import PackedLinear, pack_linears, packing_available
from legato.models.layers import Linear

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")

CPU = torch.device("cpu")


def _random_linear(dtype: torch.dtype, bias: bool, seed: int) -> Linear:
    generator = torch.Generator().manual_seed(seed)
    layer = Linear(37, 29, bias=bias, dtype=dtype, device=CPU)  # odd sizes on purpose
    layer.weight.data = torch.randn(29, 37, generator=generator).to(dtype)
    if layer.bias is not None:
        layer.bias.data = torch.randn(29, generator=generator).to(dtype)
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_computes_natively_only_where_the_cpu_does(cpu_bf16: str | None, bias: bool) -> None:
    """bf16 weights are packed as bf16 on a CPU with native bf16 and widened to fp32
    elsewhere; either way the product is the bf16 matmul (fp32 accumulation), in bf16."""
    layer = _random_linear(torch.bfloat16, bias, seed=1)
    packed = PackedLinear.pack(layer.weight, layer.bias)
    assert packed.compute_dtype == (torch.bfloat16 if cpu_bf16 else torch.float32)
    assert packed.nbytes == (29 * 37 + (29 if bias else 0)) * packed.compute_dtype.itemsize
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = F.linear(
        x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float()
    )
    got = packed(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_fp32_is_packed_as_fp32_on_every_cpu(cpu_bf16: str | None) -> None:
    layer = _random_linear(torch.float32, bias=True, seed=3)
    packed = PackedLinear.pack(layer.weight, layer.bias)
    assert packed.compute_dtype == torch.float32
    x = torch.randn(4, 37, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(packed(x), F.linear(x, layer.weight, layer.bias))


def test_pack_linears_says_which_path_it_took(
    cpu_bf16: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """pack_linears packs every layer, frees the unpacked weights, keeps the outputs, and
    logs the path: widened fp32 only where the CPU has no native bf16."""
    model = nn.Sequential(_random_linear(torch.bfloat16, True, 5), nn.Identity())
    layer = model[0]
    assert isinstance(layer, Linear)
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    before = layer(x).float()
    caplog.set_level(logging.INFO, logger="legato.models.cpu_linear")
    total = pack_linears(model)
    assert layer.packed is not None and layer.weight.numel() == 0
    assert total == layer.packed.nbytes
    widened = "fp32-widened weights" in caplog.text
    assert widened == (cpu_bf16 is None)
    torch.testing.assert_close(layer(x).float(), before, atol=3e-2, rtol=3e-2)
