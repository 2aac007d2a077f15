"""Milliseconds per decode step: legato's ModelRunner vs transformers with its own KV cache.

A random-weight Llama checkpoint (by default the 56M-parameter shape: hidden
512, intermediate 1408, 8 layers, 8 heads, 4 kv heads, vocab 32000, untied)
is written with transformers' ``save_pretrained`` into a temp dir. For each
dtype and batch size, every sequence gets a ``--context``-token prompt, then
``--steps`` greedy decode steps are timed (median):

- legato: ``ModelRunner.execute`` of a SchedulerOutput scheduling one token per
  request (metadata, forward on the paged cache, sampling, output message);
- transformers: ``model(next_tokens, past_key_values=DynamicCache)`` plus argmax.

Beside them, the ``floor``: the same step's weight matmuls alone (``F.linear``
over every layer's weights of the loaded model plus the LM head, at the same
batch, timed interleaved), the time no step can beat without a faster GEMM.
``--profile`` adds, per dtype and batch, where one legato step's time goes:
matmuls, attention (KV write included), norm+rope+activation, input
preparation (metadata and attention plan), sampling, and the rest of
``execute`` (overhead). The run ends with ``other_cpu_frac``: the share of the
machine other processes used meanwhile (figures above 0.1 are void).

``--sliding-window N`` makes the checkpoint a Mistral with that window on every
layer (both sides attend to the last N positions only).

Prints a table; never asserted in tests. Example::

    python benchmarks/decode_step.py --batch-sizes 1 16 64 --dtypes float32 bfloat16 --profile
    python benchmarks/decode_step.py --context 2048 --sliding-window 256 --batch-sizes 1 16
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from legato.config import EngineConfig  # noqa: E402
from legato.models import layers as legato_layers  # noqa: E402
from legato.models import runner as legato_runner  # noqa: E402
from legato.models.decode_stack import DecodeStack  # noqa: E402
from legato.models.input_batch import InputBatch  # noqa: E402
from legato.models.runner import ModelRunner  # noqa: E402
from legato.protocol.messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    RunnerSamplingParams,
    SchedulerOutput,
)
from legato.protocol.params import SamplingParams  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_checkpoint(args: argparse.Namespace, path: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    windowed = args.sliding_window is not None  # Mistral: the window on every layer
    config_class = MistralConfig if windowed else LlamaConfig
    extra = {"sliding_window": args.sliding_window} if windowed else {}
    config = config_class(
        **extra,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context + 2 * args.steps + args.warmup + 16,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = (MistralForCausalLM if windowed else LlamaForCausalLM)(config).eval()
    model.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    print(f"checkpoint: {params / 1e6:.1f}M parameters in {path}")
    return model


class LegatoDecode:
    """A runner holding ``batch`` prefilled requests; :meth:`step` runs one decode step."""

    def __init__(
        self,
        args: argparse.Namespace,
        path: str,
        dtype: str,
        batch: int,
        prompts: torch.Tensor,
        **engine_args: Any,
    ) -> None:
        bs = args.block_size
        total = args.context + args.warmup + args.steps * (2 if args.profile else 1) + 1
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
                **engine_args,
            )
        )
        params = SamplingParams(temperature=0.0, max_tokens=None)
        new = [
            NewRequestData(
                f"r{i}",
                prompts[i].tolist(),
                "greedy",
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
            step = SchedulerOutput(
                self.step_id,
                part,
                CachedRequestData(),
                sched,
                sum(sched.values()),
                sampling_params={"greedy": RunnerSamplingParams.of(params)},
            )
            self._run(step)
        self.computed = args.context

    def _run(self, step: SchedulerOutput) -> None:
        out = self.runner.execute(step)
        self.step_id += 1
        self.last.update({r: t[0] for r, t in zip(out.req_ids, out.sampled_lists()) if t})

    def step(self) -> float:
        """Seconds for one decode step of every request."""
        # The runner appends its own samples: a decode step sends no tokens back.
        cached = CachedRequestData(list(self.last), [self.computed] * len(self.last))
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


class LinearFloor:
    """The weight matmuls of one decode step of ``batch`` rows, alone: ``F.linear`` over
    weights of the shape of every weight matrix of the loaded model (the LM head
    included; the embedding table only where it is the tied head)."""

    def __init__(self, runner: ModelRunner, batch: int) -> None:
        tied = runner.model_config.tie_word_embeddings
        shapes = [
            shape
            for name, shape in runner._param_shapes.items()
            if len(shape) == 2 and (tied or not name.endswith("embed_tokens.weight"))
        ]
        gen = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(*s, generator=gen).mul_(0.02).to(runner.dtype) for s in shapes]
        self.inputs = {
            w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w in self.weights
        }

    def step(self) -> float:
        began = time.perf_counter()
        with torch.inference_mode():
            for w in self.weights:
                F.linear(self.inputs[w.shape[1]], w)
        return time.perf_counter() - began


@contextlib.contextmanager
def profiled(runner: ModelRunner) -> Iterator[dict[str, float]]:
    """Accumulate seconds per category while legato steps run inside the block.

    Wraps the model's hot-path entry points with timers (the runner runs
    synchronously on the CPU, so wall time per call is the cost of the call).
    """
    totals: dict[str, float] = defaultdict(float)
    undo: list[Callable[[], None]] = []

    def timed(category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            began = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[category] += time.perf_counter() - began

        return wrapper

    def patch(owner: Any, name: str, category: str) -> None:
        """Wrap ``owner.name`` (a class, module or instance attribute) until the block ends."""
        had_own = name in vars(owner)
        original = vars(owner).get(name)
        setattr(owner, name, timed(category, getattr(owner, name)))
        if had_own:
            undo.append(lambda: setattr(owner, name, original))
        else:  # an instance's method, found on its class
            undo.append(lambda: delattr(owner, name))

    backend = runner.model.backend
    patch(legato_layers.Linear, "forward", "matmuls")
    patch(legato_layers.Embedding, "forward", "norm+rope+act")
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul"):
        patch(backend, name, "norm+rope+act")
    original_begin = backend.begin_step

    def begin_step(*a: Any, **kw: Any) -> Any:
        began = time.perf_counter()
        ctx = original_begin(*a, **kw)
        totals["input prep"] += time.perf_counter() - began
        ctx.rotary = timed("norm+rope+act", ctx.rotary)
        ctx.attention = timed("attention", ctx.attention)
        return ctx

    backend.begin_step = begin_step
    undo.append(lambda: delattr(backend, "begin_step"))
    patch(DecodeStack, "run", "native stack")
    patch(legato_runner, "build_metadata", "input prep")
    patch(legato_runner, "sample", "sampling")
    patch(InputBatch, "sampling_metadata", "sampling")
    try:
        yield totals
    finally:
        for fn in reversed(undo):
            fn()


CATEGORIES = (
    "matmuls",
    "attention",
    "norm+rope+act",
    "native stack",  # legato.models.decode_stack: a decode step's layers in one native call
    "input prep",
    "sampling",
    "overhead",
)


def bench(
    args: argparse.Namespace, path: str, model: Any, dtype: str, batch: int, prompts: torch.Tensor
) -> tuple[list[float], list[float], list[float], dict[str, float] | None]:
    """Per-step seconds for legato, transformers and the matmul floor, their steps
    interleaved so that all see the same machine load; then, with ``--profile``,
    legato's seconds per step by category."""
    ours = LegatoDecode(args, path, dtype, batch, prompts)
    theirs = None if args.skip_transformers else TransformersDecode(model, dtype, batch, prompts)
    floor = LinearFloor(ours.runner, batch)
    ours_t: list[float] = []
    theirs_t: list[float] = []
    floor_t: list[float] = []
    for i in range(args.warmup + args.steps):
        a = ours.step()
        b = theirs.step() if theirs is not None else float("nan")
        c = floor.step()
        if i >= args.warmup:
            ours_t.append(a)
            theirs_t.append(b)
            floor_t.append(c)
    profile = None
    if args.profile:
        total = 0.0
        with profiled(ours.runner) as totals:
            for _ in range(args.steps):
                total += ours.step()
        profile = {k: v / args.steps for k, v in totals.items()}
        profile["overhead"] = total / args.steps - sum(profile.values())
    return ours_t, theirs_t, floor_t, profile


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
    parser.add_argument("--profile", action="store_true", help="legato's step by category")
    parser.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="a Mistral checkpoint with this window on every layer (default: Llama, none)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    busy0, own0, wall0 = _machine_cpu(), time.process_time(), time.perf_counter()
    with tempfile.TemporaryDirectory() as path:
        hf_model = make_checkpoint(args, path)
        prompts = torch.randint(0, args.vocab, (max(args.batch_sizes), args.context))
        rows = []
        profiles = []
        for dtype in args.dtypes:
            for batch in args.batch_sizes:
                ours, theirs, floor, profile = bench(args, path, hf_model, dtype, batch, prompts)
                row = (
                    dtype,
                    batch,
                    statistics.median(ours) * 1e3,
                    min(ours) * 1e3,
                    statistics.median(theirs) * 1e3,
                    min(theirs) * 1e3,
                    statistics.median(floor) * 1e3,
                )
                rows.append(row)
                if profile is not None:
                    profiles.append((dtype, batch, profile))
                print("  " + _format(*row), flush=True)
    wall = time.perf_counter() - wall0
    other = ((_machine_cpu() - busy0) - (time.process_time() - own0)) / (
        (os.cpu_count() or 1) * wall
    )

    print(
        f"\nms per decode step, {args.context} tokens of context, {args.threads} threads, "
        f"cpu {torch.backends.cpu.get_cpu_capability()}; median (min) of {args.steps} steps, "
        "legato, transformers and the F.linear floor interleaved"
    )
    print(
        f"{'dtype':<9} {'batch':>5} {'legato':>16} {'transformers':>16} {'speedup':>8} "
        f"{'legato tok/s':>12} {'floor':>8} {'legato/floor':>12}"
    )
    for row in rows:
        print(_format(*row))
    if profiles:
        print("\nms per legato decode step by category (mean of the profiled steps)")
        print(f"{'dtype':<9} {'batch':>5} " + " ".join(f"{c:>13}" for c in CATEGORIES))
        for dtype, batch, profile in profiles:
            cells = " ".join(f"{profile.get(c, 0.0) * 1e3:>13.2f}" for c in CATEGORIES)
            print(f"{dtype:<9} {batch:>5} {cells}")
    print(f"\nother_cpu_frac {max(0.0, other):.3f} (above 0.1: the machine was busy, rerun)")


def _machine_cpu() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def _format(
    dtype: str, batch: int, ours: float, ours_min: float, hf: float, hf_min: float, floor: float
) -> str:
    return (
        f"{dtype:<9} {batch:>5} {ours:>8.2f} ({ours_min:>5.2f}) {hf:>8.2f} ({hf_min:>5.2f}) "
        f"{hf / ours:>7.2f}x {batch / ours * 1e3:>12.0f} {floor:>8.2f} {ours / floor:>11.2f}x"
    )


if __name__ == "__main__":
    main()
