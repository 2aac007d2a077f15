"""Where one decode step of a GGUF model goes, weights kept quantized against dequantized.

Loads ``--gguf`` (default: the embedded default model, SmolLM2-135M-Instruct Q4_1) in a
ModelRunner on the CPU: with its quantized matrices kept quantized (the default: a decode
step's decoder stack in one native call, ``legato.models.decode_stack``), the same with that
off (``layered``: the layer-by-layer forward, one Python dispatch per kernel), and with
``gguf_dequantize=True`` (fp32 weights, oneDNN-packed). For each batch size, after a
``--context``-token prefill per sequence, times ``--steps`` decode steps (median) and splits
one profiled pass by category (:func:`decode_step.profiled`): matmuls, attention, norm +
rope + activation, input preparation, sampling, and the step's own overhead (the rest:
Python between the kernels), and the bytes of weights each way holds against the file's
size. Prints a table; never asserted.

    flock -x /tmp/legato-cpu.lock python benchmarks/gguf_decode_step.py --batch-sizes 1 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import CATEGORIES, LegatoDecode, profiled  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="a .gguf file (default: the default model)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.profile = True
    torch.set_num_threads(args.threads)
    if args.gguf is None:
        from legato.default_model import default_model_gguf

        args.gguf = str(default_model_gguf())
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; {args.gguf}")
    head = f"{'weights':>10} {'batch':>5} {'ms/step':>8} {'tok/s':>7} "
    print(head + " ".join(f"{c:>13}" for c in CATEGORIES) + "   (ms per step)")
    weights_mb: dict[str, float] = {}
    for batch in args.batch_sizes:
        prompts = torch.randint(0, 40000, (batch, args.context))
        for label, dequantize in (("quantized", False), ("layered", False), ("fp32", True)):
            ours = LegatoDecode(
                args, args.gguf, "float32", batch, prompts, gguf_dequantize=dequantize
            )
            ours.runner.model.fused_decode = label != "layered"
            for _ in range(args.warmup):
                ours.step()
            times = [ours.step() for _ in range(args.steps)]
            with profiled(ours.runner) as totals:
                profiled_times = [ours.step() for _ in range(args.steps)]
            model = ours.runner.model
            held = model.quantized_bytes() + ours.runner._packed_bytes
            held += sum(p.numel() * p.element_size() for p in model.parameters())
            weights_mb[label] = held / 2**20
            step = statistics.median(times)
            parts = {c: totals.get(c, 0.0) / args.steps for c in CATEGORIES}
            parts["overhead"] = statistics.mean(profiled_times) - sum(parts.values())
            print(
                f"{label:>10} {batch:>5} {step * 1e3:>8.2f} {batch / step:>7.0f} "
                + " ".join(f"{parts[c] * 1e3:>13.2f}" for c in CATEGORIES)
            )
            del ours
    file_mb = Path(args.gguf).stat().st_size / 2**20
    print(
        f"weights held: quantized {weights_mb['quantized']:.0f} MB, fp32 {weights_mb['fp32']:.0f}"
        f" MB; the file {file_mb:.0f} MB (ratio {weights_mb['quantized'] / file_mb:.2f}x)"
    )


if __name__ == "__main__":
    main()
