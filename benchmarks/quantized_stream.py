"""Read bandwidth of the batch-1 quantized matmul, weights streamed from memory.

Holds ``--layers`` (default 30) layers of SmolLM2-135M's projection shapes (qkv 960x576, o
576x576, gate_up 3072x576, down 576x1536) of each GGUF type named, random blocks repacked
as the loader repacks them (far larger than the L3 cache, as a decode step's weights are),
and times one pass of single-row int8-activation matmuls over all of them (median of
``--reps``): ms a pass and GB/s of bytes held. Equal GB/s across types means the kernel is
bound by bytes, not by the code width's arithmetic. Prints a table; never asserted.

    flock -x /tmp/legato-cpu.lock python benchmarks/quantized_stream.py Q8_0 Q4_1 Q5_0 Q4_K Q6_K
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from legato.models import cpu_kernels
from legato.models.quantized import QuantizedWeight, from_gguf
from legato.testing.gguf_blocks import BLOCK_SHAPES, random_blocks

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def median_seconds(run: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """The median wall time of ``reps`` calls of ``run``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def random_weight(kind: str, rows: int, cols: int, seed: int) -> QuantizedWeight:
    """Random codes and sub-scales, fp16 scales in a sane range, repacked."""
    per = BLOCK_SHAPES[kind][0]
    if cols % per:  # K-quants on a 576-wide row: widen to whole super-blocks
        cols += per - cols % per
    return from_gguf(random_blocks(kind, rows, cols, seed), kind, rows, cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="+", choices=sorted(BLOCK_SHAPES))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads,"
          f" int8 path {cpu_kernels.quantized_isa()}")  # fmt: skip
    for kind in args.kinds:
        weights = [
            random_weight(kind, n, k, seed) for seed in range(args.layers) for n, k in SHAPES
        ]
        held = sum(w.nbytes for w in weights)
        inputs = {w.in_features: torch.randn(1, w.in_features) for w in weights}
        outs = [torch.empty(1, w.out_features) for w in weights]

        def one_pass(
            weights: list[QuantizedWeight] = weights,
            outs: list[torch.Tensor] = outs,
            inputs: dict[int, torch.Tensor] = inputs,
        ) -> None:
            for w, out in zip(weights, outs):
                x = inputs[w.in_features]
                cpu_kernels.quantized_matmul(
                    x, w.codes, w.scales, w.offsets, w.bits, w.group, out, int8_activations=True
                )

        t = median_seconds(one_pass, args.reps, warmup=3)
        print(
            f"{kind:5s} {held / 1e6:7.1f} MB held  {t * 1e3:6.2f} ms a pass  {held / t / 1e9:5.1f} GB/s"
        )


if __name__ == "__main__":
    main()
