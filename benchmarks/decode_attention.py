"""Decode attention alone, against the bytes it must read: ms a step and the KV read rate.

Holds ``--layers`` layers' paged K/V caches (the default model's shape: 9 query heads, 3 kv
heads, head_dim 64, blocks of ``--block-size`` tokens in a shuffled order, as a pool that has
served a while hands them out), ``--batch`` sequences of about ``--context`` tokens, and
times ``cpu_kernels.decode_attention`` over every layer (one decode step's attention, no KV
write), median of ``--reps``. Prints ms a step, the KV bytes a step reads and their rate in
GB/s: the pass is bound by memory, so the rate against what the machine reads is what is
left. ``--huge-pages`` puts each cache in an anonymous map advised ``MADV_HUGEPAGE`` (the
runner's maps are not). Checks layer 0 against plain torch first. Never asserted.

    flock -x /tmp/legato-cpu.lock python benchmarks/decode_attention.py --batch 32 --context 300
"""

from __future__ import annotations

import argparse
import math
import mmap
import statistics
import time

import torch

from legato.models import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def mapped(
    shape: tuple[int, ...], dtype: torch.dtype, huge: bool, keep: list[mmap.mmap]
) -> torch.Tensor:
    memory = mmap.mmap(
        -1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    if huge:
        memory.madvise(mmap.MADV_HUGEPAGE)
    keep.append(memory)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    bs, rows = k.shape[1], []
    for s in range(q.shape[0]):
        n = int(lens[s])
        blocks = table[s, : -(-n // bs)].long()
        kk = (
            k[blocks]
            .reshape(-1, KV_HEADS, HEAD_DIM)[:n]
            .float()
            .repeat_interleave(HEADS // KV_HEADS, 1)
        )
        vv = (
            v[blocks]
            .reshape(-1, KV_HEADS, HEAD_DIM)[:n]
            .float()
            .repeat_interleave(HEADS // KV_HEADS, 1)
        )
        scores = torch.einsum("hd,thd->ht", q[s].float(), kk) / math.sqrt(HEAD_DIM)
        rows.append(torch.einsum("ht,thd->hd", scores.softmax(-1), vv))
    return torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--huge-pages", action="store_true")
    args = parser.parse_args()
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    bs, keep = args.block_size, []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        lens = torch.randint(
            max(1, args.context - 20), args.context + 20, (args.batch,), dtype=torch.int32
        )
        per = -(-(args.context + 20) // bs)
        table = torch.randperm(args.batch * per).view(args.batch, per).to(torch.int32)
        shape = (args.batch * per, bs, KV_HEADS, HEAD_DIM)
        caches = []
        for _ in range(args.layers):
            pair = (
                mapped(shape, dtype, args.huge_pages, keep),
                mapped(shape, dtype, args.huge_pages, keep),
            )
            for cache in pair:
                cache.copy_(torch.randn(shape).to(dtype))
            caches.append(pair)
        q = torch.randn(args.batch, HEADS, HEAD_DIM).to(dtype)
        out = torch.empty_like(q)
        scale = 1 / math.sqrt(HEAD_DIM)
        got = cpu_kernels.decode_attention(q, *caches[0], table, lens, scale, out=out)
        error = (got.float() - reference(q, *caches[0], table, lens)).abs().max().item()
        times = []
        for _ in range(args.reps + 2):
            start = time.perf_counter()
            for key, value in caches:
                cpu_kernels.decode_attention(q, key, value, table, lens, scale, out=out)
            times.append((time.perf_counter() - start) * 1e3)
        ms = statistics.median(times[2:])
        kv_mb = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * dtype.itemsize * args.layers / 1e6
        # The same bytes read in order (torch.sum over every layer's caches, whole): the
        # rate this machine gives a plain stream now, beside the attention's own.
        flat = [c.view(-1) for pair in caches for c in pair]
        sums = []
        for _ in range(args.reps + 2):
            start = time.perf_counter()
            for cache in flat:
                cache.sum()
            sums.append((time.perf_counter() - start) * 1e3)
        read_mb = sum(c.nbytes for c in flat) / 1e6
        print(
            f"{name}: {ms:.2f} ms a step (min {min(times[2:]):.2f}), {kv_mb:.0f} MB of KV, "
            f"{kv_mb / ms:.1f} GB/s; max |error| against torch {error:.1e}; a sequential read: "
            f"{read_mb / statistics.median(sums[2:]):.1f} GB/s"
        )


if __name__ == "__main__":
    main()
