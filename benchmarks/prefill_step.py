"""Where one prefill step's time goes: the compare.sh workload's 2048-token step on a model dir.

Loads ``MODEL_DIR`` in a ModelRunner (CPU) and runs steps that each prefill
``--prompts`` fresh prompts of ``--in-len`` random ids (numpy seed 1234, as
compare.sh), one untimed, then ``--steps`` timed with the categories of
``decode_step.py --profile`` (matmuls, attention, norm+rope+act, input prep,
sampling, other). Prints one line per step; never asserted. Example::

    python benchmarks/prefill_step.py ~/.cache/legato-anchors/model/fp32 --prompts 16
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from decode_step import profiled

from legato.config import EngineConfig
from legato.models.runner import ModelRunner
from legato.protocol.messages import (
    CachedRequestData,
    NewRequestData,
    RunnerSamplingParams,
    SchedulerOutput,
)
from legato.protocol.params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--in-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    blocks = -(-(args.in_len + 1) // 16)
    rows = args.prompts * (args.steps + 1)
    runner = ModelRunner(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,  # type: ignore[arg-type]
            device="cpu",
            block_size=16,
            num_kv_blocks=blocks * args.prompts,
            max_num_seqs=rows,
            max_num_batched_tokens=args.prompts * args.in_len,
        )
    )
    ids = np.random.default_rng(1234).integers(3, 32000, size=(args.prompts, args.in_len))
    params = SamplingParams(temperature=0.0, max_tokens=None)
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    for step in range(args.steps + 1):
        new = [
            NewRequestData(
                f"s{step}-{i}",
                ids[i].tolist(),
                "greedy",
                list(range(i * blocks, (i + 1) * blocks)),
                0,
            )
            for i in range(args.prompts)
        ]
        sched = {r.request_id: args.in_len for r in new}
        table = {"greedy": RunnerSamplingParams.of(params)}
        plan = SchedulerOutput(
            step, new, CachedRequestData(), sched, sum(sched.values()), sampling_params=table
        )
        began = time.perf_counter()
        with profiled(runner) as totals:
            runner.execute(plan)
        elapsed = time.perf_counter() - began
        if step == 0:
            continue  # warm-up
        parts = "  ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(totals.items()))
        other = (elapsed - sum(totals.values())) * 1e3
        print(f"{sum(sched.values())} tokens: {elapsed * 1e3:.0f} ms  ({parts}  other {other:.0f})")


if __name__ == "__main__":
    main()
