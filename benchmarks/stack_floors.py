"""The one-sequence decode stack against its compute floor: the same weights in cache.

Loads ``FILE`` (a .gguf) in a ModelRunner on the CPU, prefills 64 tokens, and times the
decoder stack alone (``DecodeStack.run``, one native call, one row) over 100 decode positions,
``--rounds`` times, alternating two ways:

- ``stack``: as a decode step runs it, every layer streaming its own weights from memory;
- ``alias``: every layer pointed at layer 0's weights (its own norms and KV cache), so the
  weights (~4 MB a layer) stay in cache: the step's compute floor. The hidden states are
  then not the model's; only the time means anything.

Prints the median (and range) of each in ms a step and as GB/s of the step's weight bytes.
If ``stack`` is well above both ``alias`` and the bytes over the machine's read bandwidth,
compute and memory are not overlapping. Never asserted.

    flock -x /tmp/legato-cpu.lock python benchmarks/stack_floors.py FILE.gguf --rounds 5
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from legato.config import EngineConfig
from legato.models.runner import ModelRunner
from legato.models.step_metadata import build_metadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(EngineConfig(model=args.gguf, device="cpu", num_kv_blocks=64))
    model = runner.model
    table = np.arange(32, dtype=np.int32).reshape(1, -1)

    def meta(tokens: int, start: int) -> object:
        return build_metadata(
            np.array([start]), np.array([tokens]), table, runner.block_size, runner.device
        )[0]

    positions = range(64, 164)
    with torch.inference_mode():
        model(torch.tensor(list(range(100, 164))), runner.kv_caches, meta(64, 0))
        stack = model._decode_stack(runner.kv_caches)
        steps = []
        for p in positions:
            cos_sin, step_meta = model.rotary.for_step(meta(1, p))
            steps.append((model.model.embed_tokens(torch.tensor([7])), step_meta, cos_sin))
        layers = stack.layers
        saved = [bytes(layer) for layer in layers]
        weights_at = type(layers[0]).qkv.offset  # the projections follow norms and caches

        def point_at_layer0(on: bool) -> None:
            for i, own in enumerate(saved):
                fields = bytearray(own)
                if on:
                    fields[weights_at:] = saved[0][weights_at:]
                ctypes.memmove(ctypes.addressof(layers[i]), bytes(fields), len(fields))

        times: dict[str, list[float]] = {"stack": [], "alias": []}
        for _ in range(args.rounds):
            for way in times:
                point_at_layer0(way == "alias")
                start = time.perf_counter()
                for hidden, step_meta, cos_sin in steps:
                    stack.run(hidden, step_meta, cos_sin)
                times[way].append((time.perf_counter() - start) / len(steps))
        point_at_layer0(False)
    nbytes = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            nbytes += linear.quantized.nbytes
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; {args.gguf}")
    for way, ts in times.items():
        med = statistics.median(ts)
        print(
            f"{way}: {med * 1e3:.3f} ms a step ({min(ts) * 1e3:.3f} .. {max(ts) * 1e3:.3f}),"
            f" {nbytes / med / 1e9:.1f} GB/s of {nbytes / 1e6:.0f} MB of weights"
        )


if __name__ == "__main__":
    main()
