"""Native CPU kernels (``cpu_kernels.cpp``), built on first use and called through ctypes.

The C++ source has no dependency but a C++17 compiler with OpenMP: on first
use it is compiled with ``-O3 -march=native -fopenmp`` into
``$LEGATO_HOME/kernels/`` (a name that hashes the source, the flags, the
compiler and this CPU's flags, so a changed source or another machine gets a
fresh build; about two seconds) and loaded with ctypes. Its OpenMP binds to the
libgomp torch has loaded, so the kernels share torch's threads.

Without a compiler (or with ``LEGATO_CPU_KERNELS=0``) :func:`load` returns None
once, with a log line, and callers keep their plain-torch path.

Kernels:

- :func:`decode_attention`: one query row per sequence against its paged K/V,
  read in place through the block table (no gather), fp32 or bf16.

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
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17")
ENV_SWITCH = "LEGATO_CPU_KERNELS"  # "0" turns the native kernels off

_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL | None] | None = None  # (library or None) once tried

_c_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_DECODE_ARGS = [_c_ptr, _i64, _i64, _c_ptr, _c_ptr, _c_ptr, _i64, _i64, _i64, _c_ptr, _c_ptr, _i64]
_DECODE_ARGS += [_i32, _i32, _i32, _i32, _f32, _i32]
_DECODE_FUNCTIONS = {
    torch.float32: "legato_decode_attention_f32",
    torch.bfloat16: "legato_decode_attention_bf16",
}


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


def _build(compiler: str) -> Path:
    """Compile the source unless a build for this source, compiler and CPU exists."""
    from ..toy_model import legato_home

    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    out_dir = legato_home() / "kernels"
    target = out_dir / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent build of the same key is identical
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
            logger.info("native CPU kernels off (%s=0): plain-torch attention", ENV_SWITCH)
        elif compiler is None:
            logger.warning("no C++ compiler found: CPU attention uses the plain-torch path")
        else:
            try:
                library = ctypes.CDLL(str(_build(compiler)))
                for name in _DECODE_FUNCTIONS.values():
                    fn = getattr(library, name)
                    fn.argtypes = _DECODE_ARGS
                    fn.restype = ctypes.c_int
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                logger.warning("native CPU kernels unavailable (%s): plain-torch attention", exc)
                library = None
        _loaded = (library,)
        return library


def available() -> bool:
    """Whether the native kernels can run here (builds them on first call)."""
    return load() is not None


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
    library = load()
    if library is None:
        raise RuntimeError("the native CPU kernels are not available")
    fn_name = _DECODE_FUNCTIONS.get(query.dtype)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if (
        fn_name is None
        or query.device.type != "cpu"
        or key_cache.dtype != query.dtype
        or value_cache.dtype != query.dtype
        or not key_cache.is_contiguous()
        or not value_cache.is_contiguous()
        or value_cache.shape != key_cache.shape
        or query.stride(2) != 1
        or block_table.dtype != torch.int32
        or block_table.stride(1) != 1
        or seq_lens.dtype != torch.int32
        or not seq_lens.is_contiguous()
        or len(seq_lens) != num_seqs
        or block_table.shape[0] != num_seqs
    ):
        raise ValueError("decode_attention: unsupported dtype or layout")
    if out is None:
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype)
    elif not out.is_contiguous() or out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError("decode_attention: out must be a contiguous tensor like query")
    if num_seqs == 0:
        return out
    code = getattr(library, fn_name)(
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
    if code != 0:
        raise ValueError(f"decode_attention: the kernel refused its arguments (code {code})")
    return out
