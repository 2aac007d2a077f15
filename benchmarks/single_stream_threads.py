"""Where a single stream's decode time goes, by thread: CPU seconds per token of every
thread of the engine's process and of its worker process, against the wall time.

Runs ``LLM.generate`` as the llama.cpp anchor's ``bench.py`` does (64 prompt tokens,
``--output-len`` greedy tokens, EOS ignored, one warm-up, then ``--reps`` runs) on
``--gguf`` (default: the default model's Q4_1 file), reads each thread's CPU time from
``/proc`` before and after the timed runs, and prints one line per thread that used CPU.
A worker whose main thread and OpenMP thread each use about the wall time per token is
busy all the time (the OpenMP thread spins between parallel regions); the engine
thread's CPU per token runs beside it on the same cores. Never asserted.

    flock -x /tmp/legato-cpu.lock python benchmarks/single_stream_threads.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from process_cpu import children  # noqa: E402

TEXT = (
    "The history of the city begins with a small settlement on the river, where traders met"
    " to exchange salt, wool and grain. Over the centuries the town grew into a market centre,"
    " then a port, and its people built walls, bridges, churches and schools. "
) * 8


def thread_cpu_seconds() -> dict[tuple[int, int, str], float]:
    """CPU seconds (user + system) of every thread of this process and its children."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = [os.getpid(), *children(os.getpid())]
    out: dict[tuple[int, int, str], float] = {}
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[(pid, int(task), name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="a .gguf file (default: the default model)")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from legato import LLM, SamplingParams

    if args.gguf is None:
        from legato.default_model import default_model_gguf

        args.gguf = str(default_model_gguf())
    llm = LLM(args.gguf, dtype="auto")
    ids = llm.get_tokenizer()(TEXT)["input_ids"][: args.prompt_len]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": ids}]
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    before, began, tokens, rates = thread_cpu_seconds(), time.perf_counter(), 0, []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - t0
        metrics = out.metrics
        ttft = metrics.first_token_time - metrics.arrival_time if metrics else 0.0
        n = len(out.outputs[0].token_ids)
        rates.append((n - 1) / (elapsed - ttft))
        tokens += n
    wall = time.perf_counter() - began
    after = thread_cpu_seconds()
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; {args.gguf}")
    print(f"decode {statistics.median(rates):.1f} tok/s (median of {args.reps})")
    print(f"{'process':>8} {'pid':>8} {'thread':>8} {'cpu ms/token':>12}")
    for (pid, tid, _name), seconds in sorted(after.items()):
        used = seconds - before.get((pid, tid, _name), 0.0)
        if used > 0.005:
            role = "engine" if pid == os.getpid() else "worker"
            print(f"{role:>8} {pid:>8} {tid:>8} {used / tokens * 1e3:>12.2f}")
    print(f"{'wall':>8} {'':>8} {'':>8} {wall / tokens * 1e3:>12.2f}")


if __name__ == "__main__":
    main()
