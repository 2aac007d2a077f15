"""The model worker's resident memory after load, per GGUF file, against the goal
"at most 1.3x the file size plus the KV cache".

For each file: ``LLM(file)`` starts the engine and its worker process; once it is ready,
the worker's VmRSS (and its anonymous / file-backed parts) is read from /proc; then one
request (``--prompt-len`` ids, ``--output-len`` greedy tokens) runs and the RSS is read
again. Printed beside it: the file's size, the KV cache the worker allocated (its budget:
resident only where written, see ``legato.models.runner_memory``), the goal, and the
runtime floor: the RSS of a bare process that imports what the worker imports (Python,
torch, legato's worker and model runner) and loads nothing. Linux only; a figure, never
asserted.

    python benchmarks/worker_rss.py [FILE.gguf ...]   # default: the default model's file
    python benchmarks/worker_rss.py ~/.cache/legato-anchors/gguf/*.{Q4_1,Q8_0,Q4_K_M}.gguf
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FLOOR = """
import torch, legato.workers.worker, legato.models.runner
for line in open("/proc/self/status"):
    if line.startswith("VmRSS:"):
        print(int(line.split()[1]) // 1024)
"""


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of ``pid`` in MB."""
    found = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                found[key] = int(value.split()[0]) / 1024
    return found


def worker_pid() -> int:
    """The legato worker among this process's descendants."""
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in (int(x) for x in f.read().split()):
                    with open(f"/proc/{child}/cmdline", "rb") as cmd:
                        if b"legato.workers.worker" in cmd.read():
                            return child
                    todo.append(child)
    raise RuntimeError("no legato worker process found")


def runtime_floor_mb() -> float:
    out = subprocess.run([sys.executable, "-c", FLOOR], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf", nargs="*")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    from legato import LLM, SamplingParams
    from legato.models.config import load_model_config

    files = [Path(f) for f in args.gguf]
    if not files:
        from legato.default_model import default_model_gguf

        files = [default_model_gguf()]
    floor = runtime_floor_mb()
    print(f"runtime floor (python + torch + legato worker imports, no model): {floor:.0f} MB")
    print(
        f"{'file':<36} {'file MB':>8} {'KV MB':>7} {'goal MB':>8} {'RSS load':>9}"
        f" {'anon':>6} {'file-b':>7} {'-floor':>7} {'x file':>7} {'RSS run':>8}"
    )
    sampling = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for path in files:
        cfg = load_model_config(path)
        llm = LLM(str(path), dtype="float32")
        try:
            pid = worker_pid()
            loaded = memory_mb(pid)
            blocks = llm.engine.vllm_config.cache_config.num_gpu_blocks
            block_bytes = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
            kv_mb = (blocks or 0) * block_bytes / 2**20
            prompt = list(range(100, 100 + args.prompt_len))
            llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)
            ran = memory_mb(pid)
        finally:
            llm.shutdown()
        size = path.stat().st_size / 2**20
        above = loaded["VmRSS"] - floor
        print(
            f"{path.name[-36:]:<36} {size:>8.0f} {kv_mb:>7.0f} {1.3 * size + kv_mb:>8.0f}"
            f" {loaded['VmRSS']:>9.0f} {loaded['RssAnon']:>6.0f} {loaded['RssFile']:>7.0f}"
            f" {above:>7.0f} {above / size:>7.2f} {ran['VmRSS']:>8.0f}"
        )


if __name__ == "__main__":
    main()
