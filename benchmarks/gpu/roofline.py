"""Roofline benchmark of the GPU path: device rates, kernels, decode steps, end to end.

One run prints one table per section, then one summary table of them all,
headed by the device name and the torch and Triton versions (``--json PATH``
also writes every table). ``measure_device`` measures what the floors are
computed from (device-to-device copy bandwidth counting bytes read and
written, dense bf16 matmul rate); every later section is a function
``(args, rates, device, dtype) -> Table`` listed in ``SECTIONS``:

- ``tune`` (not in the default run): decode attention GB/s for each launch
  shape of ``TUNE_CANDIDATES`` (tile, warps, pipeline stages, split target)
  over ``TUNE_CASES``; the first candidate is the shipped default.
- ``attention``: decode paged attention alone, against the KV bytes it reads.
  On CUDA the L2 cache is flushed before every timed call, calls are CUDA-graph
  replays (``--no-cuda-graph``: eager launches, which at small sizes time
  Python's launch overhead) and times are CUDA-event medians.
- ``decode``: one engine decode step (``ModelRunner.execute``: metadata, the
  forward, the LM head, greedy sampling, the output message) of a
  Llama-3-8B-shaped model with random weights built on the device (no
  checkpoint on disk), per batch and context, with the runner's decode CUDA
  graphs and eagerly. Its floor is the larger of the memory floor (weights
  read per step, i.e. all but the embedding table, plus the KV of every
  sequence, over the copy bandwidth) and the compute floor (2 FLOP per weight
  per token plus attention, over the matmul rate); "roofline" is floor /
  measured and "HBM GB/s" those bytes over the step time. "fwd GPU ms" is
  one replay of the decode graph alone, CUDA-event timed, against the same
  floor without the LM head: the kernels' share, free of host time. A line
  per case gives the host time of ``graphs.run`` and of ``replay()``.
  ``--profile B C ...`` prints the kernels of three eager steps of those
  cases. Configurations whose KV does not fit beside the weights are skipped.
- ``e2e``: nano-vllm's published workload (256 requests, prompt and output
  lengths uniform in 100..1024, token ids below 10000, seed 0, temperature
  0.6, ignore_eos) on a Qwen3-0.6B-shaped random model, through
  ``legato.llm.LLMEngine`` stepped in-process (``--e2e-detokenize on off``:
  with and without detokenizing, nano-vllm's own benchmark does not), and
  through transformers' ``generate`` on the same shapes and device in static
  batches (requests sorted by output length, left-padded; each batch runs to
  its longest output), best batch size reported; against the workload's
  roofline bound (:func:`workload_floor`). Throughput is requested output
  tokens per second of wall time, prefill included; both engines are warmed
  up first (legato: 1 then 17 short requests, so the Triton kernels compile
  untimed). Each legato run prints the seconds spent in each phase of its
  steps; ``--e2e-profile FIRST N`` prints the kernels of N steps and how busy
  the GPU was. vLLM is listed as not run: it cannot be installed on the GPU
  machines this was written for (no package index there, the wheel is too
  large to carry).

Usage::

    python benchmarks/gpu/roofline.py                      # full sizes on cuda
    python benchmarks/gpu/roofline.py --device cpu --tiny  # interpreter smoke run
    python benchmarks/gpu/roofline.py --sections decode --batches 1 64
    python benchmarks/gpu/roofline.py --sections tune      # launch shapes

``benchmarks/gpu/on_device.sh`` wraps a whole run on a lent GPU machine.
On CPU the Triton kernels run under ``TRITON_INTERPRET=1`` and the decode
"graphs" are emulated (the same static buffers and padding, replayed
eagerly): the figures then say nothing about GPU performance, the run only
exercises the code paths.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from legato.models.runner import ModelRunner

_L2_FLUSH_BYTES = 256 * 1024 * 1024
_GIB = 1 << 30
_CUDA_MARGIN_BYTES = 4 * _GIB  # activations, logits, graph pool, allocator slack

# Llama-3-8B's config.json figures (random weights stand in for the checkpoint).
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
# Qwen3-0.6B's, for the end-to-end run.
QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
# --tiny: the same architectures at toy sizes (head_dim 16, the Triton minimum).
_TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
}


@dataclass(frozen=True)
class DeviceRates:
    """Measured peak rates the floors are computed from."""

    copy_bytes_per_s: float
    matmul_flop_per_s: float


@dataclass(frozen=True)
class Table:
    """One section's detail table, plus its rows for the summary table.

    Summary rows are ``(section, case, measured, floor or reference, fraction)``.
    """

    title: str
    header: tuple[str, ...]
    rows: list[tuple[str, ...]]
    summary: list[tuple[str, str, str, str, str]] = field(default_factory=list)


SUMMARY_HEADER = ("section", "case", "measured", "floor / reference", "% floor / ratio")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--tiny", action="store_true", help="small sizes for a CPU/interpreter run")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--copy-mib", type=int, default=1024, help="bytes copied to measure bandwidth")
    p.add_argument("--matmul-size", type=int, default=8192, help="n of the n*n*n matmul")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time attention as CUDA-graph replays, as the model runs it (CUDA; default on): "
        "eager timings of one small launch measure Python launch overhead",
    )
    p.add_argument(
        "--sections",
        nargs="+",
        choices=[name for name, _ in SECTIONS],
        default=["attention", "decode", "e2e"],
        help="which sections run after the device rates (tune: decode-attention launch shapes)",
    )
    p.add_argument("--decode-steps", type=int, default=10, help="timed decode steps per case")
    p.add_argument("--decode-warmup", type=int, default=3)
    p.add_argument(
        "--profile",
        type=int,
        nargs="+",
        default=[],
        metavar="BATCH CONTEXT",
        help="pairs: print the kernels of a few eager decode steps of these cases (CUDA)",
    )
    p.add_argument(
        "--e2e-profile",
        type=int,
        nargs=2,
        metavar=("FIRST_STEP", "STEPS"),
        help="print the kernels of these steps of the first e2e legato run (CUDA)",
    )
    p.add_argument("--json", help="also write every table to this JSON file")
    p.add_argument("--num-requests", type=int, default=256, help="e2e requests")
    p.add_argument("--min-len", type=int, default=100, help="e2e shortest prompt and output")
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256, help="e2e engine max_num_seqs")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[64, 128])
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--e2e-detokenize",
        type=lambda v: v == "on",
        nargs="+",
        default=[True],
        metavar="on|off",
        help="legato runs: detokenize outputs (on, the default) or not (off: as nano-vllm)",
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.batches, args.contexts = [1, 3, 5], [40, 100]  # 3 pads to the graph of 4
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.copy_mib, args.matmul_size, args.warmup, args.iters = 8, 128, 1, 3
        args.decode_steps, args.decode_warmup = 3, 1
        args.num_requests, args.min_len, args.max_input_len, args.max_output_len = 6, 8, 40, 20
        args.max_num_seqs, args.max_num_batched_tokens = 4, 64
        args.hf_batch_sizes = [2, 6]
    return args


def _resolve_device(name: str) -> str:
    """The device to run on; a CPU run switches the Triton interpreter on (before triton loads)."""
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return device


def time_call(fn: Callable[[], object], device: str, warmup: int, iters: int) -> float:
    """Median seconds per call of ``fn``; on CUDA event-timed with L2 flushed before each call."""
    import torch

    for _ in range(warmup):
        fn()
    if device != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]  # type: ignore[no-untyped-call]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    for start_event, end_event in zip(starts, ends):
        flush.zero_()
        start_event.record()
        fn()
        end_event.record()
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))) / 1e3


def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once into a CUDA graph; the returned callable replays it."""
    import torch

    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm the allocator outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure_device(args: argparse.Namespace, device: str) -> DeviceRates:
    """Device-to-device copy bandwidth (read + write bytes) and dense matmul FLOP/s."""
    import torch

    nbytes = args.copy_mib * 1024 * 1024
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    copy_s = time_call(lambda: dst.copy_(src), device, args.warmup, args.iters)
    n = args.matmul_size
    mm_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=mm_dtype)
    b = torch.randn(n, n, device=device, dtype=mm_dtype)
    mm_s = time_call(lambda: a @ b, device, args.warmup, args.iters)
    return DeviceRates(copy_bytes_per_s=2 * nbytes / copy_s, matmul_flop_per_s=2 * n**3 / mm_s)


