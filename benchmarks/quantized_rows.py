"""Speed of the quantized matmul at a few rows (a 2..16-stream decode step, a verification).

Holds ``--layers`` (default 30) layers of SmolLM2-135M's projection shapes (qkv 960x576, o
576x576, gate_up 3072x576, down 576x1536) of each GGUF type named, random blocks repacked
as the loader repacks them, plus its LM head (49152x576) when ``--head`` names a type, and
times one pass of fp32-tile matmuls (``int8_activations=False``) over all of them at each
``--rows`` (median of ``--reps``): ms a pass and GFLOP/s (2 * rows * weights a pass). At
these row counts the pass is bound by fp32 arithmetic, not by the weight's bytes, so
GFLOP/s against the cores' fp32 FMA peak says how much of the work is the matmul itself.
``--int8`` times the int8-activation path instead (``--layers 0 --head Q8_0 --rows 1 4 5
6``: the default model's LM head at a verification step's rows). Prints a table; never
asserted.

    flock -x /tmp/legato-cpu.lock python benchmarks/quantized_rows.py Q4_1 Q8_0 Q5_0 --rows 8 16
"""

from __future__ import annotations

import argparse

import torch
from quantized_stream import SHAPES, median_seconds, random_weight

from legato.models import cpu_kernels
from legato.models.quantized import QuantizedWeight
from legato.testing.gguf_blocks import BLOCK_SHAPES

HEAD = (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="+", choices=sorted(BLOCK_SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--head", choices=sorted(BLOCK_SHAPES), default=None)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--int8", action="store_true", help="int8 activations")
    args = parser.parse_args()
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    print(f"{'type':>6} {'rows':>4} {'ms/pass':>8} {'GFLOP/s':>8}")
    for kind in args.kinds:
        weights = [
            random_weight(kind, n, k, seed) for seed in range(args.layers) for n, k in SHAPES
        ]
        if args.head is not None:
            weights.append(random_weight(args.head, *HEAD, seed=1000))
        count = sum(w.out_features * w.in_features for w in weights)
        for rows in args.rows:
            inputs = {w.in_features: torch.randn(rows, w.in_features) for w in weights}
            outs = [torch.empty(rows, w.out_features) for w in weights]

            def one_pass(
                weights: list[QuantizedWeight] = weights,
                outs: list[torch.Tensor] = outs,
                inputs: dict[int, torch.Tensor] = inputs,
            ) -> None:
                for w, out in zip(weights, outs):
                    cpu_kernels.quantized_matmul(
                        inputs[w.in_features], w.codes, w.scales, w.offsets, w.bits, w.group,
                        out, int8_activations=args.int8,
                    )  # fmt: skip

            seconds = median_seconds(one_pass, args.reps)
            flops = 2 * rows * count / seconds / 1e9
            print(f"{kind:>6} {rows:>4} {seconds * 1e3:8.2f} {flops:8.1f}")


if __name__ == "__main__":
    main()
