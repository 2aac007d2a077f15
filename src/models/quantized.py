"""GGUF-quantized weights kept quantized in memory, and the weight-only matmul over them.

A GGUF tensor of a type in :data:`KEPT_TYPES` is repacked once, at load, into
one layout that the native kernels (``legato_quantized_matmul_int8`` and
``legato_quantized_matmul_f32`` in ``cpu_kernels.cpp``) read: per output row, K integer codes and, per group of
``group`` codes, an fp32 scale and (for the types with an offset) an fp32
offset, so that ``w = code * scale (+ offset)``:

========  =====================  =====  =====  ======  ==========================
type      codes                  bits   group  offset  bytes / file bytes
========  =====================  =====  =====  ======  ==========================
Q4_0      nibble 0..15           4      32     -8 d    24 / 18 (1.33x)
Q4_1      nibble 0..15           4      32     m       24 / 20 (1.2x)
Q5_0      int8 -16..15           8      32     none    36 / 22 (1.64x)
Q5_1      byte 0..31             8      32     m       40 / 24 (1.67x)
Q4_K      nibble 0..15           4      32     -dmin m 24 / 18 (1.33x)
Q5_K      byte 0..31             8      32     -dmin m 40 / 22 (1.8x)
Q6_K      int8 -32..31           8      16     none    48 / 26.25 (1.83x)
Q8_0      int8                   8      32     none    36 / 34 (1.06x)
========  =====================  =====  =====  ======  ==========================

Why this layout and not the file's blocks as they are: one kernel (two code
widths) serves six types, the per-group scale is decoded once at load instead
of on every token (the K-quants pack 6-bit sub-scales), and the scales are fp32
so the weight the kernel forms is bit-identical to what ``gguf.quants.dequantize``
returns. The price is memory above the file's for the 5- and 6-bit types (a
nibble-plus-high-bits layout would bring them back to about 1.1x; not done).
Q5_0 / Q5_1 are kept too: llama.cpp's Q4_K_M falls back to them for tensors whose
rows are not a multiple of 256 (every matrix of SmolLM2-135M, 576 wide).

Computation, by default for one input row (the decode of one stream;
``int8_max_rows``): integer dot products as llama.cpp computes them, each input
row held as two int8 digits per block of 32 (about 16 bits: ggml's q8_0 code
plus a second digit for what it rounded off; one digit alone lost 6% top-1
agreement on the default model), each group's ``codes . x_codes`` an exact
int32 dot product (AVX-512 VNNI, AVX2 or portable, chosen at run time), then
scaled in fp32; the offset term uses the exact fp32 sum of x. More rows take
the fp32 tile below, which forms each weight once for all rows and measured
faster than the integer tile from 2 rows up.

The fidelity path (``int8_max_rows=0``, engine argument
``gguf_activations="fp32"``): activations stay fp32 (bf16 inputs are widened and the result
rounded back), products are summed in fp32: a weight-only matmul whose only
difference from "dequantize, then ``F.linear``" is fp32 rounding order (several
input rows: each weight is formed exactly, then multiplied; one input row, the
decode case: ``sum_g scale_g * (codes_g . x_g) + offset_g * sum(x_g)``, half the
vector work). Without
the native kernels (no compiler, ``LEGATO_CPU_KERNELS=0``) :meth:`QuantizedWeight.matmul`
dequantizes a slab of rows at a time and calls ``F.linear``: the portable fallback.

Never imports trio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import cpu_kernels

KEPT_TYPES: tuple[str, ...] = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
"""GGML types held quantized (names as in ``gguf.GGMLQuantizationType``); others are dequantized."""

_FALLBACK_ROWS = 1024  # rows dequantized at a time by the plain-torch fallback


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A ``[out_features, in_features]`` weight as codes plus per-group scales (and offsets).

    ``codes`` uint8 ``[N, K * bits // 8]`` (see the module docstring for the
    nibble order), ``scales`` / ``offsets`` fp32 ``[N, K // group]``; ``kind``
    names the GGUF type it came from.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    group: int
    kind: str

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.codes.shape[1]) * 8 // self.bits

    @property
    def nbytes(self) -> int:
        extra = self.offsets.nbytes if self.offsets is not None else 0
        return int(self.codes.nbytes + self.scales.nbytes + extra)

    def layout(self) -> tuple[int, int, bool]:
        """What the kernel dispatches on; weights of one layout can be stacked."""
        return self.bits, self.group, self.offsets is not None

    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight made of rows ``index`` (int64) of this one, in that order."""
        offsets = self.offsets.index_select(0, index) if self.offsets is not None else None
        return QuantizedWeight(
            self.codes.index_select(0, index),
            self.scales.index_select(0, index),
            offsets,
            self.bits,
            self.group,
            self.kind,
        )

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weight (only ``rows``, int64, when given): ``code * scale (+ offset)``."""
        codes, scales, offsets = self.codes, self.scales, self.offsets
        if rows is not None:
            codes, scales = codes.index_select(0, rows), scales.index_select(0, rows)
            offsets = offsets.index_select(0, rows) if offsets is not None else None
        n = codes.shape[0]
        if self.bits == 4:
            chunks = codes.view(n, -1, 16)
            values = torch.cat((chunks & 0x0F, chunks >> 4), dim=-1).view(n, -1).float()
        else:
            values = codes.view(torch.int8).float()  # unsigned codes (Q5_1, Q5_K) are < 128
        grouped = values.view(n, -1, self.group) * scales.unsqueeze(-1)
        if offsets is not None:
            grouped = grouped + offsets.unsqueeze(-1)
        return grouped.view(n, -1)

    def matmul(
        self, x: torch.Tensor, out: torch.Tensor | None = None, int8_activations: bool = False
    ) -> torch.Tensor:
        """``x @ W^T`` for fp32 ``x`` ``[M, K]`` (unit column stride); writes ``out``
        (``[M, N]`` fp32, unit column stride: a column slice of a wider tensor is fine)
        when given, and returns it. ``int8_activations``: the native kernel rounds ``x`` to
        int8 per block of 32 first (:func:`.cpu_kernels.quantized_matmul`); the plain-torch
        fallback always computes in fp32."""
        if out is None:
            out = x.new_empty(x.shape[0], self.out_features)
        if cpu_kernels.available() and x.device.type == "cpu":
            return cpu_kernels.quantized_matmul(
                x, self.codes, self.scales, self.offsets, self.bits, self.group, out,
                int8_activations,
            )  # fmt: skip
        for start in range(0, self.out_features, _FALLBACK_ROWS):
            rows = torch.arange(start, min(start + _FALLBACK_ROWS, self.out_features))
            out[:, start : start + len(rows)] = F.linear(x, self.dequantize(rows).to(x.device))
        return out


def stack_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose rows are ``parts``' rows in order (all of one :meth:`layout`)."""
    first = parts[0]
    if any(p.layout() != first.layout() or p.in_features != first.in_features for p in parts):
        raise ValueError("stack_rows: the parts differ in layout or width")
    offsets = (
        torch.cat([p.offsets for p in parts if p.offsets is not None])
        if first.offsets is not None
        else None
    )
    kinds = "+".join(dict.fromkeys(p.kind for p in parts))
    return QuantizedWeight(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        offsets,
        first.bits,
        first.group,
        kinds,
    )


