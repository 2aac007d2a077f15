"""Compile every kernel launch the host wrappers make, for a CUDA arch, without a GPU.

Run as a script (``python aot_compile.py 90``) with ``TRITON_INTERPRET`` unset:
the wrappers run on CPU tensors with each ``@triton.jit`` kernel swapped for a
recorder, then each recorded launch goes through the real Triton compiler
(TTIR -> PTX -> ptxas cubin) for ``sm_<arch>``, with the divisibility hints the
JIT would give. Prints one line per launch with its registers and spill
(stack) bytes when cuobjdump is at hand; exits 1 on any compile failure or
spill. The interpreter is lenient where the compiler is not (loop-carried
types, scalar control flow), so this is the CPU-side check that the GPU path
builds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from conftest import build_paged_batch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from legato.kernels import (
    activation,
    attention,
    attention_decode,
    attention_prefill,
    kv_write,
    norm,
    quantized_matmul,
    rotary,
)
from legato.models.quantized import KEPT_TYPES, from_gguf
from legato.testing.gguf_blocks import random_blocks

_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int8: "i8",
    torch.uint8: "u8",
}
_KERNELS = {
    attention_decode: ("_decode_split_kernel", "_decode_reduce_kernel"),
    attention_prefill: ("_prefill_kernel",),
    kv_write: ("_write_kv_kernel",),
    norm: ("_rms_norm_kernel",),
    rotary: ("_rotary_kernel",),
    activation: ("_silu_and_mul_kernel",),
    quantized_matmul: ("_quantized_matmul_kernel",),
}

Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]


class _Recorder:
    def __init__(self, fn: Any, launches: list[Launch]) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((self.fn, args, kwargs))

        return launch


def record_launches() -> list[Launch]:
    """Run the wrappers over Llama-like and odd shapes, recording instead of launching."""
    launches: list[Launch] = []
    for module, names in _KERNELS.items():
        for name in names:
            setattr(module, name, _Recorder(getattr(module, name), launches))
    for dtype in (torch.bfloat16, torch.float32):
        common = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
        b = build_paged_batch([300, 20], [1, 1], dtype=dtype, **common)
        attention.paged_attention_decode(*b.args(), b.scale, split_tokens=64)
        b = build_paged_batch([300, 20], [40, 1], dtype=dtype, **common)
        attention.paged_attention_prefill(*b.args(), b.scale)
    odd = {"num_heads": 12, "num_kv_heads": 2, "head_dim": 80, "block_size": 32}
    b = build_paged_batch([300, 20], [1, 1], dtype=torch.float16, **odd)
    attention.paged_attention_decode(*b.args(), b.scale)
    attention.paged_attention_prefill(*b.args(), b.scale)
    kv_write.write_kv(b.query[:, :2], b.query[:, :2], b.key_cache, b.value_cache, b.seq_lens)
    x = torch.randn(4, 4096, dtype=torch.bfloat16)
    norm.rms_norm(x, torch.ones(4096), 1e-6)
    norm.fused_add_rms_norm(x, x, torch.ones(4096, dtype=torch.bfloat16), 1e-6)
    for is_neox in (True, False):
        q = x.view(4, 32, 128)
        rotary.apply_rotary(q, q[:, :8], torch.arange(4), torch.randn(8, 128), is_neox)
    activation.silu_and_mul(torch.randn(4, 2 * 14336, dtype=torch.bfloat16))
    for kind in KEPT_TYPES:  # every code layout, at CUDA's decode tilings (split K)
        weight = from_gguf(random_blocks(kind, 64, 512), kind, 64, 512)
        for dtype in (torch.bfloat16, torch.float32):
            config = quantized_matmul.launch_config(
                1, 4096, 4096, weight.bits, "cuda", fp32=dtype == torch.float32
            )
            quantized_matmul.quantized_matmul(torch.randn(1, 512, dtype=dtype), weight, config)
    return launches


def compile_launch(launch: Launch, arch: int) -> Any:
    """Compile one recorded launch for ``sm_<arch>`` as the JIT would specialise it."""
    fn, args, kwargs = launch
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for index, (name, value) in enumerate(zip(fn.arg_names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    for name, value in kwargs.items():
        if name in fn.arg_names:
            signature[name], constexprs[name] = "constexpr", value
    options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def main(arch: int) -> int:
    assert not os.environ.get("TRITON_INTERPRET"), "run with TRITON_INTERPRET unset"
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cuobjdump = shutil.which("cuobjdump", path=str(bin_dir)) or shutil.which("cuobjdump")
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for launch in record_launches():
            name = launch[0].__name__
            try:
                kernel = compile_launch(launch, arch)
            except Exception as exc:  # report every failing variant, then fail
                failures += 1
                print(f"FAIL {name}: {type(exc).__name__}: {exc}")
                continue
            usage = ""
            if cuobjdump:
                cubin = Path(tmp) / "k.cubin"
                cubin.write_bytes(kernel.asm["cubin"])
                dump = subprocess.run(
                    [cuobjdump, "--dump-resource-usage", str(cubin)],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                usage = " ".join(re.findall(r"REG:\d+|STACK:\d+", dump))
                if not re.search(r"STACK:0\b", dump):
                    failures += 1
                    usage += "  <- spills"
            print(f"ok   {name:24s} {usage}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90))
