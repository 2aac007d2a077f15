"""Linear layers on the CPU through oneDNN, with weights reordered ("packed") once.

``F.linear`` on the CPU calls MKL's sgemm for fp32, which lays out the weight
anew on every call, and for bf16 runs oneDNN's bf16 path, which on a CPU
without native bf16 (no AVX512_BF16 / AMX) emulates it several times slower
than fp32. :func:`pack_linears` reorders every weight once into oneDNN's
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's
weight prepacking uses) and runs it with ``torch.ops.mkldnn._linear_pointwise``:

- fp32: packed fp32;
- bf16 on a CPU with native bf16: packed bf16;
- bf16 elsewhere: the weights are widened to fp32 once and packed; the bf16
  activations are widened per call and the result rounded back to bf16. The
  products of bf16 values are exact in fp32 and oneDNN accumulates in fp32
  either way, so this is the same bf16 matmul computed on fp32 instructions,
  at the cost of fp32-sized weights.

The original weight storage is released once packed, unless another module
shares it (a tied LM head keeps the embedding table). Never imports trio.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import cpu_native_bf16
from .layers import Embedding, Linear

logger = logging.getLogger(__name__)

BATCH_HINT = 64  # rows oneDNN picks the blocked layout for; measured best from 1 to 2048 rows


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512_BF16 or AMX)."""
    return cpu_native_bf16() is not None


def packing_available() -> bool:
    """Whether oneDNN's packed linear ops exist in this torch build."""
    mkldnn_built = bool(torch._C._has_mkldnn)
    return mkldnn_built and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """``F.linear(x, W, b)`` with ``W`` held in oneDNN's layout in ``compute_dtype``.

    Inputs and outputs are in ``dtype``; ``compute_dtype`` differs (fp32) only
    for bf16 on a CPU without native bf16.
    """

    packed: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype
    compute_dtype: torch.dtype
    in_features: int
    out_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        dtype = weight.dtype
        compute = dtype if dtype == torch.float32 or native_bf16() else torch.float32
        w = weight.detach().to(compute).contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)
        b = bias.detach().to(compute) if bias is not None else None
        return cls(packed, b, dtype, compute, weight.shape[1], weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.dtype != self.compute_dtype
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.to(self.compute_dtype) if wide else x, self.packed, self.bias, "none", [], ""
        )
        return out.to(self.dtype) if out.dtype != self.dtype else out

    @property
    def nbytes(self) -> int:
        size = self.in_features * self.out_features + (
            self.out_features if self.bias is not None else 0
        )
        return size * self.compute_dtype.itemsize


def pack_linears(model: nn.Module) -> int:
    """Pack every :class:`~legato.models.layers.Linear` of ``model`` (CPU, fp32/bf16); returns
    the bytes now held packed (0 when nothing was packed: another device or dtype, or no
    oneDNN). A layer whose packing fails or disagrees with ``F.linear`` stays unpacked.
    """
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears or not packing_available():
        return 0
    weight = linears[0].weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return 0
    shared = {id(m.weight) for m in model.modules() if isinstance(m, Embedding)}
    total = 0
    generator = torch.Generator().manual_seed(0)
    for layer in linears:
        if layer.packed is not None or layer.weight.numel() == 0:
            continue
        try:
            packed = PackedLinear.pack(layer.weight, layer.bias)
            probe = torch.randn(3, packed.in_features, generator=generator).to(layer.weight.dtype)
            tol = 1e-4 if layer.weight.dtype == torch.float32 else 3e-2
            expected = F.linear(probe, layer.weight, layer.bias).float()
            if not torch.allclose(packed(probe).float(), expected, atol=tol, rtol=tol):
                raise RuntimeError("packed result differs from F.linear")
        except RuntimeError as exc:
            logger.warning("linear layer left unpacked (%s)", exc)
            continue
        layer.packed = packed
        total += packed.nbytes
        if id(layer.weight) not in shared:  # the packed copy is the only one needed now
            layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)
            if layer.bias is not None:
                layer.bias.data = torch.empty(0, dtype=layer.bias.dtype)
    if total:
        how = (
            "fp32 instructions over fp32-widened weights (this CPU has no native bf16)"
            if weight.dtype == torch.bfloat16 and not native_bf16()
            else f"{str(weight.dtype).removeprefix('torch.')}"
        )
        logger.info("linear weights packed for oneDNN (%.0f MB): %s", total / 2**20, how)
    return total


def unpack_linears(model: nn.Module) -> None:
    """Drop every packed copy (the weights must be reloaded before the next forward)."""
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.packed = None
