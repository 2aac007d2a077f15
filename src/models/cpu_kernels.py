"""Native CPU kernels (``cpu_kernels.cpp`` and the parts it includes from ``native/``),
built on first use and called through ctypes.

The C++ source has no dependency but a C++17 compiler with OpenMP: on first
use it is compiled with ``-O3 -march=native -fopenmp`` into
``$LEGATO_HOME/kernels/`` (a name that hashes the sources, the flags, the
compiler and this CPU's flags, so a changed source or another machine gets a
fresh build; about two seconds) and loaded with ctypes. Its OpenMP binds to the
libgomp torch has loaded, so the kernels share torch's threads.

Without a compiler (or with ``LEGATO_CPU_KERNELS=0``) :func:`load` returns None
once, with a log line, and callers keep their plain-torch path.

Kernels (fp32 and bf16, each checked against its plain-torch twin in the tests):

- :func:`decode_attention`: one query row per sequence against its paged K/V,
  read in place through the block table (no gather); bf16 on AVX512_BF16's
  ``vdpbf16ps`` where the CPU has it (:func:`attention_bf16_dot`);
- :func:`write_kv`: this step's K/V rows into their cache slots;
- :func:`rms_norm` (optionally fused with the residual add), :func:`silu_and_mul`,
  :func:`rotary_neox` (in place): the elementwise ops of a layer, one pass each;
- :func:`argmax`: greedy sampling over fp32 logits;
- :func:`quantized_matmul`: activations times a weight held as integer codes with
  per-group scales (:mod:`legato.models.quantized`, GGUF types kept quantized): fp32
  activations (the fidelity path), or activations quantized to int8 per block of 32
  (llama.cpp's scheme, the fast path) with an AVX-512 VNNI, an AVX2 or a portable loop
  chosen at run time (:func:`quantized_isa`);
- :func:`dense_matmul`: fp32 activations times an fp32 weight held in column panels
  (:mod:`legato.models.cpu_linear`), at any number of rows; AVX-512 or portable loops
  with the same bits (:func:`dense_matmul_avx512`);
- :func:`prefill_attention`: causal attention of a fresh prompt over its own keys, fp32,
  head_dim 64 or 128, on AVX-512 (:func:`prefill_attention_available`).

Never imports trio. Blocks while compiling (first call only).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
PARTS = SOURCE.with_name("native")  # the headers SOURCE includes, one concern each
# -fno-trapping-math / -fno-math-errno as torch builds with: they let the loops with a
# division or a floor vectorise. No -ffast-math: it would set flush-to-zero process-wide.
FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno")
FLAGS += ("-fopenmp", "-fPIC", "-shared", "-std=c++17")
ENV_SWITCH = "LEGATO_CPU_KERNELS"  # "0" turns the native kernels off

_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL | None] | None = None  # (library or None) once tried

_c_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_P, _L, _I, _F = _c_ptr, _i64, _i32, _f32
# argument types of each entry point; "{t}" ones exist per dtype (f32, bf16)
_SIGNATURES: dict[str, list[Any]] = {
    "legato_decode_attention_{t}": [_P, _L, _L, _P, _P, _P, _L, _L, _L, _P, _P, _L]
    + [_I, _I, _I, _I, _F, _I],
    "legato_rms_norm_{t}": [_P, _L, _P, _P, _P, _L, _L, _F, _I],
    "legato_silu_and_mul_{t}": [_P, _L, _P, _L, _L, _I],
    "legato_rotary_neox_{t}": [_P, _L, _L, _L, _I, _I, _P, _P, _L, _I],
    "legato_write_kv": [_P, _L, _P, _L, _P, _P, _P, _L, _L, _L, _I],
    "legato_argmax_f32": [_P, _L, _L, _L, _P, _I],
    "legato_argmax_bf16": [_P, _L, _L, _L, _P, _I],
    "legato_quantized_matmul_f32": [_P, _L, _L, _L, _P, _I, _I, _L, _P, _P, _P, _L, _I],
    "legato_quantized_matmul_int8": [_P, _L, _L, _L, _P, _I, _I, _L, _P, _P, _P, _L, _I],
    "legato_dense_matmul_f32": [_P, _L, _L, _L, _P, _L, _P, _P, _L, _I],
    "legato_dense_matmul_path": [_I],
    "legato_prefill_attention_f32": [_P, _L, _L, _P, _L, _L, _P, _L, _L, _L, _I, _I, _I, _F]
    + [_P, _I],
    "legato_prefill_attention_path": [_I],
    "legato_quantized_isa": [_I],
    "legato_activation_digits_path": [_I],
    "legato_attention_bf16_dot": [_I],
    "legato_decode_one_region": [_I],
    "legato_decode_verify_rows": [_I],
    # layers (an array of structs, legato.models.decode_stack), then as in the C++ source
    "legato_decode_layers_f32": [_P, _I, _P, _P, _L, _I, _I, _I, _I, _I, _P, _L, _L, _L, _I]
    + [_P, _P, _P, _P, _L, _F, _F, _I, _I, _L],
    # the head: a projection struct (legato.models.decode_stack), then as in the C++ source
    "legato_greedy_head_f32": [_P, _P, _P, _P, _P, _L, _L, _F, _P, _P, _I],
}
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
DTYPES = tuple(_SUFFIX)  # what the typed kernels take


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def _source_texts() -> list[str]:
    """The source and every part it includes, in a fixed order (the build's hash)."""
    return [SOURCE.read_text()] + [
        f"{part.name}\0{part.read_text()}" for part in sorted(PARTS.glob("*.h"))
    ]


def _build(compiler: str) -> Path:
    """Compile the source unless a build for this source, compiler and CPU exists."""
    from ..model_cache import legato_home

    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    key = hashlib.sha256(
        "\0".join([*_source_texts(), " ".join(FLAGS), version, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    out_dir = legato_home() / "kernels"
    target = out_dir / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent build of the same key is identical
    logger.info("native CPU kernels compiled in %.1f s: %s", time.perf_counter() - began, target)
    return target


def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None when it cannot be had (logged once).

    Thread-safe; blocks while compiling.
    """
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded[0]
        library: ctypes.CDLL | None = None
        compiler = _compiler()
        if os.environ.get(ENV_SWITCH, "1").strip() == "0":
            logger.info("native CPU kernels off (%s=0): the plain-torch path", ENV_SWITCH)
        elif compiler is None:
            logger.warning("no C++ compiler found: the CPU runs the plain-torch path")
        else:
            try:
                library = ctypes.CDLL(str(_build(compiler)))
                for pattern, argtypes in _SIGNATURES.items():
                    for suffix in {pattern.format(t=s) for s in _SUFFIX.values()}:
                        fn = getattr(library, suffix)
                        fn.argtypes = argtypes
                        fn.restype = ctypes.c_int
            except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as exc:
                logger.warning("native CPU kernels unavailable (%s): the plain-torch path", exc)
                library = None
        _loaded = (library,)
        return library


def available() -> bool:
    """Whether the native kernels can run here (builds them on first call)."""
    return load() is not None


def _library() -> ctypes.CDLL:
    library = load()
    if library is None:
        raise RuntimeError("the native CPU kernels are not available")
    return library


def _typed(name: str, dtype: torch.dtype) -> str:
    suffix = _SUFFIX.get(dtype)
    if suffix is None:
        raise ValueError(f"{name}: no native kernel for {dtype}")
    return f"legato_{name}_{suffix}"


def _run(function: str, *args: object) -> None:
    code = getattr(_library(), function)(*args)
    if code != 0:
        raise ValueError(f"{function}: the kernel refused its arguments (code {code})")


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {what}")


def _on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` ``[S, H, D]`` (one row per sequence, the last of its
    ``seq_lens[i]`` tokens) over the paged caches ``[blocks, block_size, Hkv, D]``.

    ``block_table`` ``[S, >= needed]`` int32 with unit column stride, ``seq_lens``
    ``[S]`` int32 contiguous, all >= 1. ``query`` may be strided over its first two
    dimensions. Writes ``out`` (contiguous ``[S, H, D]``, allocated when None) and
    returns it. Raises ``RuntimeError`` when the library is unavailable and
    ``ValueError`` for layouts or dtypes it does not take, and for a length or
    block id that would read outside the table or the cache (checked first).
    """
    name = "decode_attention"
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    _check(
        _on_cpu(query, key_cache, value_cache, block_table, seq_lens)
        and key_cache.dtype == value_cache.dtype == query.dtype
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and value_cache.shape == key_cache.shape
        and query.stride(2) == 1
        and block_table.dtype == torch.int32
        and block_table.stride(1) == 1
        and block_table.shape[0] == num_seqs
        and seq_lens.dtype == torch.int32
        and seq_lens.is_contiguous()
        and seq_lens.shape == (num_seqs,),
        name,
        "unsupported layout",
    )
    if out is None:
        out = query.new_empty(query.shape)
    _check(
        out.is_contiguous() and out.shape == query.shape and out.dtype == query.dtype,
        name,
        "out must be a contiguous tensor like query",
    )
    if num_seqs:
        _run(
            _typed(name, query.dtype),
            query.data_ptr(),
            query.stride(0),
            query.stride(1),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_table.data_ptr(),
            block_table.stride(0),
            block_table.shape[1],
            key_cache.shape[0],
            seq_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            torch.get_num_threads(),
        )
    return out


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key`` / ``value`` ``[T, Hkv, D]`` (rows may be strided) at ``slot_mapping``
    ``[T]`` int64 of the contiguous caches; slots < 0 are skipped. Raises ``ValueError``
    (nothing written) for a slot past the cache or a layout it does not take."""
    name = "write_kv"
    num_tokens = key.shape[0]
    row = key_cache[0, 0]
    _check(
        _on_cpu(key, value, key_cache, value_cache, slot_mapping)
        and key.dtype == value.dtype == key_cache.dtype == value_cache.dtype
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and key_cache.shape == value_cache.shape
        and key.shape[1:] == value.shape[1:] == row.shape
        and key.stride(2) == value.stride(2) == 1
        and key.stride(1) == value.stride(1) == row.shape[1]
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and slot_mapping.shape == (num_tokens,),
        name,
        "unsupported layout",
    )
    size = key.element_size()
    if num_tokens:
        _run(
            "legato_write_kv",
            key.data_ptr(),
            key.stride(0) * size,
            value.data_ptr(),
            value.stride(0) * size,
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            slot_mapping.data_ptr(),
            num_tokens,
            key_cache.shape[0] * key_cache.shape[1],
            row.numel() * size,
            torch.get_num_threads(),
        )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``rms_norm(x) * weight`` over the last dimension of ``x`` ``[N, C]`` (rows may be
    strided); with ``residual`` (contiguous, like ``x``) first ``residual += x`` in place
    and the sum is normalised. Returns a new contiguous tensor."""
    name = "rms_norm"
    rows, cols = x.shape
    _check(
        _on_cpu(x, weight)
        and x.stride(1) == 1
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and weight.shape == (cols,)
        and (
            residual is None
            or (
                residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype
            )
        ),
        name,
        "unsupported layout",
    )
    out = x.new_empty(x.shape)
    if rows:
        _run(
            _typed(name, x.dtype),
            x.data_ptr(),
            x.stride(0),
            residual.data_ptr() if residual is not None else None,
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            cols,
            eps,
            torch.get_num_threads(),
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for ``x`` ``[N, 2d]`` (rows may be strided); new tensor."""
    name = "silu_and_mul"
    rows, width = x.shape
    _check(_on_cpu(x) and x.stride(1) == 1 and width % 2 == 0, name, "unsupported layout")
    out = x.new_empty(rows, width // 2)
    if rows:
        _run(
            _typed(name, x.dtype),
            x.data_ptr(),
            x.stride(0),
            out.data_ptr(),
            rows,
            width // 2,
            torch.get_num_threads(),
        )
    return out


def rotary_neox(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Rotate ``x`` ``[T, heads, D]`` (a strided view is fine) in place, neox style, at
    ``positions`` ``[T]`` int64, from ``cos_sin_cache`` ``[max_position, D]`` fp32 (cos |
    sin). Raises ``ValueError`` (nothing rotated) for a position outside the cache."""
    name = "rotary_neox"
    tokens, heads, head_dim = x.shape
    _check(
        _on_cpu(x, positions, cos_sin_cache)
        and x.stride(2) == 1
        and head_dim % 2 == 0
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and positions.shape == (tokens,)
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.is_contiguous()
        and cos_sin_cache.shape[1] == head_dim,
        name,
        "unsupported layout",
    )
    if tokens:
        _run(
            _typed(name, x.dtype),
            x.data_ptr(),
            x.stride(0),
            x.stride(1),
            tokens,
            heads,
            head_dim,
            positions.data_ptr(),
            cos_sin_cache.data_ptr(),
            cos_sin_cache.shape[0],
            torch.get_num_threads(),
        )


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Per row of fp32 or bf16 ``x`` ``[N, V]`` (unit column stride) the first index of its
    largest value, as ``torch.argmax(x.float(), dim=-1)`` (a NaN counts as largest); int64
    ``[N]``. bf16 rows are widened one at a time, never the whole batch."""
    rows, cols = x.shape
    _check(
        _on_cpu(x) and x.dtype in _SUFFIX and x.stride(1) == 1 and cols > 0,
        "argmax",
        "unsupported layout",
    )
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        _run(
            _typed("argmax", x.dtype),
            x.data_ptr(),
            x.stride(0),
            rows,
            cols,
            out.data_ptr(),
            torch.get_num_threads(),
        )
    return out


QUANTIZED_LAYOUTS = ((4, 32), (5, 32), (6, 16), (8, 32), (8, 16))
"""The (bits, group) pairs the quantized matmul takes (layout: :mod:`legato.models.quantized`)."""

QUANTIZED_ISAS = ("portable", "avx2", "avx512_vnni")
"""The int8-activation kernel's paths, by the number the library uses."""


def quantized_isa(request: str | None = None) -> str:
    """The path the int8-activation kernel runs (one of :data:`QUANTIZED_ISAS`): the best
    this CPU supports, or with ``request`` the lower of it and that best (tests and
    benchmarks pin a path so). Process-wide. Raises
    ``RuntimeError`` when the library is unavailable, ``ValueError`` for an unknown name."""
    if request is not None and request not in QUANTIZED_ISAS:
        raise ValueError(f"quantized_isa: {request!r} is not one of {QUANTIZED_ISAS}")
    code = -1 if request is None else QUANTIZED_ISAS.index(request)
    return QUANTIZED_ISAS[int(_library().legato_quantized_isa(code))]


def activation_digits_avx512(request: bool | None = None) -> bool:
    """Whether the int8-activation kernel computes its activations' two digits on AVX-512
    (16 values an instruction) rather than one value at a time: the CPU's best, or with
    ``request`` the lower of it and that best (tests compare the two: the digits are the
    same). Process-wide. Raises ``RuntimeError`` when the library is unavailable."""
    code = -1 if request is None else int(request)
    return bool(_library().legato_activation_digits_path(code))


def attention_bf16_dot(request: bool | None = None) -> bool:
    """Whether bf16 :func:`decode_attention` runs on AVX512_BF16's ``vdpbf16ps`` (q and
    the probabilities rounded to bf16, as the plain-torch reference rounds them) rather
    than widening K/V to fp32: the CPU's best, or with ``request`` the lower of it and that
    best (tests pin the fallback so). Process-wide. Raises ``RuntimeError`` when the library
    is unavailable."""
    code = -1 if request is None else int(request)
    return bool(_library().legato_attention_bf16_dot(code))


def decode_one_region(request: bool | None = None) -> bool:
    """Whether the decode stack (:func:`decode_layers_kernel`) runs a step of one sequence on
    the VNNI integer path in one parallel region, each thread a share of every matrix, rather
    than one region per op (bit-identical numbers either way): on by default, or with
    ``request`` set so (tests pin the op-by-op path to compare). Process-wide. Raises
    ``RuntimeError`` when the library is unavailable."""
    code = -1 if request is None else int(request)
    return bool(_library().legato_decode_one_region(code))


def decode_verify_rows(request: bool | None = None) -> bool:
    """Whether a one-region step of several rows of one sequence (a verification step) has
    each thread norm and quantize only its share of the rows, into codes the threads share,
    rather than every row itself (bit-identical numbers either way): on by default, or with
    ``request`` set so (benchmarks compare). Process-wide. Raises ``RuntimeError`` when the
    library is unavailable."""
    code = -1 if request is None else int(request)
    return bool(_library().legato_decode_verify_rows(code))


def quantized_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group: int,
    out: torch.Tensor,
    int8_activations: bool = False,
) -> torch.Tensor:
    """``out = x @ W^T`` with ``W = codes * scales (+ offsets)`` per group of ``group``
    codes (layout: :mod:`legato.models.quantized`). ``x`` fp32 ``[M, K]`` and ``out`` fp32
    ``[M, N]``, both with unit column stride; ``K`` a multiple of 32. With
    ``int8_activations`` each row of ``x`` is first rounded to int8 per block of 32 (scale
    max|x| / 127) and the group sums are integer dot products; otherwise the arithmetic is
    fp32 throughout. Returns ``out``. Raises ``ValueError`` for a layout or size it does
    not take (checked first)."""
    name = "quantized_matmul"
    rows, width = x.shape
    n = codes.shape[0]
    groups = width // group if group else 0
    _check(
        _on_cpu(x, codes, scales, out)
        and x.dtype == out.dtype == torch.float32
        and codes.dtype == torch.uint8
        and scales.dtype == torch.float32
        and (bits, group) in QUANTIZED_LAYOUTS
        and width % 32 == 0
        and x.stride(1) == 1
        and out.stride(1) == 1
        and codes.is_contiguous()
        and codes.shape == (n, width * bits // 8)
        and scales.is_contiguous()
        and scales.shape == (n, groups)
        and out.shape == (rows, n)
        and (
            offsets is None
            or (
                offsets.dtype == torch.float32
                and offsets.is_contiguous()
                and offsets.shape == scales.shape
                and _on_cpu(offsets)
            )
        ),
        name,
        "unsupported layout",
    )
    if rows and n:
        _run(
            "legato_quantized_matmul_int8" if int8_activations else "legato_quantized_matmul_f32",
            x.data_ptr(),
            x.stride(0),
            rows,
            width,
            codes.data_ptr(),
            bits,
            group,
            n,
            scales.data_ptr(),
            offsets.data_ptr() if offsets is not None else None,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
    return out


DENSE_PANEL = 48  # columns of W a panel holds (native/dense_matmul.h: kPanel)


def dense_matmul(
    x: torch.Tensor,
    panels: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for fp32 ``x`` ``[M, K]`` (unit column stride) and ``W``
    ``[n, K]`` held as ``panels`` ``[ceil(n / 48), K, 48]`` (``panels[p, k, j] = W[48 p +
    j, k]``, zeros past ``n``; :func:`legato.models.cpu_linear.weight_panels`). Writes
    ``out`` (``[M, n]``, unit column stride; allocated when None) and returns it. Raises
    ``ValueError`` for a layout or size it does not take (checked first)."""
    name = "dense_matmul"
    rows, width = x.shape
    count = -(-n // DENSE_PANEL)
    if out is None:
        out = x.new_empty(rows, n)
    _check(
        _on_cpu(x, panels, out)
        and x.dtype == panels.dtype == out.dtype == torch.float32
        and n > 0
        and width > 0
        and x.stride(1) == 1
        and out.stride(1) == 1
        and out.shape == (rows, n)
        and panels.is_contiguous()
        and panels.shape == (count, width, DENSE_PANEL)
        and (
            bias is None
            or (
                _on_cpu(bias)
                and bias.dtype == torch.float32
                and bias.is_contiguous()
                and bias.shape == (n,)
            )
        ),
        name,
        "unsupported layout",
    )
    _run(
        "legato_dense_matmul_f32",
        x.data_ptr(),
        x.stride(0),
        rows,
        width,
        panels.data_ptr(),
        n,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out


def dense_matmul_kernel() -> Any:
    """The raw ctypes entry point of :func:`dense_matmul`, for a caller that checked its
    panels once (:class:`legato.models.cpu_linear.PanelLinear`) and passes pointers itself.
    Raises ``RuntimeError`` when the library is unavailable."""
    return _library().legato_dense_matmul_f32


def dense_matmul_avx512(request: bool | None = None) -> bool:
    """Whether :func:`dense_matmul` runs its AVX-512 tiles rather than the portable loop (the
    same bits): the CPU's best, or with ``request`` the lower of it and that best.
    Process-wide. Raises ``RuntimeError`` when the library is unavailable."""
    code = -1 if request is None else int(request)
    return bool(_library().legato_dense_matmul_path(code))


def prefill_attention_available() -> bool:
    """Whether :func:`prefill_attention` runs on this CPU (it needs AVX-512). Raises
    ``RuntimeError`` when the library is unavailable."""
    return bool(_library().legato_prefill_attention_path(0))


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one fresh prompt over its own keys: row ``i`` of ``query``
    ``[L, H, D]`` attends rows ``0..i`` of ``key`` / ``value`` ``[L, Hkv, D]`` (``H`` a
    multiple of ``Hkv``, query heads grouped as in ``enable_gqa``), scores times ``scale``.
    fp32, ``D`` 64 or 128, strided over the first two dimensions. Writes ``out`` (a
    contiguous fp32 ``[L, H, D]``; allocated when None) and returns it. Raises
    ``ValueError`` for what it does not take, a CPU without AVX-512 included
    (:func:`prefill_attention_available`)."""
    name = "prefill_attention"
    length, heads, head_dim = query.shape
    if out is None:
        out = query.new_empty(query.shape)
    _check(
        _on_cpu(query, key, value, out)
        and query.dtype == key.dtype == value.dtype == out.dtype == torch.float32
        and key.shape == value.shape
        and key.shape[0] == length
        and key.shape[2] == head_dim
        and query.stride(2) == key.stride(2) == value.stride(2) == 1
        and out.shape == query.shape
        and out.is_contiguous(),
        name,
        "unsupported layout",
    )
    _run(
        "legato_prefill_attention_f32",
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        value.data_ptr(),
        value.stride(0),
        value.stride(1),
        length,
        heads,
        key.shape[1],
        head_dim,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def quantized_matmul_kernel(int8_activations: bool = False) -> Any:
    """The raw ctypes entry point of :func:`quantized_matmul`, for a caller that checked its
    weight once (:class:`legato.models.quantized.QuantizedLinear`) and passes pointers itself.
    Raises ``RuntimeError`` when the library is unavailable."""
    library = _library()
    if int8_activations:
        return library.legato_quantized_matmul_int8
    return library.legato_quantized_matmul_f32


def decode_layers_kernel() -> Any:
    """The raw ctypes entry point that runs a decode step's decoder stack
    (:mod:`legato.models.decode_stack` builds its arguments and checks them). Raises
    ``RuntimeError`` when the library is unavailable."""
    return _library().legato_decode_layers_f32


def greedy_head_kernel() -> Any:
    """The raw ctypes entry point that runs a greedy one-row step's last norm, LM head and
    argmax in one call (:mod:`legato.models.decode_stack` builds its arguments; it returns 1
    when taken, 0 when not). Raises ``RuntimeError`` when the library is unavailable."""
    return _library().legato_greedy_head_f32
