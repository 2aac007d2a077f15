"""Multi-LoRA on a GPU: the Triton SGMV kernels against the base projection and the torch path.

For one projection of a Llama-3-8B-shaped layer (qkv: 4096 -> 4096 + 2 x 1024,
three slices; down: 14336 -> 4096), rank 16, a batch of ``--tokens`` rows
spread over 1, 4 or 8 adapters, it times (CUDA events, median of repeats):
the base ``F.linear``, the SGMV ``add_lora`` (shrink + expand) launched from
Python and replayed from a CUDA graph (its GPU time alone), and the
plain-torch path the CPU uses (gather, batched matmul, scatter). Prints a
table; never asserted.

    python benchmarks/gpu/lora_kernels.py --tokens 32,2048 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F


def timed(fn: Callable[[], object], repeats: int = 50) -> float:
    """Median microseconds of ``fn()`` over ``repeats`` runs after a warm-up."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="32,256,2048")
    parser.add_argument("--adapters", default="1,4,8")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()

    from legato.kernels.lora import add_lora, lora_meta
    from legato.models.lora_layers import LoRAStack, ProjectionSpec, _torch_plan, add_lora_torch

    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    specs = [
        ProjectionSpec("qkv", ("q", "k", "v"), 4096, (4096, 1024, 1024)),
        ProjectionSpec("down", ("down",), 14336, (4096,)),
    ]
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  rank {args.rank}")
    print(f"{'proj':<6}{'tokens':>7}{'adapters':>9}{'base us':>10}{'sgmv us':>10}"
          f"{'graphed':>10}{'torch us':>10}{'graphed/base':>13}")  # fmt: skip
    for spec in specs:
        stack = LoRAStack(spec, 9, args.rank, dtype, device)
        stack.a[1:].normal_(0, 0.02)
        stack.b[1:].normal_(0, 0.02)
        weight = torch.randn(sum(spec.out_features), spec.in_features, dtype=dtype, device=device)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, spec.in_features, dtype=dtype, device=device)
            y = torch.zeros(tokens, sum(spec.out_features), dtype=dtype, device=device)
            base = timed(partial(F.linear, x, weight))
            for n in (int(a) for a in args.adapters.split(",")):
                slots = np.array([(i % n) + 1 for i in range(tokens)])
                token_slots = torch.from_numpy(slots).to(device)
                meta = lora_meta(token_slots, 9)
                sizes = spec.out_features
                sgmv = timed(
                    partial(add_lora, y, x, stack.a, stack.b, token_slots, sizes, meta=meta)
                )
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    add_lora(y, x, stack.a, stack.b, token_slots, sizes, meta=meta)
                replay = timed(graph.replay)
                plain = timed(partial(add_lora_torch, y, x, stack, _torch_plan(slots, device)))
                print(
                    f"{spec.attr:<6}{tokens:>7}{n:>9}{base:>10.1f}{sgmv:>10.1f}{replay:>10.1f}"
                    f"{plain:>10.1f}{replay / base:>10.2f}x"
                )


if __name__ == "__main__":
    main()
