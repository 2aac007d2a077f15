"""The Triton weight-only matmul over GGUF-quantized weights on a GPU: its speed against
the bf16 path and against the memory roofline, per type, shape and batch.

For every kept GGUF type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) on
Llama-3-8B's projection shapes, random blocks are repacked by the loader's own
``from_gguf`` and moved to the device. Per batch ``M`` the table gives:

- ``path``: ``dot`` (``tl.dot`` tiles of 16 rows) or ``gemv`` (fp32 rows, products
  summed in registers: the default for one fp32 row);
- ``quant us``: :func:`legato.kernels.quantized_matmul.quantized_matmul` with bf16
  (or ``--dtype fp32``) activations and its default :func:`launch_config` (CUDA-graph
  replays, L2 flushed before each, CUDA-event median: ``roofline.time_call``);
- ``dense us``: ``F.linear`` on the same weight dequantized to the activations' dtype
  (cuBLAS), timed alike;
- ``x dense``: dense time / quantized time (above 1: the quantized kernel is faster);
- ``floor us`` and ``% floor``: the memory floor, i.e. the bytes the kernel must move
  (codes, fp32 scales and offsets, activations in, results out) over the device's
  measured copy bandwidth, and floor / measured. For large ``M`` the compute floor
  (2 MNK over the measured bf16 matmul rate) is larger and is the one used; the
  ``bound`` column says which;
- ``max err``: the largest difference from "dequantize, then ``F.linear``" in fp32,
  relative to the reference's largest magnitude (bf16 operands: about 1e-2 is expected).

``--dtype fp32`` gives the kernel fp32 activations (IEEE products; the default
model runs so on a GPU) and compares with cuBLAS on the fp32 weight; with
``--compare-dot``, a row whose default is ``gemv`` is timed a second time on the
16-row ``tl.dot`` (same slices of K, 32 weight rows a tile: the tiling before).
``--sweep`` first times a grid of launch shapes (tile sizes, split K, warps,
stages) for a 4-bit and an 8-bit layout per batch class, on the shapes given,
and prints the best ones: what :func:`launch_config`'s CUDA table was chosen
from. ``--json PATH`` writes every row. The ``s_`` shapes are the default
model's (SmolLM2-135M: hidden 576, intermediate 1536, 9 + 3 + 3 heads of 64).

    python benchmarks/gpu/quantized_matmul.py [--sweep] [--json out.json]
    python benchmarks/gpu/quantized_matmul.py --shapes s_qkv s_down --dtype fp32 --compare-dot
    python benchmarks/gpu/quantized_matmul.py --device cpu --tiny   # interpreter smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import _graphed, _resolve_device, time_call  # noqa: E402

KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
SHAPES = {  # (out_features, in_features): Llama-3-8B's, then the default model's (s_)
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "s_qkv": (960, 576),
    "s_o": (576, 576),
    "s_gate_up": (3072, 576),
    "s_down": (576, 1536),
}
LARGE = ("qkv", "o", "gate_up", "down")
TINY_SHAPES = {"o": (64, 256), "down": (96, 512)}
BATCHES = (1, 16, 64, 256, 2048)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu (the interpreter)")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--shapes", nargs="+", default=list(LARGE), choices=list(SHAPES))
    parser.add_argument(
        "--dtype", default="bf16", choices=["bf16", "fp32"], help="the activations' dtype"
    )
    parser.add_argument(
        "--compare-dot",
        action="store_true",
        help="fp32, one row: also time the 16-row tl.dot tiling the gemv default replaced",
    )
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--sweep", action="store_true", help="time launch shapes first")
    parser.add_argument("--sweep-kinds", nargs="+", default=["Q4_1", "Q8_0"], choices=KINDS)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


def device_rates(device: str, args: argparse.Namespace) -> tuple[float, float]:
    """(copy bytes/s counting read and write, bf16 matmul FLOP/s) measured here."""
    import torch

    n_bytes = (1 << 30) if device == "cuda" else (1 << 22)
    src = torch.ones(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = time_call(lambda: dst.copy_(src), device, args.warmup, args.iters)
    n = 8192 if device == "cuda" else 256
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_s = time_call(lambda: a @ b, device, args.warmup, args.iters)
    return 2 * n_bytes / copy_s, 2 * n**3 / mm_s


def make_weight(kind: str, n: int, k: int, device: str) -> tuple[Any, Any]:
    """(the repacked weight on ``device``, its fp32 reference on ``device``). The reference
    is ``QuantizedWeight.dequantize`` on the device (gguf-py's numpy dequantization of
    the big shapes would take minutes; tests/models/test_quantized.py holds the two equal)."""
    from legato.models.quantized import QuantizedWeight, from_gguf
    from legato.testing.gguf_blocks import random_blocks

    host = from_gguf(random_blocks(kind, n, k, seed=n + k), kind, n, k)
    offsets = host.offsets.to(device) if host.offsets is not None else None
    weight = QuantizedWeight(
        host.codes.to(device), host.scales.to(device), offsets, host.bits, host.group, kind
    )
    return weight, weight.dequantize()


def timed(fn: Callable[[], object], device: str, args: argparse.Namespace) -> float:
    """Median seconds per call; CUDA-graph replays on CUDA (launch overhead excluded)."""
    call = _graphed(fn) if device == "cuda" else fn
    return time_call(call, device, args.warmup, args.iters)


def weight_bytes(weight: Any) -> int:
    total = weight.codes.numel() + weight.scales.numel() * 4
    return int(total + (weight.offsets.numel() * 4 if weight.offsets is not None else 0))


def activation_dtype(device: str, name: str = "bf16") -> Any:
    """fp32 when asked; else bf16 on CUDA, fp16 in the interpreter (whose bf16 arithmetic
    is not the hardware's)."""
    import torch

    if name == "fp32":
        return torch.float32
    return torch.bfloat16 if device == "cuda" else torch.float16


def sweep_configs(m: int, fp32: bool = False) -> list[Any]:
    from legato.kernels.quantized_matmul import LaunchConfig

    if fp32 and m <= 4:
        return [
            LaunchConfig(1 if m == 1 else 2 if m == 2 else 4, bn, bk, split, warps, 3, gemv=True)
            for bn, bk, split, warps in itertools.product(
                (16, 32, 64), (64, 128, 256), (1, 2, 3, 4, 8), (4,)
            )
        ]
    if m <= 16:
        return [
            LaunchConfig(16, bn, bk, split, 4, 3)
            for bn, bk, split in itertools.product(
                (16, 32, 64, 128), (32, 64, 128, 256), (1, 2, 3, 4, 6, 8, 9)
            )
        ] + [LaunchConfig(16, bn, 128, split, 8, 2) for bn in (32, 64) for split in (1, 4)]
    return [
        LaunchConfig(bm, bn, 64, 1, warps, 3)
        for bm, bn, warps in itertools.product((64, 128), (64, 128), (4, 8))
    ]


def sweep(args: argparse.Namespace, device: str, shapes: dict[str, tuple[int, int]]) -> list[dict]:
    """Best launch shapes per (layout, batch), on each shape given."""
    import torch

    from legato.kernels.quantized_matmul import launch_config, quantized_matmul

    rows: list[dict] = []
    for kind in args.sweep_kinds:
        for name in shapes:
            n, k = shapes[name]
            weight, _ = make_weight(kind, n, k, device)
            for m in [b for b in args.batches if b in (1, 16, 256)]:
                x = torch.randn(m, k, device=device, dtype=activation_dtype(device, args.dtype))
                results = []
                fp32 = x.dtype == torch.float32
                default = launch_config(m, n, k, weight.bits, device, fp32=fp32)
                for config in dict.fromkeys([default, *sweep_configs(m, fp32)]):
                    if k % (config.block_k * config.split_k):
                        continue
                    try:
                        seconds = timed(partial(quantized_matmul, x, weight, config), device, args)
                    except Exception as error:  # a shape the compiler refuses (shared memory)
                        print(f"  {kind} {name} M={m} {tuple(config)}: {type(error).__name__}")
                        continue
                    results.append((seconds, config))
                results.sort(key=lambda r: r[0])
                default_s = next(s for s, c in results if c == default)
                for rank, (seconds, config) in enumerate(results[:5]):
                    rows.append(
                        {"kind": kind, "shape": name, "m": m, "rank": rank + 1,
                         "config": list(config), "us": seconds * 1e6,
                         "default_us": default_s * 1e6}
                    )  # fmt: skip
                best_s, best = results[0]
                print(
                    f"sweep {kind} {name} M={m}: best {tuple(best)} {best_s * 1e6:.1f} us, "
                    f"default {tuple(default)} {default_s * 1e6:.1f} us, "
                    f"next {[(tuple(c), round(s * 1e6, 1)) for s, c in results[1:4]]}",
                    flush=True,
                )
    return rows


def main() -> None:
    args = parse_args()
    device = _resolve_device(args.device)
    import torch
    import torch.nn.functional as F
    import triton

    from legato.kernels.quantized_matmul import launch_config, quantized_matmul

    shapes = TINY_SHAPES if args.tiny else {s: SHAPES[s] for s in args.shapes}
    batches = [m for m in args.batches if not args.tiny or m <= 64]
    args.batches = batches
    copy_bw, mm_rate = device_rates(device, args)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    print(
        f"{name}; torch {torch.__version__}, triton {triton.__version__}; copy "
        f"{copy_bw / 1e9:.0f} GB/s (read + write), bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    report: dict[str, Any] = {"device": name, "copy_GBps": copy_bw / 1e9,
                              "matmul_TFLOPs": mm_rate / 1e12}  # fmt: skip
    if args.sweep:
        report["sweep"] = sweep(args, device, shapes)
    header = (
        f"{'type':5} {'shape':9} {'M':>5} {'path':>4} {'launch':>24} {'quant us':>9} {'dense us':>9} "
        f"{'x dense':>7} {'floor us':>9} {'% floor':>8} {'bound':>7} {'max err':>8}"
    )
    print(header, flush=True)
    rows = []
    for kind in args.kinds:
        for shape_name, (n, k) in shapes.items():
            if k % (256 if kind.endswith("_K") else 32):
                print(f"{kind:5} {shape_name:9} K = {k} does not fill {kind}'s blocks: skipped")
                continue
            weight, reference = make_weight(kind, n, k, device)
            dtype = activation_dtype(device, args.dtype)
            dense = reference.to(dtype)
            for m in batches:
                x = torch.randn(m, k, device=device, dtype=dtype)
                want = F.linear(x.float(), reference)
                dense_s = timed(partial(F.linear, x, dense), device, args)
                size = x.element_size()
                moved = weight_bytes(weight) + size * (m * k + m * n)
                memory_floor = moved / copy_bw
                compute_floor = 2 * m * n * k / mm_rate
                floor = max(memory_floor, compute_floor)
                default = launch_config(m, n, k, weight.bits, device, fp32=dtype == torch.float32)
                configs = [default]
                if args.compare_dot and default.gemv:
                    configs.append(default._replace(block_m=16, block_n=32, gemv=False))
                for config in configs:
                    path = "gemv" if config.gemv else "dot"
                    got = quantized_matmul(x, weight, config).float()
                    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
                    quant_s = timed(partial(quantized_matmul, x, weight, config), device, args)
                    row = {
                        "kind": kind, "shape": shape_name, "n": n, "k": k, "m": m,
                        "path": path, "launch": list(config)[:6], "dtype": args.dtype,
                        "quant_us": quant_s * 1e6, "dense_us": dense_s * 1e6,
                        "floor_us": floor * 1e6,
                        "bound": "memory" if memory_floor >= compute_floor else "compute",
                        "max_rel_err": err,
                    }  # fmt: skip
                    rows.append(row)
                    launch = "/".join(str(v) for v in list(config)[:6])
                    print(
                        f"{kind:5} {shape_name:9} {m:>5} {path:>4} {launch:>24} "
                        f"{quant_s * 1e6:>9.1f} {dense_s * 1e6:>9.1f} {dense_s / quant_s:>6.2f}x "
                        f"{floor * 1e6:>9.1f} {100 * floor / quant_s:>7.1f}% {row['bound']:>7} "
                        f"{err:>8.1e}",
                        flush=True,
                    )
    report["rows"] = rows
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"launch: block_m/block_n/block_k/split_k/warps/stages; TRITON_INTERPRET="
          f"{os.environ.get('TRITON_INTERPRET', '0')}")  # fmt: skip


if __name__ == "__main__":
    main()
