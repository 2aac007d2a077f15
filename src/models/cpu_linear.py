"""Linear layers on the CPU with weights reordered ("packed") once: fp32 in column panels
for legato's own kernel on AVX-512 CPUs, oneDNN's blocked layout otherwise.

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

On a CPU with AVX-512, weights computed in fp32 are held in column panels instead
(:class:`PanelLinear`) and multiplied by legato's native loop (``cpu_kernels.dense_matmul``),
which streams the weights once while it computes: about 1.5x oneDNN's speed at the rows of a
decode step, the same at a prefill's (``benchmarks/linear_floor.py``).

The original weight storage is released once packed, unless another module
shares it (a tied LM head keeps the embedding table). Never imports trio.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
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


def panels_preferred() -> bool:
    """Whether fp32 weights go in column panels here: the native kernels load and the CPU
    runs their AVX-512 loop (elsewhere oneDNN's layout, unmeasured against the portable loop)."""
    return cpu_kernels.available() and cpu_kernels.dense_matmul_avx512()


def weight_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` as fp32 column panels ``[ceil(N / 48), K, 48]``: ``panels[p, k,
    j] = weight[48 p + j, k]``, zeros past ``N`` (the layout ``cpu_kernels.dense_matmul``
    reads)."""
    n, k = weight.shape
    width = cpu_kernels.DENSE_PANEL
    count = -(-n // width)
    padded = weight.detach().float()
    if n % width:  # only a partial last panel needs a padded copy first
        padded = torch.zeros(count * width, k, dtype=torch.float32)
        padded[:n] = weight.detach()
    return padded.reshape(count, width, k).transpose(1, 2).contiguous()


@dataclass(frozen=True, slots=True)
class PanelLinear:
    """``F.linear(x, W, b)`` with ``W`` held in fp32 column panels (:func:`weight_panels`).

    Inputs and outputs are in ``dtype`` (bf16 is widened to fp32 and the result rounded
    back, as :class:`PackedLinear` does where the CPU has no native bf16).
    """

    panels: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype
    in_features: int
    out_features: int
    kernel: Any = field(repr=False, compare=False)  # cpu_kernels.dense_matmul_kernel()

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> PanelLinear:
        b = bias.detach().float().contiguous() if bias is not None else None
        out_features, in_features = weight.shape
        return cls(
            weight_panels(weight),
            b,
            weight.dtype,
            in_features,
            out_features,
            cpu_kernels.dense_matmul_kernel(),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).float()
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        m, n = rows.shape[0], self.out_features
        out = rows.new_empty(m, n)
        bias = self.bias.data_ptr() if self.bias is not None else None
        code = self.kernel(
            rows.data_ptr(), rows.stride(0), m, self.in_features, self.panels.data_ptr(),
            n, bias, out.data_ptr(), n, torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"dense_matmul: the kernel refused its arguments ({code})")
        out = out.view(*lead, n)
        return out.to(self.dtype) if self.dtype != torch.float32 else out

    @property
    def nbytes(self) -> int:
        bias = self.bias.numel() if self.bias is not None else 0
        return (self.panels.numel() + bias) * 4


def pack_linears(model: nn.Module) -> int:
    """Pack every :class:`~legato.models.layers.Linear` of ``model`` (CPU, fp32/bf16): in
    column panels where the weights compute in fp32 and :func:`panels_preferred`, for oneDNN
    otherwise. Returns the bytes now held packed (0 when nothing was packed: another device
    or dtype, or neither path here). A layer whose packing fails or disagrees with
    ``F.linear`` stays unpacked.
    """
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears:
        return 0
    weight = linears[0].weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return 0
    fp32_compute = weight.dtype == torch.float32 or not native_bf16()
    panels = fp32_compute and panels_preferred()
    if not panels and not packing_available():
        return 0
    pack = PanelLinear.pack if panels else PackedLinear.pack
    shared = {id(m.weight) for m in model.modules() if isinstance(m, Embedding)}
    total = 0
    generator = torch.Generator().manual_seed(0)
    for layer in linears:
        if layer.packed is not None or layer.weight.numel() == 0:
            continue
        try:
            packed = pack(layer.weight, layer.bias)
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
        where = "in column panels for the native kernel" if panels else "for oneDNN"
        logger.info("linear weights packed %s (%.0f MB): %s", where, total / 2**20, how)
    return total


def unpack_linears(model: nn.Module) -> None:
    """Drop every packed copy (the weights must be reloaded before the next forward)."""
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.packed = None
