"""GGUF-quantized weights kept quantized in memory, and the weight-only matmul over them.

A GGUF tensor of a type in :data:`KEPT_TYPES` is repacked once, at load, into
one layout that the native kernels (``legato_quantized_matmul_int8`` and
``legato_quantized_matmul_f32`` in ``cpu_kernels.cpp``) read: per output row, K unsigned
integer codes and, per group of ``group`` codes, an fp32 scale and (for the types with an
offset) an fp32 offset, so that ``w = (code - centre) * scale (+ offset)``:

========  =====  =====  ======  ======  ================================
type      bits   group  offset  centre  bytes / file bytes (per 32)
========  =====  =====  ======  ======  ================================
Q4_0      4      32     -8 d    0       24 / 18 (1.33x)
Q4_1      4      32     m       0       24 / 20 (1.2x)
Q5_0      5      32     none    16      24 / 22 (1.09x)
Q5_1      5      32     m       0       28 / 24 (1.17x)
Q4_K      4      32     -dmin m 0       24 / 18 (1.33x)
Q5_K      5      32     -dmin m 0       28 / 22 (1.27x)
Q6_K      6      16     none    32      32 / 26.25 (1.22x)
Q8_0      8      32     none    0       36 / 34 (1.06x)
========  =====  =====  ======  ======  ================================

Code bytes of one row (``K * bits / 8`` of them):

- ``bits == 8``: one signed byte per code (Q8_0's own int8 values; centre 0).
- ``bits == 4``: per run of 32 codes 16 bytes, code ``j`` in the low nibble of byte ``j``
  and code ``j + 16`` in its high nibble.
- ``bits == 5`` / ``6``: the low 4 bits of every code as in ``bits == 4`` (``K / 2``
  bytes), then one bit plane per high bit (``K / 8`` bytes each: bit ``k % 8`` of byte
  ``k / 8`` is bit 4, then bit 5, of code ``k``). The 5- and 6-bit codes without offsets
  (Q5_0, Q6_K) are centred (``centre = 2 ** (bits - 1)``); with offsets they are not.

Why this layout and not the file's blocks as they are: one kernel (four code
widths) serves eight types, the per-group scale is decoded once at load instead
of on every token (the K-quants pack 6-bit sub-scales), and the scales are fp32
so the weight the kernel forms is bit-identical to what ``gguf.quants.dequantize``
returns. The 5/6-bit split into a nibble part and bit planes (ggml keeps the high
bits apart too) keeps them near the file's size: the VNNI kernel turns the planes
into 64-lane byte masks with one load (a ``__mmask64`` per 64 codes) and adds the high
bits with one masked add, so the extra bits cost two instructions per 64 codes, not a
byte per code (the 8-bit repacking before held them at 1.64-1.83x the file).
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
faster than the integer tile from 2 rows up. (A verification step's rows of one
sequence take the integer tile, to match a one-row step bit for bit; there, on
AVX-512 VNNI, 8-bit codes meet the two digits as one int16, ``256 q + r``, by
``vpdpwssd``: the same exact int32 sums, in fewer instructions a row.)

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
    nibble order and the bit planes), ``scales`` / ``offsets`` fp32 ``[N, K // group]``;
    ``kind`` names the GGUF type it came from.
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
    def centre(self) -> int:
        """What is taken from every code before scaling (5/6-bit codes without offsets)."""
        return 1 << (self.bits - 1) if self.bits in (5, 6) and self.offsets is None else 0

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

    def to(self, device: torch.device) -> QuantizedWeight:
        """This weight on ``device`` (itself when it is there already)."""
        if self.codes.device == device:
            return self
        offsets = self.offsets.to(device) if self.offsets is not None else None
        return QuantizedWeight(
            self.codes.to(device), self.scales.to(device), offsets, self.bits, self.group,
            self.kind,
        )  # fmt: skip

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weight (only ``rows``, int64, when given): ``(code - centre) * scale (+ offset)``."""
        codes, scales, offsets = self.codes, self.scales, self.offsets
        if rows is not None:
            codes, scales = codes.index_select(0, rows), scales.index_select(0, rows)
            offsets = offsets.index_select(0, rows) if offsets is not None else None
        values = unpack_codes(codes, self.bits).float() - float(self.centre)
        n = codes.shape[0]
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
        fallback always computes in fp32. On CUDA ``x`` may also be fp16 or bf16 (``out``
        then in its dtype): the Triton kernel :func:`legato.kernels.quantized_matmul`."""
        if x.device.type == "cuda":
            from ..kernels.quantized_matmul import quantized_matmul  # triton: on first use

            result = quantized_matmul(x, self)
            return result if out is None else out.copy_(result)
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


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[N, K]`` int16 codes from their packed ``[N, K * bits // 8]`` bytes (module docstring);
    8-bit codes come back signed, the others unsigned."""
    n = codes.shape[0]
    if bits == 8:
        return codes.view(torch.int8).to(torch.int16)
    k = codes.shape[1] * 8 // bits
    chunks = codes[:, : k // 2].reshape(n, -1, 16)
    values = torch.cat((chunks & 0x0F, chunks >> 4), dim=-1).reshape(n, k).to(torch.int16)
    shifts = torch.arange(8, dtype=torch.int16, device=codes.device)
    for plane in range(bits - 4):
        start = k // 2 + plane * (k // 8)
        packed = codes[:, start : start + k // 8].to(torch.int16)
        bit = (packed.unsqueeze(-1) >> shifts) & 1
        values |= bit.reshape(n, k) << (4 + plane)
    return values


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
        then equals the plain step's bit for bit. On CUDA: the Triton kernel."""
        if x.device.type == "cuda":
            return self._call_triton(x)
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

    def _call_triton(self, x: torch.Tensor) -> torch.Tensor:
        """CUDA: each part through the Triton kernel in ``x``'s dtype, parts side by side."""
        flat = x.reshape(-1, self.in_features)
        outs = [part.matmul(flat) for part in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out.view(*x.shape[:-1], self.out_features)

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


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """``[n, K]`` unsigned codes below ``2 ** bits`` (4, 5 or 6) -> ``[n, K * bits // 8]``
    bytes: the low nibbles as :func:`_pack_nibbles` packs them, then a bit plane per high bit."""
    n = codes.shape[0]
    low = _pack_nibbles((codes & 0x0F).reshape(n, -1, 32)).reshape(n, -1)
    planes = [
        np.packbits((codes >> np.uint8(b)) & 1, axis=-1, bitorder="little") for b in range(4, bits)
    ]
    packed: np.ndarray = np.concatenate([low, *planes], axis=-1)
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
        packed = _pack_codes(codes.reshape(n, -1), 5)
        d = _f16(flat[:, 0:2]).reshape(n, -1)
        if kind == "Q5_0":  # centred: w = (code - 16) * d
            return _weight(packed, d, None, 5, 32, kind)
        m = _f16(flat[:, 2:4]).reshape(n, -1)
        return _weight(packed, d, m, 5, 32, kind)
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
        codes = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << np.uint8(4))).astype(np.uint8)
        scale = (d * sc).reshape(n, -1)  # centred: w = (code - 32) * scale
        return _weight(_pack_codes(codes.reshape(n, -1), 6), scale, None, 6, 16, kind)
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
    return _weight(_pack_codes(codes.reshape(n, -1), 5), scale, offset, 5, 32, kind)


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
