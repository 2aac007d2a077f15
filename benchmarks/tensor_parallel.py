"""Step time of two tensor-parallel ranks (gloo) against one process, and the collectives' share.

A random-weight Llama (by default the 56M shape of ``common.SHAPE_56M``) is
saved once. Then, in separate processes measured in the same run:

- TP=1: one ModelRunner with every core of this machine (torch threads);
- TP=2: two rank processes, each a ModelRunner on its half of the model
  (``legato.models.tensor_parallel``) with half the cores, joined by a gloo
  group over loopback; the time each step spends in the collectives
  (all-reduce after o_proj/down_proj/embedding, all-gather of the logits) is
  measured on rank 0.

Each runs the same steps: one prefill of ``--batch`` prompts of ``--context``
tokens, then ``--steps`` greedy decode steps of the batch (median reported).
The decode tokens of TP=2 must equal TP=1's (checked, printed). Prints a
table; never asserted in tests. Example::

    python benchmarks/tensor_parallel.py --batch 8 --context 128 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _steps(args: argparse.Namespace) -> list[Any]:
    """The SchedulerOutputs: one prefill of every request, then decodes (tokens filled in later)."""
    from legato.protocol.messages import (
        CachedRequestData,
        NewRequestData,
        RunnerSamplingParams,
        SchedulerOutput,
    )
    from legato.protocol.params import SamplingParams

    blocks = -(-(args.context + args.steps + 1) // 16)
    new = []
    for i in range(args.batch):
        prompt = [(7 * i + 13 * j) % 30000 + 3 for j in range(args.context)]
        block_ids = list(range(i * blocks, (i + 1) * blocks))
        new.append(NewRequestData(f"r{i}", prompt, "greedy", block_ids, 0))
    sched = {f"r{i}": args.context for i in range(args.batch)}
    table = {"greedy": RunnerSamplingParams.of(SamplingParams(temperature=0.0))}
    return [
        SchedulerOutput(
            0, new, CachedRequestData(), sched, sum(sched.values()), sampling_params=table
        )
    ]


def measure(args: argparse.Namespace, rank: int | None) -> dict[str, Any]:
    """Run the steps on one runner (``rank`` None: no tensor parallelism)."""
    import datetime

    import torch
    from torch._C._distributed_c10d import TCPStore

    from legato.config import EngineConfig
    from legato.models.process_group import gloo_group
    from legato.models.runner import ModelRunner
    from legato.models.tensor_parallel import TensorParallel
    from legato.protocol.messages import CachedRequestData, SchedulerOutput

    torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model, device="cpu", dtype="float32", num_kv_blocks=args.batch * 64,
        max_num_seqs=args.batch,
    )  # fmt: skip
    group = None
    parallel = None
    if rank is not None:
        store = TCPStore(
            "127.0.0.1", args.port, 2, is_master=rank == 0,
            timeout=datetime.timedelta(seconds=300), wait_for_workers=False,
        )  # fmt: skip
        group = gloo_group(store, rank=rank, world_size=2, timeout=300)
        parallel = TensorParallel(group)
    runner = ModelRunner(config, parallel=parallel)
    first = _steps(args)[0]
    out = runner.execute(first)  # also the warm-up
    tokens = out.sampled_lists()
    decode: list[float] = []
    shares: list[float] = []
    if group is not None:
        group.timed = True
    for step in range(1, args.steps + 1):
        ids = [f"r{i}" for i in range(args.batch)]
        cached = CachedRequestData(
            ids,
            [args.context + step - 1] * args.batch,
            new_token_ids={ids[i]: tokens[i][-1:] for i in range(args.batch) if tokens[i]},
        )
        sched = {f"r{i}": 1 for i in range(args.batch)}
        plan = SchedulerOutput(step, [], cached, sched, args.batch)
        if group is not None:
            group.collective_seconds = 0.0
        began = time.perf_counter()
        out = runner.execute(plan)
        took = time.perf_counter() - began
        decode.append(took)
        if group is not None:
            shares.append(group.collective_seconds / took)
        for i, sampled in enumerate(out.sampled_lists()):
            tokens[i].extend(sampled)
    # The prefill, timed once warm: fresh requests on the finished ones' blocks.
    again = _steps(args)[0]
    again.step_id = args.steps + 1
    for req in again.new_requests:
        req.request_id += "-again"
    again.num_scheduled_tokens = {f"{k}-again": v for k, v in first.num_scheduled_tokens.items()}
    again.finished_req_ids = [f"r{i}" for i in range(args.batch)]
    if group is not None:
        group.collective_seconds = 0.0
    began = time.perf_counter()
    runner.execute(again)
    prefill = time.perf_counter() - began
    prefill_share = group.collective_seconds / prefill if group is not None else None
    return {
        "prefill_ms": prefill * 1e3,
        "decode_ms": statistics.median(decode) * 1e3,
        "decode_share": statistics.median(shares) if shares else None,
        "prefill_share": prefill_share,
        "tokens": tokens,
    }


def _child(
    args: argparse.Namespace, role: str, threads: int, extra: list[str]
) -> subprocess.Popen[str]:
    command = [
        sys.executable, __file__, "--role", role, "--model", args.model, "--threads", str(threads),
        "--batch", str(args.batch), "--context", str(args.context), "--steps", str(args.steps),
        *extra,
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def _result(child: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"a measuring process failed (exit {child.returncode})")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["parent", "single", "rank0", "rank1"], default="parent")
    parser.add_argument("--model", default=None, help="a checkpoint dir (default: a random 56M)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (children)")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.role == "single":
        print(json.dumps(measure(args, None)))
        return
    if args.role in ("rank0", "rank1"):
        print(json.dumps(measure(args, int(args.role[-1]))))
        return

    import torch

    from legato.actors.tensor_parallel_executor import free_port

    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from common import random_llama_checkpoint

            args.model = str(random_llama_checkpoint(Path(tmp) / "m56", with_tokenizer=False))
        single = _result(_child(args, "single", cores, []))
        port = str(free_port("127.0.0.1"))
        ranks = [_child(args, f"rank{r}", max(1, cores // 2), ["--port", port]) for r in range(2)]
        tp = [_result(child) for child in ranks]
    same = tp[0]["tokens"] == single["tokens"] == tp[1]["tokens"]
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, {cores} cores; fp32; "
          f"batch {args.batch} x context {args.context}; {args.steps} decode steps; "
          f"TP=2 tokens identical to TP=1: {same}")  # fmt: skip
    print(f"{'':26} {'prefill ms':>11} {'decode ms/step':>15} {'collectives: prefill':>21} "
          f"{'decode':>7}")  # fmt: skip
    print(f"{'TP=1 (' + str(cores) + ' threads)':26} {single['prefill_ms']:11.1f} "
          f"{single['decode_ms']:15.2f} {'-':>21} {'-':>7}")  # fmt: skip
    r0 = tp[0]
    label = f"TP=2 ({max(1, cores // 2)} thread/rank)"
    print(f"{label:26} {r0['prefill_ms']:11.1f} {r0['decode_ms']:15.2f} "
          f"{r0['prefill_share']:21.0%} {r0['decode_share']:7.0%}")  # fmt: skip
    print(f"TP=2 / TP=1: prefill {r0['prefill_ms'] / single['prefill_ms']:.2f}x, "
          f"decode {r0['decode_ms'] / single['decode_ms']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
