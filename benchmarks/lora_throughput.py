"""Multi-LoRA and embedding throughput: legato's LLM against transformers + peft, in one run.

Generation: a batch of ``--batch`` prompts (random ids, ``--input-len`` in,
``--output-len`` out, greedy, ignore_eos), the requests spread round-robin over
0 (base model only), 1, 4 and 8 distinct rank-``--rank`` adapters on all seven
projections. legato runs them through ``LLM.generate(..., lora_request=[...])``
with ``max_loras=8``; peft runs the same batch as one ``generate`` with
``adapter_names`` (its mixed-adapter batches). Output tokens per second.

Embeddings: ``--embed-prompts`` prompts of ``--input-len`` tokens through
``LLM.embed`` (last-token pooling, normalised) against a transformers forward
in batches of ``--batch`` with the same pooling. Embeddings per second.

The model is the 56M-parameter random Llama of the other benchmarks; the
adapters are random peft adapters. Prints a table; never asserted.

    python benchmarks/lora_throughput.py --batch 32 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from common import random_llama_checkpoint

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """``count`` random peft adapters of ``rank`` on every projection, saved under ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for k in range(count):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False
        )
        model = get_peft_model(base, config)
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.02)
        path = out / f"adapter{k}"
        model.save_pretrained(path)
        paths.append(path)
    return paths


def bench_legato_generate(
    llm: Any, prompts: list[list[int]], output_len: int, adapters: list[Path], distinct: int
) -> float:
    from legato import LoRARequest, SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    loras = [
        LoRARequest(f"adapter{i % distinct}", i % distinct + 1, str(adapters[i % distinct]))
        if distinct
        else None
        for i in range(len(prompts))
    ]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(
        inputs[: distinct or 1],
        SamplingParams(max_tokens=2),
        lora_request=loras[: distinct or 1],
        use_tqdm=False,
    )  # warm-up, loads the adapters
    start = time.perf_counter()
    outs = llm.generate(inputs, params, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == len(prompts) * output_len, generated
    return generated / elapsed


def bench_peft_generate(
    peft_model: Any, prompts: list[list[int]], output_len: int, distinct: int
) -> float:
    import torch

    names = [f"a{i % distinct}" if distinct else "__base__" for i in range(len(prompts))]
    batch = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        peft_model.generate(
            input_ids=batch,
            attention_mask=torch.ones_like(batch),
            adapter_names=names,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
    return len(prompts) * output_len / (time.perf_counter() - start)


def bench_legato_embed(llm: Any, prompts: list[list[int]]) -> float:
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.embed(inputs[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.embed(inputs, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert len(outs) == len(prompts)
    return len(prompts) / elapsed


def bench_transformers_embed(model_dir: Path, prompts: list[list[int]], batch: int) -> float:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            hidden = model(torch.tensor(prompts[i : i + batch])).last_hidden_state
            F.normalize(hidden[:, -1], dim=-1).tolist()
    return len(prompts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--distinct", default="0,1,4,8")
    parser.add_argument("--embed-prompts", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-peft", action="store_true")
    args = parser.parse_args()

    import os

    import torch

    torch.set_num_threads(args.threads)
    os.environ["LEGATO_WORKER_THREADS"] = str(args.threads)
    distinct = [int(d) for d in args.distinct.split(",")]
    rng = random.Random(0)

    def random_prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(3, 32000) for _ in range(args.input_len)] for _ in range(n)]

    prompts = random_prompts(args.batch)
    embed_prompts = random_prompts(args.embed_prompts)
    rows: list[tuple[int, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_llama_checkpoint(Path(tmp) / "model")
        adapters = make_adapters(model_dir, Path(tmp), max(distinct), args.rank)

        from legato import LLM

        with LLM(
            str(model_dir),
            dtype="float32",
            enable_lora=True,
            max_loras=max(max(distinct), 1),
            max_lora_rank=args.rank,
            max_model_len=args.input_len + args.output_len + 16,
            max_num_seqs=max(args.batch, 32),
            max_num_batched_tokens=4096,
            disable_log_stats=True,
        ) as llm:
            ours = {
                d: bench_legato_generate(llm, prompts, args.output_len, adapters, d)
                for d in distinct
            }
            for d in distinct:
                print(f"  legato, {d} adapters: {ours[d]:.0f} tok/s", flush=True)
            embed_ours = bench_legato_embed(llm, embed_prompts)
            print(f"  legato embeddings: {embed_ours:.1f}/s", flush=True)

        theirs = {d: 0.0 for d in distinct}
        if not args.skip_peft:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            peft_model = PeftModel.from_pretrained(base, adapters[0], adapter_name="a0")
            for k, path in enumerate(adapters[1:], start=1):
                peft_model.load_adapter(path, adapter_name=f"a{k}")
            peft_model.eval()
            for d in distinct:
                theirs[d] = bench_peft_generate(peft_model, prompts, args.output_len, d)
                print(f"  transformers+peft, {d} adapters: {theirs[d]:.0f} tok/s", flush=True)
        embed_theirs = bench_transformers_embed(model_dir, embed_prompts, args.batch)
        print(f"  transformers embeddings: {embed_theirs:.1f}/s", flush=True)
        rows = [(d, ours[d], theirs[d]) for d in distinct]

    print(
        f"\nbatch {args.batch}, {args.input_len} in / {args.output_len} out, greedy, fp32, "
        f"56M Llama, rank-{args.rank} adapters on all projections, "
        f"{args.threads} threads, CPU {torch.backends.cpu.get_cpu_capability()}"
    )
    print(f"{'adapters':>9} {'legato tok/s':>13} {'peft tok/s':>11} {'ratio':>7}")
    for d, ours_d, theirs_d in rows:
        ratio = f"{ours_d / theirs_d:.2f}x" if theirs_d else "-"
        print(f"{d:>9} {ours_d:>13.0f} {theirs_d:>11.0f} {ratio:>7}")
    print(
        f"\nembeddings of {args.input_len}-token inputs: legato {embed_ours:.1f}/s, "
        f"transformers (batch {args.batch}) {embed_theirs:.1f}/s, "
        f"ratio {embed_ours / embed_theirs:.2f}x"
    )


if __name__ == "__main__":
    main()