def device_section(args: argparse.Namespace, rates: DeviceRates, device: str) -> Table:
    mm = "bf16" if device == "cuda" else "fp32"
    return Table(
        title=f"device rates ({device})",
        header=("measure", "value"),
        rows=[
            (
                f"copy bandwidth ({args.copy_mib} MiB d2d)",
                f"{rates.copy_bytes_per_s / 1e9:.1f} GB/s",
            ),
            (
                f"{mm} matmul {args.matmul_size}^3",
                f"{rates.matmul_flop_per_s / 1e12:.3g} TFLOP/s",
            ),
        ],
        summary=[
            ("device", "copy bandwidth", f"{rates.copy_bytes_per_s / 1e9:.1f} GB/s", "", ""),
            (
                "device",
                f"{mm} matmul",
                f"{rates.matmul_flop_per_s / 1e12:.3g} TFLOP/s",
                "",
                "",
            ),
        ],
    )


def _decode_inputs(
    args: argparse.Namespace, batch: int, context: int, dtype: torch.dtype, device: str
) -> tuple[tuple[torch.Tensor, ...], float]:
    """A decode batch of ``batch`` sequences of ``context`` tokens, blocks shuffled over the pool."""
    import torch

    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    key_cache = torch.randn(shape, device=device, dtype=dtype)
    value_cache = torch.randn(shape, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = perm.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    query = torch.randn(batch, args.num_heads, args.head_dim, device=device, dtype=dtype)
    inputs = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    return inputs, args.head_dim**-0.5


def _check_against_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Fail loudly unless ``||out - ref|| / ||ref||`` is within bf16 rounding (METHOD.md)."""
    import torch

    err = float(torch.linalg.vector_norm(out.float() - ref.float()).item())
    rel = err / float(torch.linalg.vector_norm(ref.float()).item())
    print(f"decode attention check: ||triton - reference|| / ||reference|| = {rel:.2e}")
    if not rel < 2e-2:  # NaN fails too
        raise RuntimeError(f"decode attention disagrees with the reference (relative {rel:.2e})")


def attention_decode_section(
    args: argparse.Namespace, rates: DeviceRates, device: str, dtype: torch.dtype
) -> Table:
    """Decode paged attention (``max_query_len=1``) per (batch, context) against the KV-read floor."""
    from legato.kernels import attention, reference

    rows: list[tuple[str, ...]] = []
    summary: list[tuple[str, str, str, str, str]] = []
    checked = False
    for context in args.contexts:
        for batch in args.batches:
            inputs, scale = _decode_inputs(args, batch, context, dtype, device)

            run = functools.partial(
                attention.paged_attention, *inputs, scale, max_query_len=1, max_seq_len=context
            )

            if not checked:  # one correctness check on the smallest shape before timing
                _check_against_reference(run(), reference.paged_attention(*inputs, scale))
                checked = True
            fn = _graphed(run) if args.cuda_graph and device == "cuda" else run
            seconds = time_call(fn, device, args.warmup, args.iters)
            kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * dtype.itemsize
            floor = kv_bytes / rates.copy_bytes_per_s
            rows.append(
                (
                    str(batch),
                    str(context),
                    f"{kv_bytes / 2**20:.1f}",
                    f"{seconds * 1e6:.1f}",
                    f"{floor * 1e6:.1f}",
                    f"{100 * floor / seconds:.0f}%",
                    f"{kv_bytes / seconds / 1e9:.1f}",
                )
            )
            summary.append(
                (
                    "decode attention",
                    f"batch {batch} ctx {context}",
                    f"{seconds * 1e6:.1f} us",
                    f"{floor * 1e6:.1f} us",
                    f"{100 * floor / seconds:.0f}%",
                )
            )
            del inputs
    shape = (
        f"H={args.num_heads} Hkv={args.num_kv_heads} D={args.head_dim} "
        f"block={args.block_size} {str(dtype).removeprefix('torch.')}"
        + (" cuda-graph" if args.cuda_graph and device == "cuda" else "")
    )
    return Table(
        title=f"decode paged attention ({shape})",
        header=("batch", "context", "KV MiB", "time us", "floor us", "roofline", "GB/s"),
        rows=rows,
        summary=summary,
    )


# Launch shapes --tune compares for the decode kernel: (block_n, num_warps, num_stages,
# programs_per_sm); the first is the shipped default.
TUNE_CANDIDATES: tuple[tuple[int, int, int, int], ...] = (
    (64, 4, 2, 2),
    (64, 4, 3, 2),
    (64, 8, 3, 2),
    (128, 4, 2, 2),
    (128, 8, 2, 2),
    (128, 8, 3, 2),
    (32, 4, 3, 2),
    (32, 4, 4, 4),
    (64, 4, 3, 4),
    (128, 8, 3, 4),
)
TUNE_CASES: tuple[tuple[int, int], ...] = (
    (1, 2048),
    (64, 512),
    (64, 2048),
    (256, 512),
    (256, 2048),
)


def attention_tune_section(
    args: argparse.Namespace, rates: DeviceRates, device: str, dtype: torch.dtype
) -> Table:
    """Decode attention GB/s (KV bytes over time) for each of ``TUNE_CANDIDATES`` per case."""
    from legato.kernels import attention, reference

    tiny = args.tiny
    cases = ((1, 100), (5, 40)) if tiny else TUNE_CASES
    candidates = [attention.DecodeTiles(*c) for c in TUNE_CANDIDATES]
    if tiny:
        candidates = candidates[:2]
    rates_by: dict[tuple[int, int], list[float]] = {}
    for batch, context in cases:
        inputs, scale = _decode_inputs(args, batch, context, dtype, device)
        ref = reference.paged_attention(*inputs, scale) if batch * context <= 64 * 512 else None
        kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * dtype.itemsize
        for tiles in candidates:
            run = functools.partial(
                attention.paged_attention_decode, *inputs, scale, max_seq_len=context, tiles=tiles
            )
            if ref is not None:
                _check_against_reference(run(), ref)
            fn = _graphed(run) if args.cuda_graph and device == "cuda" else run
            seconds = time_call(fn, device, args.warmup, args.iters)
            rates_by.setdefault((batch, context), []).append(kv_bytes / seconds)
        del inputs, ref
    rows = []
    for i, tiles in enumerate(candidates):
        cells = [f"{rates_by[case][i] / 1e9:.0f}" for case in rates_by]
        name = f"n{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages} p{tiles.programs_per_sm}"
        rows.append((name + (" (default)" if i == 0 else ""), *cells))
    summary = []
    for case, values in rates_by.items():
        best = max(range(len(values)), key=values.__getitem__)
        t = candidates[best]
        summary.append(
            (
                "attention tune",
                f"batch {case[0]} ctx {case[1]}",
                f"best n{t.block_n} w{t.num_warps} s{t.num_stages} p{t.programs_per_sm}: "
                f"{values[best] / 1e9:.0f} GB/s",
                f"default {values[0] / 1e9:.0f} GB/s",
                f"{100 * values[best] / rates.copy_bytes_per_s:.0f}% of copy",
            )
        )
    return Table(
        title=(
            f"decode attention tuning: KV GB/s per launch shape "
            f"({str(dtype).removeprefix('torch.')}"
            + (", cuda-graph replays" if args.cuda_graph and device == "cuda" else "")
            + ")"
        ),
        header=("tiles", *(f"b{b} c{c}" for b, c in rates_by)),
        rows=rows,
        summary=summary,
    )


# ------------------------------------------------------------ model shapes


def _shape(base: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``base`` (a config.json dict), shrunk to toy sizes under ``--tiny``."""
    return {**base, **_TINY_SHAPE} if args.tiny else dict(base)


def _param_count(shape: dict[str, Any]) -> tuple[int, int]:
    """``(all parameters, embedding-table parameters)`` of a Llama-family config."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    embed = shape["vocab_size"] * hidden
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    if shape["model_type"] == "qwen3":
        per_layer += 2 * shape["head_dim"]
    head = 0 if shape["tie_word_embeddings"] else embed
    return embed + head + shape["num_hidden_layers"] * per_layer + hidden, embed


def _kv_bytes_per_token(shape: dict[str, Any], dtype: torch.dtype) -> int:
    return int(
        2
        * shape["num_hidden_layers"]
        * shape["num_key_value_heads"]
        * shape["head_dim"]
        * dtype.itemsize
    )


def _free_memory(device: str) -> int:
    import torch

    gc.collect()
    if device != "cuda":
        return 1 << 62
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])


# ----------------------------------------------------------- decode step


def _decode_steps(args: argparse.Namespace) -> int:
    """Steps one case runs: warm-up and timed steps, with graphs and then eagerly."""
    return 2 * int(args.decode_warmup + args.decode_steps)


def _blocks_per_seq(args: argparse.Namespace, context: int) -> int:
    """KV blocks one request of a case needs: its context plus every step's token."""
    return -(-(context + _decode_steps(args) + 1) // int(args.block_size))


class DecodeCase:
    """``batch`` requests held by ``runner`` with ``context`` tokens of context; :meth:`step`
    runs one decode step of all of them.

    Requests are admitted as if their prompt were cached (``num_computed_tokens
    = context - 1``): no prefill runs, the KV cache holds whatever it held, which
    changes nothing the step reads or writes.
    """

    def __init__(
        self, runner: ModelRunner, batch: int, context: int, max_steps: int, per_seq: int
    ) -> None:
        from legato.protocol.messages import NewRequestData
        from legato.protocol.params import SamplingParams

        self.runner = runner
        self.batch, self.context = batch, context
        rng = random.Random(batch * 100003 + context)
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_steps + 1)
        self.new = [
            NewRequestData(
                f"b{batch}c{context}r{i}",
                [rng.randrange(runner.vocab_size) for _ in range(context)],
                "greedy",
                list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)),  # block 0 is the null block
                context - 1,
            )
            for i in range(batch)
        ]
        self.params = params
        self.ids = [r.request_id for r in self.new]
        self.computed = context - 1
        self.last: dict[str, int] = {}
        self.step_id = 0

    def step(self) -> float:
        """Seconds for one decode step of every request (the runner syncs when it samples)."""
        from legato.protocol.messages import (
            CachedRequestData,
            RunnerSamplingParams,
            SchedulerOutput,
        )

        cached = CachedRequestData(
            list(self.last),
            [self.computed] * len(self.last),
            new_token_ids={r: [t] for r, t in self.last.items()},
        )
        scheduled = dict.fromkeys(self.ids, 1)
        table = {"greedy": RunnerSamplingParams.of(self.params)} if self.new else {}
        plan = SchedulerOutput(
            self.step_id, self.new, cached, scheduled, len(scheduled), sampling_params=table
        )
        began = time.perf_counter()
        out = self.runner.execute(plan)
        elapsed = time.perf_counter() - began
        self.new = []
        self.step_id += 1
        self.computed += 1
        self.last = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
        return elapsed

    def finish(self) -> None:
        from legato.protocol.messages import (
            CachedRequestData,
            SchedulerOutput,
        )

        done = SchedulerOutput(
            self.step_id, [], CachedRequestData(), {}, 0, finished_req_ids=self.ids
        )
        self.runner.execute(done)