class QuantizedLinear:
    """``F.linear(x, W)`` for a weight made of row blocks, each a :class:`QuantizedWeight`.

    Blocks of one layout are stacked into one (a fused qkv or gate/up projection
    is then one kernel call); blocks of different layouts (a Q4_K_M file keeps
    ``attn_v`` in Q6_K beside Q4_K ``attn_q``) write their columns of one output.
    Inputs and outputs are in the input's dtype. Inputs of at most ``int8_max_rows``
    rows (default 1: a decode step of one stream) go through the integer kernel (the
    input as int8 digits per block of 32, integer group sums); others, and all with 0,
    through fp32 arithmetic throughout (the fidelity path, equal to "dequantize, then
    ``F.linear``" up to rounding order).
    """

    def __init__(self, parts: Sequence[QuantizedWeight], int8_max_rows: int = 1) -> None:
        if not parts:
            raise ValueError("QuantizedLinear needs at least one part")
        runs: list[list[QuantizedWeight]] = []
        for part in parts:
            if runs and runs[-1][-1].layout() == part.layout():
                runs[-1].append(part)
            else:
                runs.append([part])
        self.parts: tuple[QuantizedWeight, ...] = tuple(
            run[0] if len(run) == 1 else stack_rows(run) for run in runs
        )
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.int8_max_rows = int8_max_rows
        self._direct: list[tuple[Any, ...]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def _direct_calls(self) -> list[tuple[Any, ...]]:
        """Per part, the native kernel's weight arguments, checked once (through the checked
        wrapper on one row) so that a call pays no per-argument checks; [] without the kernel."""
        if self._direct is None:
            self._direct = []
            if cpu_kernels.available() and self.parts[0].codes.device.type == "cpu":
                probe = torch.zeros(1, self.in_features)
                for part in self.parts:
                    part.matmul(probe)  # raises for anything the kernel would not take
                    offsets = part.offsets.data_ptr() if part.offsets is not None else None
                    weight = (part.codes.data_ptr(), part.bits, part.group, part.out_features)
                    self._direct.append((*weight, part.scales.data_ptr(), offsets))
        return self._direct

    def __call__(self, x: torch.Tensor, sequences: int | None = None) -> torch.Tensor:
        """``x @ W^T``. ``sequences``: compute each row as a step of that many rows would
        (the rows of a verification step, several a sequence, computed as a plain decode
        step of ``sequences`` rows computes each): the integer kernel when ``sequences <=
        int8_max_rows``, and for one sequence in fp32 the one-row kernel row by row. Each
        kernel's per-row arithmetic does not depend on the other rows, so a row's result
        then equals the plain step's bit for bit."""
        rows = x.numel() // self.in_features
        integer = (rows if sequences is None else sequences) <= self.int8_max_rows
        if sequences == 1 and not integer and rows > 1:
            flat = x.reshape(-1, self.in_features)
            out = torch.cat([self(flat[i : i + 1]) for i in range(flat.shape[0])])
            return out.view(*x.shape[:-1], self.out_features)
        direct = self._direct_calls()
        if direct and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return self._call_direct(x, direct, integer)
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        wide = flat.float() if flat.dtype != torch.float32 else flat
        if wide.stride(-1) != 1:
            wide = wide.contiguous()
        if len(self.parts) == 1:
            out = self.parts[0].matmul(wide, None, integer)
        else:
            out = wide.new_empty(wide.shape[0], self.out_features)
            start = 0
            for part in self.parts:
                columns = out[:, start : start + part.out_features]
                part.matmul(wide, columns, integer)
                start += part.out_features
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out.view(*lead, self.out_features)

    def _call_direct(
        self, x: torch.Tensor, direct: list[tuple[Any, ...]], integer: bool
    ) -> torch.Tensor:
        """The decode hot path: a contiguous fp32 ``[M, K]`` input, one ctypes call per part."""
        rows, width = x.shape
        if width != self.in_features:
            raise ValueError(f"quantized linear: input width {width}, expected {self.in_features}")
        out = x.new_empty(rows, self.out_features)
        if rows == 0:
            return out
        kernel = cpu_kernels.quantized_matmul_kernel(integer)
        threads = torch.get_num_threads()
        column = out.data_ptr()
        for codes, bits, group, n, scales, offsets in direct:
            code = kernel(x.data_ptr(), width, rows, width, codes, bits, group, n, scales,
                          offsets, column, self.out_features, threads)  # fmt: skip
            if code != 0:
                raise ValueError(f"quantized_matmul: the kernel refused its arguments ({code})")
            column += n * 4  # the next part's first column (fp32)
        return out


# ------------------------------------------------------------------ GGUF blocks -> codes


def _f16(raw: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.ascontiguousarray(raw).view(np.float16).astype(np.float32)
    return out


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """``[..., 32]`` codes 0..15 -> ``[..., 16]`` bytes: code j low, code j + 16 high."""
    packed: np.ndarray = (values[..., :16] | (values[..., 16:] << np.uint8(4))).astype(np.uint8)
    return packed


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 six-bit sub-block scales and mins packed in 12 bytes."""
    from gguf.quants import Q4_K

    sc, mn = Q4_K.get_scale_min(scales)
    return sc.astype(np.float32), mn.astype(np.float32)


def from_gguf(raw: np.ndarray, kind: str, out_features: int, in_features: int) -> QuantizedWeight:
    """Repack a GGUF tensor's raw blocks (``[out_features, row bytes]`` uint8) of type
    ``kind`` (one of :data:`KEPT_TYPES`). Raises ValueError for another type or a size
    that does not match."""
    rows = np.ascontiguousarray(raw, dtype=np.uint8).reshape(out_features, -1)
    n = out_features
    if kind in ("Q5_0", "Q5_1"):
        block = 22 if kind == "Q5_0" else 24
        blocks = rows.reshape(n, -1, block)
        if blocks.shape[1] * 32 != in_features:
            raise ValueError(f"{kind}: {in_features} columns do not fill the blocks")
        flat = blocks.reshape(-1, block)
        at = 2 if kind == "Q5_0" else 4
        high: np.ndarray = np.ascontiguousarray(flat[:, at : at + 4]).view(np.uint32)
        high = (high >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & np.uint32(1)
        low: np.ndarray = flat[:, at + 4 :].reshape(-1, 1, 16) >> np.array(
            [0, 4], np.uint8
        ).reshape(1, 2, 1)
        codes: np.ndarray = (low.reshape(-1, 32) & 0x0F) | (high.astype(np.uint8) << np.uint8(4))
        d = _f16(flat[:, 0:2]).reshape(n, -1)
        if kind == "Q5_0":
            signed = (codes.astype(np.int8) - np.int8(16)).view(np.uint8)
            return _weight(signed.reshape(n, -1), d, None, 8, 32, kind)
        m = _f16(flat[:, 2:4]).reshape(n, -1)
        return _weight(codes.reshape(n, -1), d, m, 8, 32, kind)
    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        block = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
        blocks = rows.reshape(n, -1, block)
        if blocks.shape[1] * 32 != in_features:
            raise ValueError(f"{kind}: {in_features} columns do not fill the blocks")
        d = _f16(blocks[..., :2]).reshape(n, -1)
        if kind == "Q8_0":
            return _weight(blocks[..., 2:], d, None, 8, 32, kind)
        if kind == "Q4_0":
            return _weight(blocks[..., 2:], d, -8.0 * d, 4, 32, kind)
        m = _f16(blocks[..., 2:4]).reshape(n, -1)
        return _weight(blocks[..., 4:], d, m, 4, 32, kind)
    k_block = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}.get(kind)
    if k_block is None:
        raise ValueError(f"GGUF type {kind} is not kept quantized (kept: {', '.join(KEPT_TYPES)})")
    blocks = rows.reshape(n, -1, k_block)
    nb = blocks.shape[1]
    if nb * 256 != in_features:
        raise ValueError(f"{kind}: {in_features} columns do not fill the blocks")
    flat = blocks.reshape(n * nb, k_block)
    if kind == "Q6_K":
        ql, qh = flat[:, :128], flat[:, 128:192]
        sc = np.ascontiguousarray(flat[:, 192:208]).view(np.int8).astype(np.float32)
        d = _f16(flat[:, 208:210])
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (
            qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        ) & 3
        codes = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << np.uint8(4))).astype(np.int8)
        codes = codes - np.int8(32)
        scale = (d * sc).reshape(n, -1)
        return _weight(codes.view(np.uint8).reshape(n, -1), scale, None, 8, 16, kind)
    d, dmin = _f16(flat[:, 0:2]), _f16(flat[:, 2:4])
    sc, mn = _k_scale_min(flat[:, 4:16])
    scale, offset = (d * sc).reshape(n, -1), (-(dmin * mn)).reshape(n, -1)
    if kind == "Q4_K":
        qs = flat[:, 16:144].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        values = (qs & 0x0F).reshape(-1, 8, 32)
        return _weight(_pack_nibbles(values).reshape(n, -1), scale, offset, 4, 32, kind)
    qh, qs = flat[:, 16:48], flat[:, 48:176]  # Q5_K
    low = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    codes = (low.reshape(-1, 8, 32) | (high << np.uint8(4))).astype(np.uint8)
    return _weight(codes.reshape(n, -1), scale, offset, 8, 32, kind)


def _weight(
    codes: np.ndarray,
    scales: np.ndarray,
    offsets: np.ndarray | None,
    bits: int,
    group: int,
    kind: str,
) -> QuantizedWeight:
    n = codes.shape[0]

    def tensor(a: np.ndarray, dtype: type) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype).reshape(n, -1).copy())

    return QuantizedWeight(
        tensor(codes, np.uint8),
        tensor(scales, np.float32),
        tensor(offsets, np.float32) if offsets is not None else None,
        bits,
        group,
        kind,
    )
