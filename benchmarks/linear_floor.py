"""The weight-matmul floor of one decode step: every layer's projections plus the LM head.

For each dtype and batch size this times, per step, the matmuls alone (no
attention, norms, rotary or sampling) over weights of the model's shapes
(default: the 56M Llama the issues measure, fused QKV and gate-up), with
each way of computing a linear layer that torch offers on this CPU:

- ``F.linear``: torch's default (MKL sgemm in fp32, oneDNN for bf16);
- ``mkl-packed``: MKL's prepacked fp32 GEMM (``torch.ops.mkl._mkl_linear``),
  the weights reordered once for the batch size;
- ``onednn-packed``: oneDNN with the weights reordered once
  (``torch.ops.mkldnn._linear_pointwise``);
- ``panels``: what legato runs in fp32 on AVX-512 CPUs (``legato.models.cpu_linear.PanelLinear``):
  the weights in column panels, multiplied by the native ``cpu_kernels.dense_matmul``;
- ``fp32-compute``: bf16 only; weights held as fp32 and the bf16 activations
  widened, computed in fp32 and rounded back to bf16 (what a CPU without
  native bf16 does inside any bf16 GEMM, minus re-widening the weights).

A decode step cannot be faster than its matmuls: ``benchmarks/decode_step.py``
prints the whole step beside this floor. Prints a table; never asserted.
Example::

    python benchmarks/linear_floor.py --batch-sizes 1 16 64 --dtypes float32 bfloat16

The default model's shapes (fp32 serving): ``--hidden 576 --intermediate 1536 --layers 30
--heads 9 --kv-heads 3 --vocab 49152 --dtypes float32 --batch-sizes 1 32 64 256``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from legato.models.cpu_linear import PanelLinear, panels_preferred

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Linear = Callable[[torch.Tensor], torch.Tensor]


def layer_shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of every matmul of one step, lm_head last."""
    head_dim = args.hidden // args.heads
    qkv = (args.heads + 2 * args.kv_heads) * head_dim
    per_layer = [
        (qkv, args.hidden),
        (args.heads * head_dim, args.hidden),
        (2 * args.intermediate, args.hidden),
        (args.hidden, args.intermediate),
    ]
    return per_layer * args.layers + [(args.vocab, args.hidden)]


def make_linears(method: str, weights: list[torch.Tensor], batch: int) -> list[Linear] | None:
    """One callable per weight, or None where ``method`` does not apply to the dtype."""
    dtype = weights[0].dtype
    if method == "F.linear":
        return [lambda x, w=w: F.linear(x, w) for w in weights]
    if method == "mkl-packed":
        if dtype != torch.float32 or not torch.backends.mkl.is_available():
            return None
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, batch) for w in weights]
        return [
            lambda x, p=p, w=w: torch.ops.mkl._mkl_linear(x, p, w, None, batch)
            for p, w in zip(packed, weights, strict=True)
        ]
    if method == "onednn-packed":
        if not torch.backends.mkldnn.is_available():
            return None
        try:
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, batch) for w in weights]
        except RuntimeError:  # e.g. bf16 without AVX-512 or AVX-NE-CONVERT
            return None
        return [
            lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            for p in packed
        ]
    if method == "panels":
        if dtype != torch.float32 or not panels_preferred():
            return None
        return [PanelLinear.pack(w, None) for w in weights]
    if method == "fp32-compute":
        if dtype != torch.bfloat16:
            return None
        wide = [w.float() for w in weights]
        return [lambda x, w=w: F.linear(x.float(), w).to(torch.bfloat16) for w in wide]
    raise ValueError(method)


METHODS = ("F.linear", "mkl-packed", "onednn-packed", "panels", "fp32-compute")


def time_step(
    linears: list[Linear],
    shapes: list[tuple[int, int]],
    batch: int,
    dtype: torch.dtype,
    steps: int,
    warmup: int,
) -> list[float]:
    inputs = {inp: torch.randn(batch, inp, dtype=dtype) for _, inp in shapes}
    times = []
    with torch.inference_mode():
        for i in range(warmup + steps):
            began = time.perf_counter()
            for lin, (_, inp) in zip(linears, shapes, strict=True):
                lin(inputs[inp])
            if i >= warmup:
                times.append(time.perf_counter() - began)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=DTYPES)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = layer_shapes(args)
    params = sum(o * i for o, i in shapes)
    print(
        f"cpu: {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; "
        f"{params / 1e6:.1f}M weight parameters per step"
    )
    print(f"{'dtype':<9} {'batch':>5} {'method':<14} {'ms/step':>16} {'GFLOP/s':>8}")
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = DTYPES[name]
        weights = [torch.randn(o, i, generator=gen).mul_(0.02).to(dtype) for o, i in shapes]
        for batch in args.batch_sizes:
            for method in args.methods:
                linears = make_linears(method, weights, batch)
                if linears is None:
                    continue
                t = time_step(linears, shapes, batch, dtype, args.steps, args.warmup)
                med = statistics.median(t)
                gflops = 2 * params * batch / med / 1e9
                print(
                    f"{name:<9} {batch:>5} {method:<14} {med * 1e3:>8.2f} ({min(t) * 1e3:>5.2f}) "
                    f"{gflops:>8.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