def _profiled(step: Callable[[], object], steps: int, label: str, device: str) -> None:
    """Run ``step`` ``steps`` times under the profiler; print the CUDA kernels, most time
    first, and how busy the GPU was (kernel time over wall time)."""
    if device != "cuda":
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6
    print(
        f"profile of {label}: {wall * 1e3 / steps:.2f} ms/step wall, "
        f"{busy * 1e3 / steps:.2f} ms/step of kernels (GPU busy {100 * busy / wall:.0f}%)"
    )
    print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))


def _replay_seconds(runner: ModelRunner, batch: int, iters: int = 20) -> tuple[float, float] | None:
    """``(GPU seconds, host seconds of the replay() call)`` of one replay of the decode
    graph a batch of ``batch`` uses (CUDA), on the inputs its last step staged (rewriting
    the same K/V); None without a CUDA graph."""
    import torch

    graphs = runner.decode_graphs
    graph = graphs.graph(batch) if graphs is not None else None
    if graph is None:
        return None
    graph.replay()
    torch.cuda.synchronize()
    launch = []
    for _ in range(iters):  # host cost of a launch onto an idle GPU, as in an engine step
        began = time.perf_counter()
        graph.replay()
        launch.append(time.perf_counter() - began)
        torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / iters, statistics.median(launch)


