"""MoE decode tok/s on CPU: legato's ModelRunner vs transformers, same random checkpoint.

A random-weight mixture-of-experts checkpoint (Qwen3-MoE shape by default:
hidden 512, 8 layers, 16 experts of 256, top-4, renormalised; ``--arch mixtral``
for Mixtral's, whose experts take ``--intermediate``) is written with
transformers' ``save_pretrained``. For each dtype and batch size every sequence
gets a ``--context``-token prompt, then ``--steps`` greedy decode steps are timed,
legato's and transformers' interleaved (the drivers of ``decode_step.py``:
``ModelRunner.execute`` against ``model(next_tokens, past_key_values=DynamicCache)``).
legato groups each step's tokens by expert and runs every expert once on its
tokens; transformers 5 loops over the experts hit too (``Qwen3MoeExperts``).

Prints a table; never asserted in tests. Example (take the exclusive CPU lock)::

    flock -x /tmp/legato-cpu.lock python benchmarks/moe_decode.py --batch-sizes 1 8 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from decode_step import LegatoDecode, TransformersDecode  # noqa: E402


def make_checkpoint(args: argparse.Namespace, path: str) -> Any:
    import transformers as tf

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=args.context + 2 * args.steps + args.warmup + 16,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if args.arch == "mixtral":
        config = tf.MixtralConfig(
            **common, intermediate_size=args.intermediate, num_local_experts=args.experts
        )
        model_class = tf.MixtralForCausalLM
    else:
        config = tf.Qwen3MoeConfig(
            **common,
            intermediate_size=args.intermediate,
            moe_intermediate_size=args.intermediate,
            num_experts=args.experts,
            norm_topk_prob=True,
            head_dim=args.hidden // args.heads,
        )
        model_class = tf.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    print(f"checkpoint: {args.arch}, {params / 1e6:.1f}M parameters in {path}")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=["qwen3_moe", "mixtral"], default="qwen3_moe")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256, help="each expert's")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.profile = False  # what LegatoDecode reads from decode_step's arguments
    torch.set_num_threads(args.threads)

    rows = []
    with tempfile.TemporaryDirectory() as path:
        hf_model = make_checkpoint(args, path)
        prompts = torch.randint(0, args.vocab, (max(args.batch_sizes), args.context))
        for dtype in args.dtypes:
            for batch in args.batch_sizes:
                ours = LegatoDecode(args, path, dtype, batch, prompts)
                theirs = TransformersDecode(hf_model, dtype, batch, prompts)
                ours_t, theirs_t = [], []
                for i in range(args.warmup + args.steps):
                    a, b = ours.step(), theirs.step()
                    if i >= args.warmup:
                        ours_t.append(a)
                        theirs_t.append(b)
                row = (dtype, batch, statistics.median(ours_t), statistics.median(theirs_t))
                rows.append(row)
                print("  " + _format(*row), flush=True)
    print(
        f"\nMoE decode, {args.arch}: {args.experts} experts of {args.intermediate}, top-{args.top_k}, "
        f"{args.context} tokens of context, {args.threads} threads, cpu "
        f"{torch.backends.cpu.get_cpu_capability()}; median of {args.steps} steps, interleaved"
    )
    print(f"{'dtype':<9} {'batch':>5} {'legato ms':>10} {'hf ms':>10} {'legato tok/s':>13} "
          f"{'hf tok/s':>10} {'speedup':>8}")  # fmt: skip
    for row in rows:
        print(_format(*row))


def _format(dtype: str, batch: int, ours: float, theirs: float) -> str:
    return (
        f"{dtype:<9} {batch:>5} {ours * 1e3:>10.2f} {theirs * 1e3:>10.2f} "
        f"{batch / ours:>13.0f} {batch / theirs:>10.0f} {theirs / ours:>7.2f}x"
    )


if __name__ == "__main__":
    main()
