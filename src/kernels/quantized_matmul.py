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

A ``tl.dot`` takes at least 16 rows, and an IEEE fp32 dot runs on the CUDA
cores, not the tensor cores: a one-row fp32 call padded to 16 rows does 16
times its arithmetic. So with ``LaunchConfig.gemv`` fp32 rows (a tile of any
power of 2) multiply and sum in registers instead (``[rows, weight rows, K
step]`` products summed over K): the same fp32 products in another summation
order. CUDA's default takes it for one row (H100: 2.6 to 5x the dot's speed).

The reference is ``QuantizedWeight.dequantize`` followed by ``F.linear``
(tests/kernels/test_quantized_matmul.py, under ``TRITON_INTERPRET=1`` on CPU).
Imports triton at module import; never imports legato.models (the layer above):
the weight is anything with the :class:`QuantizedLayout` attributes.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import triton
import triton.language as tl

__all__ = ["LaunchConfig", "QuantizedLayout", "launch_config", "quantized_matmul"]


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
def _dot_acc(x, w, acc, FP32_DOT: tl.constexpr, GEMV: tl.constexpr):
    """``acc + x @ w^T`` for ``x`` ``[BLOCK_M, K]`` and the fp32 weight tile ``w``
    ``[BLOCK_N, K]``: in IEEE fp32 (as products summed in registers when ``GEMV``),
    or on ``w`` rounded to ``x``'s dtype."""
    if GEMV:
        return acc + tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # fp32 x (checked)
    if FP32_DOT:
        return tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w.to(x.dtype)), acc)


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
    SPLIT_K: tl.constexpr,
    GEMV: tl.constexpr,
):
    """Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K)``; each program one
    ``[BLOCK_M, BLOCK_N]`` tile of the output over its ``K // SPLIT_K`` slice of K,
    walked in ``BLOCK_K`` steps (a multiple of 32 dividing the slice). Per step, each
    weight row's codes are one contiguous run of bytes and each group's scale (and
    offset) one load, widened in registers. ``SPLIT_K > 1``
    adds the slices' partial sums into a zeroed fp32 ``out`` atomically (small M, where
    the ``N`` tiles alone are too few programs to stream the weight at full bandwidth)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    cols64 = cols.to(tl.int64)
    code_row = codes_ptr + cols64[:, None] * codes_row_bytes  # [BLOCK_N, 1]
    group_row = cols64[:, None] * groups_per_row  # [BLOCK_N, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_slice = K // SPLIT_K
    x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    for k0 in range(pid_k * k_slice, (pid_k + 1) * k_slice, BLOCK_K):
        if BITS == 8:
            GROUPS: tl.constexpr = BLOCK_K // GROUP
            # Each weight row's codes for this K step are contiguous bytes: one coalesced load.
            packed = tl.load(
                code_row + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=col_mask[:, None], other=0
            )
            group_at = group_row + (k0 // GROUP + tl.arange(0, GROUPS))[None, :]
            scale = tl.load(scales_ptr + group_at, mask=col_mask[:, None], other=0.0)
            w3 = tl.reshape(packed.to(tl.float32), (BLOCK_N, GROUPS, GROUP)) * scale[:, :, None]
            if HAS_OFFSET:
                offset = tl.load(offsets_ptr + group_at, mask=col_mask[:, None], other=0.0)
                w3 = w3 + offset[:, :, None]
            x = tl.load(
                x_row + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=row_mask[:, None], other=0.0
            )
            acc = _dot_acc(x, tl.reshape(w3, (BLOCK_N, BLOCK_K)), acc, FP32_DOT, GEMV)
        else:
            # Byte j of a 32-run holds the low 4 bits of code j (low nibble) and of code
            # j + 16 (high nibble): the low nibbles meet x's first 16 columns of each run,
            # the high ones the last 16. 5/6-bit codes add bits 4 and 5 from their planes.
            RUNS: tl.constexpr = BLOCK_K // 32
            HALF: tl.constexpr = BLOCK_K // 2
            nibbles = tl.load(
                code_row + (k0 // 2 + tl.arange(0, HALF))[None, :], mask=col_mask[:, None], other=0
            ).to(tl.int32)
            at_low = k0 + (tl.arange(0, HALF) // 16) * 32 + tl.arange(0, HALF) % 16  # [HALF]
            low = nibbles & 0x0F
            high = nibbles >> 4
            if BITS > 4:
                # A run's 32 codes take 4 bytes of each plane: bytes 0-1 hold the bits of
                # codes 0-15 (the low nibbles' codes), bytes 2-3 those of codes 16-31. Each
                # byte is loaded once and spread over its 8 codes in registers (a load per
                # code, 8 of them reading each byte, ran at 3% of the memory floor).
                pair = tl.arange(0, BLOCK_K // 16)  # [RUNS * 2]: run pair // 2, byte pair % 2
                byte_low = k0 // 8 + (pair // 2) * 4 + pair % 2
                bit = tl.arange(0, 8)[None, None, :]
                for plane in tl.static_range(BITS - 4):
                    plane_row = code_row + K // 2 + plane * (K // 8)
                    lo = tl.load(plane_row + byte_low[None, :], mask=col_mask[:, None], other=0)
                    hi = tl.load(
                        plane_row + (byte_low + 2)[None, :], mask=col_mask[:, None], other=0
                    )
                    lo_bits = (lo.to(tl.int32)[:, :, None] >> bit) & 1  # [BLOCK_N, RUNS * 2, 8]
                    hi_bits = (hi.to(tl.int32)[:, :, None] >> bit) & 1
                    low = low | (tl.reshape(lo_bits, (BLOCK_N, HALF)) << (4 + plane))
                    high = high | (tl.reshape(hi_bits, (BLOCK_N, HALF)) << (4 + plane))
            run_k = k0 + tl.arange(0, RUNS) * 32  # each run's first column
            at_low_group = group_row + (run_k // GROUP)[None, :]  # [BLOCK_N, RUNS]
            at_high_group = group_row + ((run_k + 16) // GROUP)[None, :]
            scale_low = tl.load(scales_ptr + at_low_group, mask=col_mask[:, None], other=0.0)
            scale_high = tl.load(scales_ptr + at_high_group, mask=col_mask[:, None], other=0.0)
            w_low = tl.reshape((low - CENTRE).to(tl.float32), (BLOCK_N, RUNS, 16))
            w_high = tl.reshape((high - CENTRE).to(tl.float32), (BLOCK_N, RUNS, 16))
            w_low = w_low * scale_low[:, :, None]
            w_high = w_high * scale_high[:, :, None]
            if HAS_OFFSET:
                off_low = tl.load(offsets_ptr + at_low_group, mask=col_mask[:, None], other=0.0)
                off_high = tl.load(offsets_ptr + at_high_group, mask=col_mask[:, None], other=0.0)
                w_low = w_low + off_low[:, :, None]
                w_high = w_high + off_high[:, :, None]
            x_low = tl.load(x_row + at_low[None, :], mask=row_mask[:, None], other=0.0)
            x_high = tl.load(x_row + (at_low + 16)[None, :], mask=row_mask[:, None], other=0.0)
            acc = _dot_acc(x_low, tl.reshape(w_low, (BLOCK_N, HALF)), acc, FP32_DOT, GEMV)
            acc = _dot_acc(x_high, tl.reshape(w_high, (BLOCK_N, HALF)), acc, FP32_DOT, GEMV)
    at = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols64[None, :]
    if SPLIT_K == 1:
        tl.store(at, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
    else:
        tl.atomic_add(at, acc, mask=row_mask[:, None] & col_mask[None, :], sem="relaxed")


class LaunchConfig(NamedTuple):
    """How one call is tiled and launched (``num_warps`` / ``num_stages``: Triton's)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False  # fp32 only: products summed in registers, block_m any power of 2


def launch_config(
    m: int, n: int, k: int, bits: int, device_type: str, fp32: bool = False
) -> LaunchConfig:
    """The default tiling of an ``[m, k] x [n, k]^T`` call on ``device_type``
    (``benchmarks/gpu/quantized_matmul.py --sweep`` times the alternatives).

    CUDA, up to 16 rows (decode): tiles of 32 weight rows by 256 codes (64 for ``fp32``
    activations, whose IEEE dots would spill registers on sm_90 at 256), K split until
    there are about two programs per SM of an H100 / H200 (132), so that the weight
    streams from every SM at once. One fp32 row sums in registers (``gemv``), over
    tiles of 16 weight rows by 64 codes with K split into the most slices up to 8
    (any count dividing its steps) that keep to 2048 programs: many small programs
    keep more loads in flight (``--sweep --dtype fp32`` on an H100: 960 x 576 in 8.4
    us split 3, 4096 x 4096 in 32.9 us split 8; the 16-row dot took 26.5 and 164.8).
    2 to 4 fp32 rows keep the dot: at its tiling the registers' form was slower on
    the default model's shapes (29.5 against 26.3 us at 4 rows), and no other tiling
    of theirs was timed. More rows: 64- or 128-row tiles. CPU (the
    interpreter, tests only): small tiles keep the run short."""
    if device_type != "cuda":
        return LaunchConfig(16 if m <= 16 else 32 if m <= 32 else 64, 64, 64 if k % 64 == 0 else 32)
    if m <= 16:
        block_k = next(b for b in ((64,) if fp32 else (256, 128, 64)) + (32,) if k % b == 0)
        if fp32 and m == 1:
            tiles, steps = triton.cdiv(n, 16), k // block_k
            split = max(d for d in range(1, 9) if steps % d == 0 and (d == 1 or tiles * d <= 2048))
            return LaunchConfig(1, 16, block_k, split, gemv=True)
        block_n = 32
        tiles = triton.cdiv(n, block_n)
        split = 1
        while split < 8 and tiles * split * 2 <= 264 and k % (block_k * split * 2) == 0:
            split *= 2
        return LaunchConfig(16, block_n, block_k, split)
    block_k = 64 if k % 64 == 0 else 32
    return LaunchConfig(64 if m <= 64 else 128, 64, block_k)


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


def quantized_matmul(
    x: torch.Tensor, weight: QuantizedLayout, config: LaunchConfig | None = None
) -> torch.Tensor:
    """``x @ W^T`` for ``x`` ``[M, K]`` (fp32, fp16 or bf16) and a quantized ``W``
    ``[N, K]``: an ``[M, N]`` tensor in ``x``'s dtype. ``config`` overrides
    :func:`launch_config` (its ``block_k * split_k`` must divide K). Raises ValueError
    for shapes, dtypes, devices or a config the kernel does not take. Launches
    asynchronously on CUDA."""
    n, k = _check(x, weight)
    m = int(x.shape[0])
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    config = config or launch_config(
        m, n, k, weight.bits, x.device.type, fp32=x.dtype == torch.float32
    )
    if config.block_k % 32 or k % (config.block_k * config.split_k):
        raise ValueError(f"quantized_matmul: {config} does not divide in_features {k}")
    if config.gemv and x.dtype != torch.float32:
        raise ValueError(f"quantized_matmul: gemv is for fp32 x, got {x.dtype}")
    split = config.split_k > 1
    out = (torch.zeros if split else torch.empty)(
        m, n, dtype=torch.float32 if split else x.dtype, device=x.device
    )
    x = x if x.stride(1) == 1 else x.contiguous()
    codes = weight.codes.contiguous()
    if weight.bits == 8:
        codes = codes.view(torch.int8)
    scales = weight.scales.contiguous()
    offsets = weight.offsets.contiguous() if weight.offsets is not None else scales
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
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
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=config.split_k,
        GEMV=config.gemv,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out.to(x.dtype) if split else out