def _build_decode_runner(
    args: argparse.Namespace, shape: dict[str, Any], path: str, device: str, dtype: torch.dtype
) -> tuple[ModelRunner, int]:
    """A runner on the random model at ``path`` with room for the largest case that fits;
    returns it and its usable KV blocks."""
    from legato.config import EngineConfig
    from legato.models.runner import ModelRunner

    need = max(b * _blocks_per_seq(args, c) for b in args.batches for c in args.contexts)
    params, _ = _param_count(shape)
    block_bytes = _kv_bytes_per_token(shape, dtype) * args.block_size
    budget = _free_memory(device) * 0.9 - params * dtype.itemsize - _CUDA_MARGIN_BYTES
    blocks = int(min(need, budget // block_bytes)) if device == "cuda" else need
    if blocks < 1:
        raise RuntimeError("the model's weights leave no room for a KV cache")
    config = EngineConfig(
        model=path,
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=max(args.contexts) + _decode_steps(args) + 1,
        num_kv_blocks=blocks + 1,
        max_num_seqs=max(args.batches),
        attention_backend="triton",
    )
    runner = ModelRunner(config)  # captures the decode graphs on CUDA
    if runner.decode_graphs is None:  # CPU: the same static buffers, replayed eagerly
        runner.capture_decode_graphs(mode="emulate")
    return runner, blocks


def model_decode_section(
    args: argparse.Namespace, rates: DeviceRates, device: str, dtype: torch.dtype
) -> Table:
    """One engine decode step of a Llama-3-8B-shaped model, with and without decode graphs."""
    from legato.models.loader import write_random_model_dir

    shape = _shape(LLAMA3_8B, args)
    params, embed = _param_count(shape)
    itemsize = dtype.itemsize
    kv_per_token = _kv_bytes_per_token(shape, dtype)
    attn_flop_per_token = 4 * shape["num_hidden_layers"] * shape["num_attention_heads"]
    attn_flop_per_token *= shape["head_dim"]
    # Per step every weight but the embedding table is read once (tied: the head is it).
    streamed = params - (0 if shape["tie_word_embeddings"] else embed)
    head = shape["vocab_size"] * shape["hidden_size"]  # LM head weights (tied or not)
    rows: list[tuple[str, ...]] = []
    summary: list[tuple[str, str, str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_random_model_dir(tmp, shape, seed=0))
        began = time.perf_counter()
        runner, blocks = _build_decode_runner(args, shape, path, device, dtype)
        graphs = runner.decode_graphs
        assert graphs is not None
        print(
            f"decode model: {params / 1e9:.2f}B parameters, {blocks} KV blocks, "
            f"graphs ({graphs.mode}) for batch sizes {graphs.sizes[0]}..{graphs.sizes[-1]}, "
            f"ready in {time.perf_counter() - began:.1f} s",
            flush=True,
        )
        for context in args.contexts:
            for batch in args.batches:
                per_seq = _blocks_per_seq(args, context)
                if batch * per_seq > blocks:
                    gib = batch * per_seq * args.block_size * kv_per_token / _GIB
                    rows.append(
                        (str(batch), str(context), "skipped", f"KV {gib:.1f} GiB", *("",) * 7)
                    )
                    summary.append(
                        ("decode step", f"batch {batch} ctx {context}", "skipped", "", "")
                    )
                    continue
                case = DecodeCase(runner, batch, context, _decode_steps(args), per_seq)
                timed: dict[str, float] = {}
                host: dict[str, float] = {}
                for mode in ("graph", "eager"):
                    runner.decode_graphs = graphs if mode == "graph" else None
                    before = sum(graphs.replays.values())
                    if mode == "graph":
                        host = _timed_methods([(graphs, "run")])
                    times = [case.step() for _ in range(args.decode_warmup + args.decode_steps)]
                    if mode == "graph":
                        del graphs.run  # the instance attribute the timer set
                        if sum(graphs.replays.values()) == before:
                            raise RuntimeError(f"batch {batch}: no decode graph was replayed")
                    timed[mode] = statistics.median(times[args.decode_warmup :])
                runner.decode_graphs = graphs
                replay, launch = _replay_seconds(runner, batch) or (None, None)
                if replay is not None and launch is not None:
                    steps = args.decode_warmup + args.decode_steps
                    print(
                        f"batch {batch} ctx {context}: graph step {timed['graph'] * 1e3:.2f} ms, "
                        f"replay on the GPU {replay * 1e3:.2f} ms, graphs.run on the host "
                        f"{host.get('run', 0.0) / steps * 1e3:.3f} ms of which replay() "
                        f"{launch * 1e3:.3f} ms",
                        flush=True,
                    )
                pairs = list(zip(args.profile[::2], args.profile[1::2]))
                if (batch, context) in pairs:
                    runner.decode_graphs = None
                    _profiled(
                        case.step, 3, f"eager decode steps, batch {batch} ctx {context}", device
                    )
                runner.decode_graphs = graphs
                case.finish()
                seq_len = context + args.decode_warmup + args.decode_steps  # mid-run average
                moved = streamed * itemsize + batch * shape["hidden_size"] * itemsize
                moved += batch * seq_len * kv_per_token
                mem_floor = moved / rates.copy_bytes_per_s
                flops = 2 * batch * streamed + batch * seq_len * attn_flop_per_token
                flop_floor = flops / rates.matmul_flop_per_s
                floor = max(mem_floor, flop_floor)
                # The graphs hold the forward alone: no LM head (logits are computed after).
                fwd_floor = max(
                    (moved - head * itemsize) / rates.copy_bytes_per_s,
                    (flops - 2 * batch * head) / rates.matmul_flop_per_s,
                )
                for mode, seconds in timed.items():
                    label = f"{mode} ({graphs.mode})" if mode == "graph" else mode
                    fwd = replay if mode == "graph" else None
                    rows.append(
                        (
                            str(batch),
                            str(context),
                            label,
                            f"{seconds * 1e3:.2f}",
                            f"{mem_floor * 1e3:.2f}",
                            f"{flop_floor * 1e3:.2f}",
                            f"{100 * floor / seconds:.0f}%",
                            f"{moved / seconds / 1e9:.0f}",
                            f"{batch / seconds:.0f}",
                            f"{fwd * 1e3:.2f}" if fwd else "-",
                            f"{100 * fwd_floor / fwd:.0f}%" if fwd else "-",
                        )
                    )
                    if fwd:
                        summary.append(
                            (
                                "decode forward",
                                f"batch {batch} ctx {context} graph replay (GPU)",
                                f"{fwd * 1e3:.2f} ms",
                                f"{fwd_floor * 1e3:.2f} ms",
                                f"{100 * fwd_floor / fwd:.0f}%",
                            )
                        )
                    summary.append(
                        (
                            "decode step",
                            f"batch {batch} ctx {context} {label}",
                            f"{seconds * 1e3:.2f} ms",
                            f"{floor * 1e3:.2f} ms",
                            f"{100 * floor / seconds:.0f}%",
                        )
                    )
        del runner, graphs
    name = "Llama-3-8B" if not args.tiny else "tiny Llama-3"
    return Table(
        title=(
            f"decode step, {name}-shaped random model, {str(dtype).removeprefix('torch.')}, "
            f"median of {args.decode_steps} steps"
        ),
        header=(
            "batch",
            "context",
            "mode",
            "ms/step",
            "mem floor",
            "flop floor",
            "roofline",
            "HBM GB/s",
            "tok/s",
            "fwd GPU ms",
            "fwd roofline",
        ),
        rows=rows,
        summary=summary,
    )


# ------------------------------------------------------------ end to end


def nano_vllm_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py: prompts of ``randint(min, max_input)`` ids below 10000 (or the
    vocabulary), then output lengths ``randint(min, max_output)``, from ``random.seed(0)``."""
    rng = random.Random(0)
    top = min(10000, vocab - 1)
    prompts = [
        [rng.randint(0, top) for _ in range(rng.randint(args.min_len, args.max_input_len))]
        for _ in range(args.num_requests)
    ]
    outputs = [rng.randint(args.min_len, args.max_output_len) for _ in range(args.num_requests)]
    return prompts, outputs


def workload_floor(
    shape: dict[str, Any],
    prompts: list[list[int]],
    outputs: list[int],
    rates: DeviceRates,
    dtype: torch.dtype,
) -> tuple[float, float, float]:
    """``(total, decode, prefill)`` seconds: the roofline bound of the workload.

    Whatever the schedule, each request needs ``output - 1`` decode steps after
    its prefill, so there are at least ``max(outputs) - 1`` steps, and a step
    reads every streamed weight once plus the KV of every request still
    decoding. The bound runs all requests together (the engine's best case):
    per step the larger of (bytes / copy bandwidth, FLOPs / matmul rate);
    prefill adds its FLOPs (2 per weight per token plus causal attention) over
    the matmul rate.
    """
    params, embed = _param_count(shape)
    streamed = params - (0 if shape["tie_word_embeddings"] else embed)
    kv_per_token = _kv_bytes_per_token(shape, dtype)
    attn = 4 * shape["num_hidden_layers"] * shape["num_attention_heads"] * shape["head_dim"]
    lens = [len(p) for p in prompts]
    prefill = sum(2 * streamed * n + attn * n * n / 2 for n in lens) / rates.matmul_flop_per_s
    decode = 0.0
    for t in range(1, max(outputs)):
        active = [n for n, out in zip(lens, outputs, strict=True) if out - 1 >= t]
        context = sum(active) + t * len(active)
        moved = streamed * dtype.itemsize + context * kv_per_token
        flops = 2 * streamed * len(active) + attn * context
        decode += max(moved / rates.copy_bytes_per_s, flops / rates.matmul_flop_per_s)
    return prefill + decode, decode, prefill


def _timed_methods(targets: list[tuple[Any, str]]) -> dict[str, float]:
    """Wrap each ``(object, method name)`` so that its wall time adds up under that name."""
    spent: dict[str, float] = {}
    for obj, name in targets:
        inner = getattr(obj, name)

        def timed(*a: Any, _inner: Any = inner, _name: str = name, **k: Any) -> Any:
            began = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - began

        setattr(obj, name, timed)
    return spent


class _StepProfile:
    """The profiler over a window of engine steps: kernels, and GPU busy time over wall."""

    def __init__(self, device: str, first: int, count: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.label = f"e2e steps {first}..{first + count - 1}"
        self.count = count
        self.prof = profile(activities=[ProfilerActivity.CUDA]) if device == "cuda" else None
        if self.prof is not None:
            self.prof.start()
        self.began = time.perf_counter()

    def report(self, graphs: bool) -> None:
        if self.prof is None:
            return
        import torch

        torch.cuda.synchronize()
        wall = time.perf_counter() - self.began
        self.prof.stop()
        events = self.prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 1e6
        print(
            f"profile of {self.label} (graphs {'on' if graphs else 'off'}): "
            f"{wall * 1e3 / self.count:.2f} ms/step wall, {busy * 1e3 / self.count:.2f} "
            f"ms/step of kernels (GPU busy {100 * busy / wall:.0f}%)"
        )
        print(
            events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60)
        )


def _run_legato(
    args: argparse.Namespace,
    path: str,
    device: str,
    dtype: torch.dtype,
    prompts: list[list[int]],
    outputs: list[int],
    detokenize: bool,
) -> tuple[float, str, dict[str, float], int]:
    """Seconds for the whole workload through LLMEngine (stepped here), how decode ran,
    the seconds spent in each phase of ``step()``, and the number of steps."""
    from legato.llm import LLMEngine
    from legato.protocol.params import RequestOutputKind, SamplingParams
    from legato.toy_model import default_toy_model_dir

    engine = LLMEngine.from_engine_args(
        path,
        tokenizer=str(default_toy_model_dir()),  # ids beyond its vocabulary decode to ""
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=args.max_input_len + args.max_output_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        disable_log_stats=True,
    )
    graphs = engine.runner.decode_graphs
    how = f"decode graphs {graphs.sizes[0]}..{graphs.sizes[-1]}" if graphs else "eager"
    how += ", detokenized" if detokenize else ", no detokenize"
    # Warm-up: one request (as nano-vllm) and a batch of 17, so that the Triton kernels'
    # specialisations (one sequence, multiples of 16, other counts) compile before timing.
    for group in (1, 17):
        for j in range(min(group, len(prompts))):
            warm = {"prompt_token_ids": prompts[j][:32]}
            engine.add_request(f"warmup{group}-{j}", warm, SamplingParams(max_tokens=4))
        while engine.has_unfinished_requests():
            engine.step()
    import torch

    import legato.models.runner as runner_module

    runner = engine.runner
    targets = [
        (engine.scheduler, "schedule"),
        (runner, "execute"),
        (runner.input_batch, "update"),
        (runner.input_batch, "sampling_metadata"),
        (runner.model, "forward"),  # eager steps only; replays go through graphs.run
        (runner.model, "compute_logits"),
        (engine.scheduler, "update_from_output"),
        (engine.processor, "process_outputs"),
    ]
    spent = _timed_methods(targets + ([(graphs, "run")] if graphs is not None else []))
    sample = runner_module.sample

    def sample_and_wait(*a: Any, **k: Any) -> Any:
        """The sampler, then a wait for the GPU (execute reads the tokens right after)."""
        began = time.perf_counter()
        out = sample(*a, **k)
        if device == "cuda":
            torch.cuda.synchronize()
        spent["sample + GPU wait"] = spent.get("sample + GPU wait", 0.0) + (
            time.perf_counter() - began
        )
        return out

    runner_module.sample = sample_and_wait  # type: ignore[assignment]
    prof = None
    first, count = args.e2e_profile or (-1, 0)
    steps = 0
    began = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, outputs, strict=True)):
        params = SamplingParams(
            temperature=0.6,
            ignore_eos=True,
            max_tokens=n,
            detokenize=detokenize,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    spent["add_request"] = time.perf_counter() - began
    generated = 0
    try:
        while engine.has_unfinished_requests():
            if steps == first and detokenize == args.e2e_detokenize[0]:
                prof = _StepProfile(device, first, count)
            steps += 1
            for out in engine.step():
                if out.finished:
                    generated += len(out.outputs[0].token_ids)
            if prof is not None and steps == first + count:
                prof.report(runner.decode_graphs is not None)
                prof = None
    finally:
        runner_module.sample = sample  # type: ignore[assignment]
    seconds = time.perf_counter() - began
    if generated != sum(outputs):
        raise RuntimeError(f"legato generated {generated} tokens, expected {sum(outputs)}")
    del engine, graphs
    return seconds, how, spent, steps


def _run_transformers(
    shape: dict[str, Any],
    device: str,
    dtype: torch.dtype,
    prompts: list[list[int]],
    outputs: list[int],
    batch_size: int,
) -> float:
    """Seconds for the workload through ``generate`` in static batches of ``batch_size``
    (sorted by output length, left-padded, each batch run to its longest output)."""
    import torch
    import transformers

    config = transformers.Qwen3Config(
        **{
            k: v
            for k, v in shape.items()
            if k not in ("architectures", "model_type", "torch_dtype")
        }
    )
    with torch.device(device):
        model: Any = transformers.Qwen3ForCausalLM(config)
    model = model.to(dtype).eval()
    order = sorted(range(len(prompts)), key=lambda i: -outputs[i])

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():  # warm-up: library initialisation, allocator
        pair = [prompts[0], prompts[1 % len(prompts)]]
        width = min(16, *map(len, pair))
        warm = torch.tensor([p[:width] for p in pair], device=device)
        model.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=0)
    sync()
    began = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros(len(idx), width, dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]) :] = 1
            new = max(outputs[i] for i in idx)
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                temperature=0.6,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )
    sync()
    seconds = time.perf_counter() - began
    del model
    return seconds


def end_to_end_section(
    args: argparse.Namespace, rates: DeviceRates, device: str, dtype: torch.dtype
) -> Table:
    """nano-vllm's offline workload: legato's LLMEngine against transformers' generate,
    and against the workload's roofline bound (:func:`workload_floor`)."""
    import torch

    from legato.models.loader import write_random_model_dir

    _free_memory(device)  # what earlier sections held, before the engine sizes its KV cache
    shape = _shape(QWEN3_0_6B, args)
    prompts, outputs = nano_vllm_workload(args, shape["vocab_size"])
    tokens = sum(outputs)
    bound, bound_decode, bound_prefill = workload_floor(shape, prompts, outputs, rates, dtype)
    rows: list[tuple[str, ...]] = [
        (
            "roofline bound",
            f"decode {bound_decode:.2f} s + prefill {bound_prefill:.2f} s",
            f"{bound:.3g}",
            f"{tokens / bound:.0f}",
        )
    ]
    summary: list[tuple[str, str, str, str, str]] = []
    legato_rates: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_random_model_dir(tmp, shape, seed=0))
        for detokenize in args.e2e_detokenize:
            seconds, how, spent, steps = _run_legato(
                args, path, device, dtype, prompts, outputs, detokenize
            )
            rate = tokens / seconds
            legato_rates.append((how, rate))
            rows.append(("legato LLMEngine", how, f"{seconds:.3g}", f"{rate:.0f}"))
            phases = ", ".join(f"{k} {v:.2f} s" for k, v in spent.items())
            print(f"e2e legato ({how}): {rate:.0f} tok/s, {steps} steps; {phases}", flush=True)
            summary.append(
                (
                    "end to end",
                    f"legato ({how}) vs bound",
                    f"{rate:.0f} tok/s",
                    f"bound {tokens / bound:.0f} tok/s",
                    f"{100 * bound / seconds:.0f}%",
                )
            )
            _free_memory(device)
    best: tuple[float, int] | None = None
    for batch_size in [] if args.skip_transformers else args.hf_batch_sizes:
        try:
            hf_seconds = _run_transformers(shape, device, dtype, prompts, outputs, batch_size)
        except torch.OutOfMemoryError:
            rows.append(("transformers generate", f"batch {batch_size}", "out of memory", ""))
            _free_memory(device)
            continue
        rate = tokens / hf_seconds
        rows.append(
            (
                "transformers generate",
                f"static batch {batch_size}",
                f"{hf_seconds:.3g}",
                f"{rate:.0f}",
            )
        )
        print(f"e2e transformers batch {batch_size}: {rate:.0f} tok/s", flush=True)
        best = max(best or (0.0, 0), (rate, batch_size))
        _free_memory(device)
    rows.append(("vLLM", "not run: cannot be installed on the device machine", "-", "-"))
    if best is not None:
        for how, rate in legato_rates:
            summary.append(
                (
                    "end to end",
                    f"legato ({how}) vs transformers",
                    f"{rate:.0f} tok/s",
                    f"transformers {best[0]:.0f} tok/s (batch {best[1]})",
                    f"{rate / best[0]:.2f}x",
                )
            )
    name = "Qwen3-0.6B" if not args.tiny else "tiny Qwen3"
    return Table(
        title=(
            f"end to end, {name}-shaped random model, {str(dtype).removeprefix('torch.')}: "
            f"{args.num_requests} requests, prompts and outputs {args.min_len}.."
            f"{args.max_input_len}/{args.max_output_len} tokens, {tokens} output tokens"
        ),
        header=("engine", "how", "seconds", "out tok/s"),
        rows=rows,
        summary=summary,
    )


# ----------------------------------------------------------------- output


def print_table(table: Table) -> None:
    widths = [
        max(len(cell) for cell in column) for column in zip(table.header, *table.rows, strict=True)
    ]
    print(f"\n{table.title}")
    print("  ".join(h.rjust(w) for h, w in zip(table.header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in table.rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


SectionFn = Callable[[argparse.Namespace, DeviceRates, str, "torch.dtype"], Table]

SECTIONS: tuple[tuple[str, SectionFn], ...] = (
    ("tune", attention_tune_section),
    ("attention", attention_decode_section),
    ("decode", model_decode_section),
    ("e2e", end_to_end_section),
)


def environment(device: str) -> str:
    """Device name, torch and Triton versions: the line every figure is read against."""
    import platform

    import torch
    import triton

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        where = (
            f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
            f"{props.total_memory / _GIB:.0f} GiB), CUDA {torch.version.cuda}"
        )
    else:
        where = f"CPU {platform.processor() or platform.machine()} "
        where += f"({torch.backends.cpu.get_cpu_capability()})"
    return f"{where}; torch {torch.__version__}; triton {triton.__version__}"


def main(argv: Sequence[str] | None = None) -> None:
    import json
    import sys
    import traceback

    args = parse_args(argv)
    device = _resolve_device(args.device)
    import torch

    default_dtype = "bfloat16" if device == "cuda" else "float32"
    dtype = getattr(torch, args.dtype or default_dtype)
    banner = ""
    if device == "cpu":
        banner = "CPU run: Triton kernels under the interpreter; NOT GPU figures"
        print(banner)
    env = environment(device)
    print(f"{env}\ncommand: python {' '.join(sys.argv)}", flush=True)
    rates = measure_device(args, device)
    tables = [device_section(args, rates, device)]
    print_table(tables[0])
    failed = []
    for name, section in SECTIONS:
        if name in args.sections:
            try:
                tables.append(section(args, rates, device, dtype))
            except Exception:  # report the section, run the others
                traceback.print_exc()
                failed.append(name)
                _free_memory(device)
                continue
            print_table(tables[-1])
    summary = Table(
        title=f"summary ({device}{', ' + banner if banner else ''}; {env})",
        header=SUMMARY_HEADER,
        rows=[row for table in tables for row in table.summary],
    )
    print_table(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "environment": env,
                    "argv": sys.argv,
                    "tables": [dataclasses.asdict(t) for t in [*tables, summary]],
                },
                f,
                indent=1,
            )
    if failed:
        raise SystemExit(f"sections failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
