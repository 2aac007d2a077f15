"""Milliseconds per decode step: legato's ModelRunner vs transformers with its own KV cache.

A random-weight Llama checkpoint (by default the 56M-parameter shape: hidden
512, intermediate 1408, 8 layers, 8 heads, 4 kv heads, vocab 32000, untied)
is written with transformers' ``save_pretrained`` into a temp dir. For each
dtype and batch size, every sequence gets a ``--context``-token prompt, then
``--steps`` greedy decode steps are timed (median):

- legato: ``ModelRunner.execute`` of a SchedulerOutput scheduling one token per
  request (metadata, forward on the paged cache, sampling, output message);
- transformers: ``model(next_tokens, past_key_values=DynamicCache)`` plus argmax.

Prints a table; never asserted in tests. Example::

    python benchmarks/decode_step.py --batch-sizes 1 16 64 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from legato.config import EngineConfig  # noqa: E402
from legato.models.runner import ModelRunner  # noqa: E402
from legato.protocol.messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from legato.protocol.params import SamplingParams  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_checkpoint(args: argparse.Namespace, path: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context + args.steps + args.warmup + 16,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    print(f"checkpoint: {params / 1e6:.1f}M parameters in {path}")
    return model


class LegatoDecode:
    """A runner holding ``batch`` prefilled requests; :meth:`step` runs one decode step."""

    def __init__(
        self, args: argparse.Namespace, path: str, dtype: str, batch: int, prompts: torch.Tensor
    ) -> None:
        bs = args.block_size
        total = args.context + args.warmup + args.steps + 1
        blocks_per_seq = -(-total // bs)
        self.runner = ModelRunner(
            EngineConfig(
                model=path,
                dtype=dtype,  # type: ignore[arg-type]
                device="cpu",
                block_size=bs,
                num_kv_blocks=blocks_per_seq * batch,
                max_num_seqs=batch,
                max_num_batched_tokens=max(2048, args.context),
            )
        )
        params = SamplingParams(temperature=0.0, max_tokens=None)
        new = [
            NewRequestData(
                f"r{i}",
                prompts[i].tolist(),
                params,
                list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                0,
            )
            for i in range(batch)
        ]
        self.step_id = 0
        self.last: dict[str, int] = {}
        group = max(1, 2048 // args.context)
        for start in range(0, batch, group):  # prefill, a few requests per step
            part = new[start : start + group]
            sched = {r.request_id: args.context for r in part}
            self._run(SchedulerOutput(self.step_id, part, [], sched, sum(sched.values())))
        self.computed = args.context

    def _run(self, step: SchedulerOutput) -> None:
        out = self.runner.execute(step)
        self.step_id += 1
        self.last.update({r: t[0] for r, t in zip(out.req_ids, out.sampled_token_ids)})

    def step(self) -> float:
        """Seconds for one decode step of every request."""
        # The runner appends its own samples: a decode step sends no tokens back.
        cached = [CachedRequestData(r, [], [], self.computed) for r in self.last]
        sched = dict.fromkeys(self.last, 1)
        step = SchedulerOutput(self.step_id, [], cached, sched, len(sched))
        began = time.perf_counter()
        self._run(step)
        elapsed = time.perf_counter() - began
        self.computed += 1
        return elapsed


class TransformersDecode:
    """transformers' forward with a DynamicCache after a prefill; greedy next tokens."""

    def __init__(self, model: Any, dtype: str, batch: int, prompts: torch.Tensor) -> None:
        from transformers import DynamicCache

        self.model = model.to(DTYPES[dtype])
        self.cache = DynamicCache()
        with torch.inference_mode():
            out = self.model(input_ids=prompts[:batch], past_key_values=self.cache, use_cache=True)
        self.tokens = out.logits[:, -1].float().argmax(-1, keepdim=True)

    def step(self) -> float:
        began = time.perf_counter()
        with torch.inference_mode():
            out = self.model(input_ids=self.tokens, past_key_values=self.cache, use_cache=True)
            self.tokens = out.logits[:, -1].float().argmax(-1, keepdim=True)
            self.tokens.tolist()
        return time.perf_counter() - began


def bench(
    args: argparse.Namespace, path: str, model: Any, dtype: str, batch: int, prompts: torch.Tensor
) -> tuple[list[float], list[float]]:
    """Per-step seconds for legato and transformers, their steps interleaved so that
    both see the same machine load."""
    ours = LegatoDecode(args, path, dtype, batch, prompts)
    theirs = None if args.skip_transformers else TransformersDecode(model, dtype, batch, prompts)
    ours_t: list[float] = []
    theirs_t: list[float] = []
    for i in range(args.warmup + args.steps):
        a = ours.step()
        b = theirs.step() if theirs is not None else float("nan")
        if i >= args.warmup:
            ours_t.append(a)
            theirs_t.append(b)
    return ours_t, theirs_t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=DTYPES)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as path:
        hf_model = make_checkpoint(args, path)
        prompts = torch.randint(0, args.vocab, (max(args.batch_sizes), args.context))
        rows = []
        for dtype in args.dtypes:
            for batch in args.batch_sizes:
                ours, theirs = bench(args, path, hf_model, dtype, batch, prompts)
                row = (
                    dtype,
                    batch,
                    statistics.median(ours) * 1e3,
                    min(ours) * 1e3,
                    statistics.median(theirs) * 1e3,
                    min(theirs) * 1e3,
                )
                rows.append(row)
                print("  " + _format(*row), flush=True)

    print(
        f"\nms per decode step, {args.context} tokens of context, {args.threads} threads; "
        f"median (min) of {args.steps} steps, legato and transformers interleaved"
    )
    print(
        f"{'dtype':<9} {'batch':>5} {'legato':>16} {'transformers':>16} {'speedup':>8} "
        f"{'legato tok/s':>12}"
    )
    for row in rows:
        print(_format(*row))


def _format(dtype: str, batch: int, ours: float, ours_min: float, hf: float, hf_min: float) -> str:
    return (
        f"{dtype:<9} {batch:>5} {ours:>8.2f} ({ours_min:>5.2f}) {hf:>8.2f} ({hf_min:>5.2f}) "
        f"{hf / ours:>7.2f}x {batch / ours * 1e3:>12.0f}"
    )


if __name__ == "__main__":
    main()
