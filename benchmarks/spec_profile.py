"""Where a speculative step's time goes: the default model stepped in-process through
``LLMEngine``, one stream of the ``edit`` workload (``spec_decode.py``'s; ``--chat``: its first
free-chat prompt), with and without n-gram drafts.

Per run it prints the steps, tokens and milliseconds per step, then the functions
with the most time of their own (cProfile) over the timed steps; on CUDA also how
many kernels one step launched and how long the GPU was busy (torch.profiler), so
host time and device time can be told apart.

``--stack`` instead times the decoder stack alone (``legato_decode_layers_f32``) on the
CPU, for one sequence at 1 row (a plain step) and at ``k + 1`` rows (a verification
step: its last token and ``k`` drafts, each attending up to itself) after a 200-token
prompt: the median of ``--reps`` calls, ``--rounds`` rounds alternating three paths in one
process: one parallel region with the verification rows' norms and activation codes shared
between the threads (``cpu_kernels.decode_verify_rows``, the default), one region with every
thread doing every row, and the op-by-op path (``cpu_kernels.decode_one_region(False)``). ``t(1, k+1) / t(1, 1)`` is what the draft policy weighs
a verification step by.

    python benchmarks/spec_profile.py [--k 4] [--max-tokens 128] [--top 25] [--dequantize]
    flock -x /tmp/legato-cpu.lock python benchmarks/spec_profile.py --stack [--k 4] [--reps 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from typing import Any

import common  # noqa: F401  (the offline environment)
from spec_decode import CHAT_ASKS, EDIT_ASKS, EDIT_TEXT


def run(args: argparse.Namespace, spec: dict[str, Any] | None) -> None:
    import torch
    from transformers import AutoTokenizer

    from legato.default_model import default_model_dir
    from legato.llm import LLMEngine
    from legato.protocol.params import RequestOutputKind, SamplingParams

    path = str(default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHAT_ASKS[0] if args.chat else EDIT_ASKS[0] + EDIT_TEXT}],
        tokenize=False,
        add_generation_prompt=True,
    )
    engine = LLMEngine.from_engine_args(
        path, speculative_config=spec, gguf_dequantize=args.dequantize, disable_log_stats=True
    )
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY
    )

    def one(request_id: str) -> tuple[int, int, float]:
        engine.add_request(request_id, prompt, params)
        steps, tokens = 0, 0
        engine.step()  # the prefill, not timed
        began = time.perf_counter()
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    tokens = len(out.outputs[0].token_ids)
        return steps, tokens, time.perf_counter() - began

    one("warm-up")
    profiler = cProfile.Profile()
    profiler.enable()
    steps, tokens, seconds = one("timed")
    profiler.disable()
    label = f"n-gram k={args.k}" if spec else "plain"
    print(
        f"\n== {label}: {steps} steps, {tokens} tokens, {1e3 * seconds / steps:.2f} ms/step, "
        f"{tokens / seconds:.1f} tok/s (cProfile on: slower than without)"
    )
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-6000:])
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        engine.add_request("kernels", prompt, params)
        engine.step()
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            began = time.perf_counter()
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - began
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy = sum(e.device_time for e in events) / 1e3  # us -> ms
        print(
            f"{label}: 5 steps {1e3 * wall:.1f} ms wall (profiled), {len(events)} GPU kernels "
            f"and copies, GPU busy {busy:.1f} ms"
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def stack_rows(args: argparse.Namespace) -> None:
    """The decoder stack's time at 1 and ``k + 1`` rows of one sequence (``--stack``)."""
    import dataclasses
    import statistics

    import numpy as np
    import torch

    from legato.config import EngineConfig
    from legato.default_model import default_model_gguf
    from legato.models import cpu_kernels
    from legato.models.runner import ModelRunner
    from legato.models.step_metadata import build_metadata

    runner = ModelRunner(
        EngineConfig(model=str(default_model_gguf()), device="cpu", num_kv_blocks=64)
    )
    table = np.arange(32, dtype=np.int32).reshape(1, -1)
    kernel = cpu_kernels.decode_layers_kernel()
    seconds: list[float] = []

    def timed(*call: Any) -> Any:
        began = time.perf_counter()
        code = kernel(*call)
        seconds.append(time.perf_counter() - began)
        return code

    def forward(tokens: list[int], start: int) -> None:
        meta, _, _ = build_metadata(
            np.array([start], dtype=np.int64), np.array([len(tokens)], dtype=np.int64), table,
            runner.block_size, runner.device,
        )  # fmt: skip
        if start:
            meta = dataclasses.replace(meta, rows_as_decodes=True)
        runner.model(torch.tensor(tokens, dtype=torch.int64), runner.kv_caches, meta)

    context = 200
    forward(list(range(100, 100 + context)), 0)
    cpu_kernels.decode_layers_kernel = lambda: timed  # type: ignore[assignment]
    # one region with the verification rows' norms and codes shared between the threads,
    # one region with every thread doing every row, and op by op
    paths = {"rows shared": (True, True), "one region": (True, False), "op by op": (False, True)}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, (region, shared) in paths.items():
            cpu_kernels.decode_one_region(region)
            cpu_kernels.decode_verify_rows(shared)
            for rows in (1, args.k + 1):
                seconds.clear()
                for _ in range(args.reps):
                    forward([7 + j for j in range(rows)], context)
                times.setdefault((name, rows), []).append(1e3 * statistics.median(seconds))
    cpu_kernels.decode_one_region(True)
    cpu_kernels.decode_verify_rows(True)
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    for name in paths:
        t1, tk = (statistics.median(times[(name, r)]) for r in (1, args.k + 1))
        rounds = " ".join(
            f"{a:.2f}/{b:.2f}" for a, b in zip(*(times[(name, r)] for r in (1, args.k + 1)))
        )
        print(
            f"{name:>11}: t(1,1) {t1:.2f} ms, t(1,{args.k + 1}) {tk:.2f} ms, ratio "
            f"{tk / t1:.2f}  (rounds t(1,1)/t(1,{args.k + 1}): {rounds})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--dequantize", action="store_true")
    parser.add_argument("--chat", action="store_true", help="a free-chat prompt, not the edit")
    parser.add_argument("--stack", action="store_true", help="time the decoder stack alone")
    parser.add_argument("--reps", type=int, default=60, help="--stack: calls a median is of")
    parser.add_argument("--rounds", type=int, default=3, help="--stack: rounds of every path")
    args = parser.parse_args()
    if args.stack:
        stack_rows(args)
        return
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    run(args, None)
    run(args, spec)


if __name__ == "__main__":
    main()
