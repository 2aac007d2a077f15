"""Where a speculative step's time goes: the default model stepped in-process through
``LLMEngine``, one stream of the ``edit`` workload (``spec_decode.py``'s; ``--chat``: its first
free-chat prompt), with and without n-gram drafts.

Per run it prints the steps, tokens and milliseconds per step, then the functions
with the most time of their own (cProfile) over the timed steps; on CUDA also how
many kernels one step launched and how long the GPU was busy (torch.profiler), so
host time and device time can be told apart.

    python benchmarks/spec_profile.py [--k 4] [--max-tokens 128] [--top 25] [--dequantize]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--dequantize", action="store_true")
    parser.add_argument("--chat", action="store_true", help="a free-chat prompt, not the edit")
    args = parser.parse_args()
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
