# @triton.jit kernels take untyped tensor/pointer arguments:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton weight-only matmul over GGUF-quantized weights in legato's repacked layout.

``quantized_matmul(x, weight)`` computes ``x @ W^T`` where ``W`` is held as
:class:`legato.models.quantized.QuantizedWeight` holds it (the one layout that
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K are repacked into at load):

- ``codes`` uint8 ``[N, K * bits // 8]``. ``bits == 8``: one signed byte per
  weight. ``bits == 4``: each run of 32 codes is 16 bytes, code ``j`` in the low
  nibble of byte ``j`` and code ``j + 16`` in its high nibble. ``bits == 5`` / ``6``:
  the low 4 bits of every code so (``K / 2`` bytes), then a bit plane of ``K / 8``
  bytes per high bit (bit ``k % 8`` of byte ``k / 8`` is bit 4, then 5, of code ``k``).
- ``scales`` fp32 ``[N, K // group]`` and optional ``offsets`` of the same
  shape: ``w[n, k] = (code - centre) * scales[n, k // group] (+ offsets[n, k // group])``,
  the centre ``2 ** (bits - 1)`` for 5- and 6-bit codes without offsets, else 0.

The weight is formed in fp32 inside the kernel, tile by tile, and never
written out: a weight-only kernel whose memory traffic is the codes and
scales. fp32 inputs multiply in fp32 (IEEE, no TF32), so the result differs
from "dequantize, then ``F.linear``" only by summation order; fp16 / bf16
inputs multiply the weight rounded to their dtype, accumulating in fp32, as
a tensor-core matmul does. The result has the input's dtype.

The reference is ``QuantizedWeight.dequantize`` followed by ``F.linear``
(tests/kernels/test_quantized_matmul.py, under ``TRITON_INTERPRET=1`` on CPU).
Imports triton at module import; never imports legato.models (the layer above):
the weight is anything with the :class:`QuantizedLayout` attributes.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

__all__ = ["QuantizedLayout", "quantized_matmul"]


class QuantizedLayout(Protocol):
    """What the kernel reads of a quantized weight (``QuantizedWeight`` has these)."""

    @property
    def codes(self) -> torch.Tensor: ...
    @property
    def scales(self) -> torch.Tensor: ...
    @property
    def offsets(self) -> torch.Tensor | None: ...
    @property
    def bits(self) -> int: ...
    @property
    def group(self) -> int: ...
    @property
    def centre(self) -> int: ...


@triton.jit
def _quantized_matmul_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    offsets_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    codes_row_bytes,
    groups_per_row,
    BITS: tl.constexpr,
    CENTRE: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``; each program one ``[BLOCK_M, BLOCK_N]``
    tile of the output, walking K in ``BLOCK_K`` steps (a multiple of 32, dividing K)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :],
            mask=row_mask[:, None],
            other=0.0,
        )
        if BITS != 8:
            byte = (ks // 32) * 16 + (ks % 16)
            shift = ((ks % 32) // 16) * 4
            packed = tl.load(
                codes_ptr + cols64[None, :] * codes_row_bytes + byte[:, None],
                mask=col_mask[None, :],
                other=0,
            )
            bits = (packed.to(tl.int32) >> shift[:, None]) & 0x0F
            for plane in tl.static_range(BITS - 4):
                high = tl.load(
                    codes_ptr
                    + cols64[None, :] * codes_row_bytes
                    + (K // 2 + plane * (K // 8) + ks // 8)[:, None],
                    mask=col_mask[None, :],
                    other=0,
                )
                bits = bits | (((high.to(tl.int32) >> (ks % 8)[:, None]) & 1) << (4 + plane))
            code = (bits - CENTRE).to(tl.float32)
        else:
            code = tl.load(
                codes_ptr + cols64[None, :] * codes_row_bytes + ks[:, None],
                mask=col_mask[None, :],
                other=0,
            ).to(tl.float32)
        group_at = cols64[None, :] * groups_per_row + (ks // GROUP)[:, None]
        scale = tl.load(scales_ptr + group_at, mask=col_mask[None, :], other=0.0)
        w = code * scale  # [BLOCK_K, BLOCK_N], fp32, as dequantize forms it
        if HAS_OFFSET:
            w = w + tl.load(offsets_ptr + group_at, mask=col_mask[None, :], other=0.0)
        if FP32_DOT:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols64[None, :],
        out,
        mask=row_mask[:, None] & col_mask[None, :],
    )


def _check(x: torch.Tensor, weight: QuantizedLayout) -> tuple[int, int]:
    """(N, K) of ``weight`` after checking it against ``x``; ValueError naming what is wrong."""
    bits, group = weight.bits, weight.group
    if bits not in (4, 5, 6, 8):
        raise ValueError(f"quantized_matmul: bits must be 4, 5, 6 or 8, got {bits}")
    if group not in (16, 32):
        raise ValueError(f"quantized_matmul: group must be 16 or 32, got {group}")
    codes, scales, offsets = weight.codes, weight.scales, weight.offsets
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError("quantized_matmul: codes must be a 2-D uint8 tensor")
    n = int(codes.shape[0])
    k = int(codes.shape[1]) * 8 // bits
    if k % 32:
        raise ValueError(f"quantized_matmul: in_features {k} is not a multiple of 32")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"quantized_matmul: x must be [M, {k}], got {list(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"quantized_matmul: x must be fp32, fp16 or bf16, got {x.dtype}")
    want = (n, k // group)
    for name, t in (("scales", scales), ("offsets", offsets)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != want):
            raise ValueError(f"quantized_matmul: {name} must be fp32 {list(want)}")
    tensors = [x, codes, scales] + ([offsets] if offsets is not None else [])
    if len({t.device for t in tensors}) != 1:
        raise ValueError("quantized_matmul: x and the weight must be on one device")
    return n, k


def quantized_matmul(x: torch.Tensor, weight: QuantizedLayout) -> torch.Tensor:
    """``x @ W^T`` for ``x`` ``[M, K]`` (fp32, fp16 or bf16) and a quantized ``W``
    ``[N, K]``: an ``[M, N]`` tensor in ``x``'s dtype. Raises ValueError for shapes,
    dtypes or devices the kernel does not take. Launches asynchronously on CUDA."""
    n, k = _check(x, weight)
    m = int(x.shape[0])
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    codes = weight.codes.contiguous()
    if weight.bits == 8:
        codes = codes.view(torch.int8)
    scales = weight.scales.contiguous()
    offsets = weight.offsets.contiguous() if weight.offsets is not None else scales
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    block_k = 64 if k % 64 == 0 else 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quantized_matmul_kernel[grid](
        x,
        codes,
        scales,
        offsets,
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        codes.shape[1],
        scales.shape[1],
        BITS=weight.bits,
        CENTRE=weight.centre,
        GROUP=weight.group,
        HAS_OFFSET=weight.offsets is not None,
        FP32_DOT=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out
