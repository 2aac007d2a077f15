"""CPU seconds per process while ``LLM.generate`` runs: the engine process against its worker.

The worker should use the cores for the model; the engine process (scheduler,
detokenizer, trio loop) should stay near idle while a step runs, so that it never
takes a core from the worker's matmuls. Runs the compare.sh workload shape (by
default 64 prompts x 128 random ids, 128 greedy tokens, EOS ignored) on a model
directory and prints, for the timed generate: wall seconds, each process's user
and system CPU seconds (from /proc, threads included) and its share of one core,
and output tokens/s. ``--max-num-batched-tokens`` sets the prefill chunk budget. Linux only; a figure, never asserted.

    python benchmarks/process_cpu.py MODEL_DIR --dtype float32
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402

from legato import LLM, SamplingParams  # noqa: E402


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid``, all its threads."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def children(pid: int) -> list[int]:
    """Child processes of ``pid``, whichever of its threads started them."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(x) for x in f.read().split()]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--in-len", type=int, default=128)
    parser.add_argument("--out-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine default")
    args = parser.parse_args()
    prompts = np.random.default_rng(1234).integers(3, 32000, size=(args.n, args.in_len)).tolist()
    extra = {}
    if args.max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.in_len + args.out_len + 64,
        max_num_seqs=args.n,
        seed=0,
        disable_log_stats=True,
        **extra,
    )
    params = SamplingParams(
        max_tokens=args.out_len, ignore_eos=True, temperature=0, detokenize=False
    )
    reqs: list[dict[str, list[int]]] = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(reqs[:2], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    me = os.getpid()
    procs = {"engine": me, **{f"worker {pid}": pid for pid in children(me)}}
    before = {name: cpu_seconds(pid) for name, pid in procs.items()}
    began = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    wall = time.perf_counter() - began
    after = {name: cpu_seconds(pid) for name, pid in procs.items()}
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"wall {wall:.2f} s, {tokens / wall:.0f} out tok/s, {os.cpu_count()} cores")
    for name in procs:
        user = after[name][0] - before[name][0]
        system = after[name][1] - before[name][1]
        print(
            f"{name:>14}: user {user:6.2f} s  sys {system:5.2f} s  "
            f"= {(user + system) / wall:4.2f} cores"
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
