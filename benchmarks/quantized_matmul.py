"""Weight-only matmul over GGUF-quantized weights, against the candidates, on the default
model's shapes (SmolLM2-135M: hidden 576, MLP 1536, 3 KV heads, vocabulary 49152).

Per shape and batch, microseconds per call (median of ``--reps`` timings of ``--iters``
calls) of:

- ``fp32 oneDNN``: the dequantized fp32 weight prepacked for oneDNN (legato's path before);
- ``bf16 oneDNN``: the same in bf16 (native bf16 where the CPU has it);
- ``int4pack fp32`` / ``int4pack bf16``: torch's own ``_weight_int4pack_mm_for_cpu`` (group 32,
  scale + zero: Q4_0 / Q4_1 / Q4_K map onto it exactly) with fp32 or bf16 activations;
- ``legato Q4_1`` / ``legato Q8_0`` / ``legato Q6_K``: :mod:`legato.models.quantized`'s native
  kernel with fp32 activations (the fidelity path), and ``i8 Q4_1`` / ``i8 Q8_0`` / ``i8 Q6_K``
  with int8 activations (the default path; ``--isa`` pins its AVX-512 VNNI / AVX2 / portable
  loop, default the best this CPU runs).

    flock -x /tmp/legato-cpu.lock python benchmarks/quantized_matmul.py --batches 1 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

SHAPES = [  # (name, out_features, in_features)
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]


def timed(fn: Callable[[], object], iters: int, reps: int) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(reps):
        began = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - began) / iters * 1e6)
    return statistics.median(runs)


def candidates(
    x: torch.Tensor,
    packed: torch.Tensor,
    packed_bf16: torch.Tensor,
    int4: torch.Tensor,
    scale_zero: torch.Tensor,
    layers: dict[str, Callable[[torch.Tensor], torch.Tensor]],
) -> dict[str, Callable[[], object]]:
    """The calls to time for one shape and batch, by column name."""
    xb, szb = x.bfloat16(), scale_zero.bfloat16()
    mkldnn, aten = torch.ops.mkldnn, torch.ops.aten
    row: dict[str, Callable[[], object]] = {
        "fp32 oneDNN": lambda: mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "bf16 oneDNN": lambda: mkldnn._linear_pointwise(xb, packed_bf16, None, "none", [], ""),
        "int4pack fp32": lambda: aten._weight_int4pack_mm_for_cpu(x, int4, 32, scale_zero),
        "int4pack bf16": lambda: aten._weight_int4pack_mm_for_cpu(xb, int4, 32, szb),
    }
    for kind, layer in layers.items():
        name = kind if kind.startswith("i8") else f"legato {kind}"
        row[name] = lambda layer=layer: layer(x)  # type: ignore[misc]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--isa", default=None, help="avx512_vnni, avx2 or portable")
    args = parser.parse_args()

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
    from test_quantized import random_blocks  # the tests' random GGUF blocks

    from legato.models import cpu_kernels
    from legato.models.quantized import QuantizedLinear, from_gguf

    isa = cpu_kernels.quantized_isa(args.isa)
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads;"
          f" int8 path: {isa}")  # fmt: skip
    cols = ["fp32 oneDNN", "bf16 oneDNN", "int4pack fp32", "int4pack bf16"]
    cols += ["legato Q4_1", "legato Q8_0", "legato Q6_K", "i8 Q4_1", "i8 Q8_0", "i8 Q6_K"]
    print(f"{'shape':>8} {'batch':>5} " + " ".join(f"{c:>13}" for c in cols) + "   (us per call)")
    for batch in args.batches:
        for name, n, k in SHAPES:
            x = torch.randn(batch, k)
            weights = {
                t: [from_gguf(random_blocks(t, n, k), t, n, k)]
                for t in ("Q4_1", "Q8_0", "Q6_K")
                if k % (256 if t == "Q6_K" else 32) == 0  # K-quants need rows of 256
            }
            layers: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
            for t, parts in weights.items():
                layers[t] = QuantizedLinear(parts, int8_max_rows=0)
                layers[f"i8 {t}"] = QuantizedLinear(parts, int8_max_rows=batch)
            w = weights["Q4_1"][0].dequantize()
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64)
            codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
            int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
            sz = torch.randn(k // 32, n, 2)
            row = candidates(x, packed, packed_bf16, int4, sz, layers)
            iters = max(2, args.iters // (8 if name == "lm_head" else 1))
            if batch > 4:  # the fp32 int4pack path is scalar: seconds at the LM head
                iters = max(2, iters // 4)
            figures = [
                f"{timed(row[c], iters, args.reps):>13.0f}" if c in row else f"{'-':>13}"
                for c in cols
            ]
            print(f"{name:>8} {batch:>5} " + " ".join(figures))


if __name__ == "__main__":
    main()
