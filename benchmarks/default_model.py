"""The embedded default model, SmolLM2-135M-Instruct: conversion time, and output tokens/s
of legato's LLM against transformers' generate in the same run.

Conversion: a fresh process converts the shipped GGUF file into an empty
``$LEGATO_HOME`` (the first-start cost of ``legato serve``), timed inside the
process (the call) and from outside (interpreter start and imports included).

Throughput: one real chat prompt (rendered with the model's template), repeated
``batch`` times, ``--output-len`` greedy tokens each with EOS ignored;
tokens/s = batch * output_len / wall time (prefill included). legato runs
``LLM`` (worker process) with prefix caching off, so the repeated prompt is
computed ``batch`` times as transformers does; transformers runs ``generate``
on the same converted directory (the same weights as the GGUF file). Both use
the same torch thread count. Prints a table; never asserted in tests.

    flock -x /tmp/legato-cpu.lock python benchmarks/default_model.py --output-len 64
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHAT = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]


def conversion_seconds() -> tuple[float, float]:
    """(the call, the whole process) for a first conversion into an empty $LEGATO_HOME."""
    code = (
        "import time; t = time.perf_counter()\n"
        "from legato.default_model import default_model_dir; default_model_dir()\n"
        "print(time.perf_counter() - t)\n"
    )
    with tempfile.TemporaryDirectory() as home:
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "LEGATO_HOME": home},
            capture_output=True,
            text=True,
            check=True,
        )
        total = time.perf_counter() - start
    return float(out.stdout.strip().splitlines()[-1]), total


def bench_legato(
    model_dir: str, prompt: list[int], batch: int, output_len: int, dtype: str
) -> float:
    from legato.llm import LLM
    from legato.protocol.params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    with LLM(
        model_dir,
        dtype=dtype,
        max_model_len=len(prompt) + output_len + 16,
        max_num_seqs=batch,
        enable_prefix_caching=False,
        disable_log_stats=True,
    ) as llm:
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": prompt}] * batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == batch * output_len, generated
    return generated / elapsed


def bench_transformers(model: object, prompt: list[int], batch: int, output_len: int) -> float:
    import torch

    ids = torch.tensor([prompt] * batch)
    kwargs = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len)
    with torch.inference_mode():
        model.generate(ids[:1], do_sample=False, max_new_tokens=4)  # type: ignore[attr-defined]
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)  # type: ignore[attr-defined]
        elapsed = time.perf_counter() - start
    assert out.shape == (batch, len(prompt) + output_len), out.shape
    return batch * output_len / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--skip-conversion", action="store_true")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from legato.default_model import default_model_dir
    from legato.tokenizer_loading import load_tokenizer

    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"CPU: {platform.processor() or platform.machine()}, capability {cpu}, "
          f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}")  # fmt: skip
    if not args.skip_conversion:
        call, total = conversion_seconds()
        print(f"conversion of the GGUF into an empty $LEGATO_HOME: {call:.1f} s "
              f"(the process, imports included: {total:.1f} s)")  # fmt: skip

    model_dir = str(default_model_dir())
    tokenizer = load_tokenizer(model_dir)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    print(f"prompt: {len(prompt)} tokens; output: {args.output_len} tokens per sequence, greedy")
    print(f"{'dtype':<9} {'batch':>5} {'legato tok/s':>13} {'transformers tok/s':>19} {'ratio':>6}")
    for dtype in args.dtypes.split(","):
        hf = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        ).eval()
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            ours = bench_legato(model_dir, prompt, batch, args.output_len, dtype)
            theirs = bench_transformers(hf, prompt, batch, args.output_len)
            print(f"{dtype:<9} {batch:>5} {ours:>13.1f} {theirs:>19.1f} {ours / theirs:>6.2f}")
        del hf


if __name__ == "__main__":
    main()
