"""Roofline benchmark of the GPU path: device rates, then kernels against their memory floor.

One run prints one table per section. ``measure_device`` measures what the
floors are computed from (device-to-device copy bandwidth, dense matmul rate);
every later section is a function ``(args, rates) -> Table`` listed in
``SECTIONS``, so model-level sections (a full decode step, end to end) are
added beside ``attention_decode_section`` when the model runner lands.

Decode attention is memory bound: its floor is the KV bytes it must read
(``batch * context * num_kv_heads * head_dim * 2 * itemsize``) divided by the
measured copy bandwidth, and "% roofline" is floor / measured time. On CUDA the
L2 cache is flushed before every timed call and times are CUDA-event medians;
``--cuda-graph`` replays a captured graph to take Python launch cost out.

Usage::

    python benchmarks/gpu/roofline.py                      # Llama-3-8B shapes on cuda
    python benchmarks/gpu/roofline.py --device cpu --tiny  # interpreter smoke run

On CPU the Triton kernels run under ``TRITON_INTERPRET=1``: the figures then
say nothing about GPU performance, the run only exercises the script.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class DeviceRates:
    """Measured peak rates the floors are computed from."""

    copy_bytes_per_s: float
    matmul_flop_per_s: float


@dataclass(frozen=True)
class Table:
    title: str
    header: tuple[str, ...]
    rows: list[tuple[str, ...]]


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
    p.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays")
    args = p.parse_args(argv)
    if args.tiny:
        args.batches, args.contexts = [1, 3], [40, 100]
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.copy_mib, args.matmul_size, args.warmup, args.iters = 8, 128, 1, 3
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


def attention_decode_section(
    args: argparse.Namespace, rates: DeviceRates, device: str, dtype: torch.dtype
) -> Table:
    """Decode paged attention (``max_query_len=1``) per (batch, context) against the KV-read floor."""
    from legato.kernels import attention, reference

    rows: list[tuple[str, ...]] = []
    checked = False
    for context in args.contexts:
        for batch in args.batches:
            inputs, scale = _decode_inputs(args, batch, context, dtype, device)

            run = functools.partial(
                attention.paged_attention, *inputs, scale, max_query_len=1, max_seq_len=context
            )

            if not checked:  # one correctness check on the smallest shape before timing
                err = (run() - reference.paged_attention(*inputs, scale)).abs().max().item()
                print(f"decode attention check: max |triton - reference| = {err:.2e}")
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
    )


def print_table(table: Table) -> None:
    widths = [
        max(len(cell) for cell in column) for column in zip(table.header, *table.rows, strict=True)
    ]
    print(f"\n{table.title}")
    print("  ".join(h.rjust(w) for h, w in zip(table.header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in table.rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


SECTIONS: tuple[Callable[[argparse.Namespace, DeviceRates, str, torch.dtype], Table], ...] = (
    attention_decode_section,
)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = _resolve_device(args.device)
    import torch

    default_dtype = "bfloat16" if device == "cuda" else "float32"
    dtype = getattr(torch, args.dtype or default_dtype)
    if device == "cpu":
        print("cpu: Triton kernels run under the interpreter; timings are not GPU figures")
    rates = measure_device(args, device)
    print_table(device_section(args, rates, device))
    for section in SECTIONS:
        print_table(section(args, rates, device, dtype))


if __name__ == "__main__":
    main()
