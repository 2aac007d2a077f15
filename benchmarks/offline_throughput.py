"""Offline throughput: legato's LLM against transformers' generate, in one run.

Workload (issue 5): N prompts of random token ids, fixed input and output
lengths, greedy, ignore_eos. transformers runs static batches of several sizes
and the best is reported. Prints a table; never asserted in tests.

    python benchmarks/offline_throughput.py --num-prompts 64 --input-len 128 --output-len 128
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from common import random_llama_checkpoint


def bench_legato(
    model_dir: str, prompts: list[list[int]], output_len: int, dtype: str, executor: str
) -> float:
    from legato.llm import LLM
    from legato.protocol.params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    with LLM(
        model_dir,
        dtype=dtype,
        executor=executor,
        max_model_len=len(prompts[0]) + output_len + 16,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=4096,
        disable_log_stats=True,
    ) as llm:
        llm.generate(
            [{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False
        )  # warm-up
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == len(prompts) * output_len, generated
    return generated / elapsed


def bench_transformers(
    model_dir: str, prompts: list[list[int]], output_len: int, dtype: str, batch_sizes: list[int]
) -> tuple[float, int]:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    best = (0.0, 0)
    for bs in batch_sizes:
        start = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(prompts), bs):
                batch = torch.tensor(prompts[i : i + bs])
                model.generate(
                    batch,
                    attention_mask=torch.ones_like(batch),
                    max_new_tokens=output_len,
                    min_new_tokens=output_len,
                    do_sample=False,
                    pad_token_id=0,
                )
        rate = len(prompts) * output_len / (time.perf_counter() - start)
        print(f"  transformers {dtype} batch {bs}: {rate:.0f} tok/s", flush=True)
        best = max(best, (rate, bs))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--hf-batch-sizes", default="16,32,64")
    parser.add_argument("--executor", default="process", choices=["process", "inproc"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    import os

    import torch

    torch.set_num_threads(args.threads)
    os.environ["LEGATO_WORKER_THREADS"] = str(args.threads)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 32000) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(random_llama_checkpoint(tmp))
        for dtype in args.dtypes.split(","):
            ours = bench_legato(model_dir, prompts, args.output_len, dtype, args.executor)
            print(f"  legato {dtype}: {ours:.0f} tok/s", flush=True)
            hf = (
                (0.0, 0)
                if args.skip_transformers
                else bench_transformers(
                    model_dir,
                    prompts,
                    args.output_len,
                    dtype,
                    [int(b) for b in args.hf_batch_sizes.split(",")],
                )
            )
            rows.append((dtype, ours, hf))
    print(
        f"\n{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, greedy, ignore_eos, "
        f"56M Llama, {args.threads} threads"
    )
    print(
        f"{'dtype':<10} {'legato tok/s':>14} {'transformers tok/s':>20} {'(best batch)':>13} {'ratio':>7}"
    )
    for dtype, ours, (hf, bs) in rows:
        ratio = f"{ours / hf:.2f}x" if hf else "-"
        print(f"{dtype:<10} {ours:>14.0f} {hf:>20.0f} {bs:>13} {ratio:>7}")


if __name__ == "__main__":
    main()
