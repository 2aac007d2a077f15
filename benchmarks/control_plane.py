"""Control-plane throughput with the null-model runner (no model at all).

Drives N concurrent streams through renderer -> scheduler -> executor frames ->
detokenizer -> output slots, with ``runner="null"`` (a fixed token, instantly),
and prints output tokens per second (the ceiling the engine's own machinery
puts on any model), the control plane's microseconds per request per step
(wall clock, and CPU time of the engine's process: the second is steadier on a
busy machine), and the memory one idle open stream costs (streams held by a
paused engine).

    python benchmarks/control_plane.py --streams 256 --output-len 256
    python benchmarks/control_plane.py --streams 256 --rounds 9  # a row per round, and the median
    python benchmarks/control_plane.py --streams 256 --no-async-scheduling
    python benchmarks/control_plane.py --streams 256 --default-gc  # CPython's collector settings
    python benchmarks/control_plane.py --streams 256 --rounds 5 --asyncio  # through legato.aio

``--asyncio`` drives the same workload from an asyncio event loop through
``legato.aio`` (the trio engine in its own thread; CPU time counts both threads).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def engine_args(streams: int, output_len: int, executor: str, **extra: Any) -> dict[str, Any]:
    return dict(
        runner="null",
        executor=executor,
        max_num_seqs=streams,
        max_model_len=output_len + 64,
        num_kv_blocks=streams * ((output_len + 64) // 16 + 2),
        disable_log_stats=True,
        **extra,
    )


async def run(
    streams: int,
    output_len: int,
    executor: str,
    rounds: int = 1,
    default_gc: bool = False,
    **extra: Any,
) -> list[tuple[float, float, float]]:
    """Per round: output tok/s, wall seconds, and CPU seconds of this process, of the
    streaming part. The rounds run one after another on one engine."""
    import trio

    from legato.engine import open_engine
    from legato.protocol.params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    results = []
    threshold = gc.get_threshold()
    async with open_engine(None, **engine_args(streams, output_len, executor, **extra)) as engine:
        if default_gc:  # undo the engine's tune_gc_for_serving (legato.serving_gc)
            gc.unfreeze()
            gc.set_threshold(*threshold)

        async def one(request_id: str, counts: list[int], i: int) -> None:
            async with engine.generate("The quick brown fox", params, request_id) as stream:
                async for out in stream:
                    counts[i] += len(out.outputs[0].token_ids)

        for round_ in range(rounds):
            counts = [0] * streams
            start, start_cpu = time.perf_counter(), time.process_time()
            async with trio.open_nursery() as nursery:
                for i in range(streams):
                    nursery.start_soon(one, f"{round_}-{i}", counts, i)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            total = sum(counts)
            assert total == streams * output_len, total
            results.append((total / elapsed, elapsed, cpu))
    return results


def run_asyncio(
    streams: int,
    output_len: int,
    executor: str,
    rounds: int = 1,
    default_gc: bool = False,
    **extra: Any,
) -> list[tuple[float, float, float]]:
    """``run``'s workload and figures, consumed by asyncio tasks through ``legato.aio``."""
    import asyncio

    import legato.aio
    from legato.protocol.params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    threshold = gc.get_threshold()

    async def main() -> list[tuple[float, float, float]]:
        results = []
        args = engine_args(streams, output_len, executor, **extra)
        async with legato.aio.open_engine(None, **args) as engine:
            if default_gc:
                gc.unfreeze()
                gc.set_threshold(*threshold)

            async def one(request_id: str, counts: list[int], i: int) -> None:
                async with engine.generate("The quick brown fox", params, request_id) as stream:
                    async for out in stream:
                        counts[i] += len(out.outputs[0].token_ids)

            for round_ in range(rounds):
                counts = [0] * streams
                start, start_cpu = time.perf_counter(), time.process_time()
                await asyncio.gather(*(one(f"{round_}-{i}", counts, i) for i in range(streams)))
                elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
                total = sum(counts)
                assert total == streams * output_len, total
                results.append((total / elapsed, elapsed, cpu))
        return results

    return asyncio.run(main())


async def idle_stream_bytes(streams: int, executor: str) -> float:
    """Python heap bytes (tracemalloc) per open stream while a paused engine holds them."""
    import tracemalloc

    import trio
    import trio.testing

    from legato.engine import open_engine
    from legato.protocol.params import SamplingParams

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    async with open_engine(None, **engine_args(streams, 16, executor)) as engine:
        await engine.pause_generation(mode="keep")
        opened = 0
        all_open = trio.Event()
        release = trio.Event()

        async def one(i: int) -> None:
            nonlocal opened
            async with engine.generate("The quick brown fox", params, f"idle{i}"):
                opened += 1
                if opened == streams:
                    all_open.set()
                await release.wait()

        async with trio.open_nursery() as nursery:
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            for i in range(streams):
                nursery.start_soon(one, i)
            await all_open.wait()
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)  # rendering done
            after = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            release.set()
            nursery.cancel_scope.cancel()
    return (after - before) / streams


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--executor", default="process", choices=["process", "inproc"])
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap scheduling with the worker (default: the engine's default)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="stream the workload this many times on one engine, a row each and the median "
        "(this machine's speed varies from second to second)",
    )
    parser.add_argument(
        "--idle-memory", action="store_true", help="also measure memory per idle open stream"
    )
    parser.add_argument(
        "--default-gc",
        action="store_true",
        help="once the engine is up, undo its collector settings (gc.unfreeze(), CPython's "
        "thresholds): the collector rescans the start-up heap and runs young collections "
        "every few hundred allocations, as it did before engines tuned it",
    )
    parser.add_argument(
        "--asyncio",
        action="store_true",
        help="consume the streams from asyncio tasks through legato.aio",
    )
    args = parser.parse_args()
    import torch
    import trio

    extra = {} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling}
    workload = (
        args.streams,
        args.output_len,
        args.executor,
        args.rounds,
        args.default_gc,
    )
    if args.asyncio:
        results = run_asyncio(*workload, **extra)
    else:
        results = trio.run(functools.partial(run, *workload, **extra))
    steps = args.output_len  # one token per stream per decode step (the first from prefill)
    overlap = "default" if args.async_scheduling is None else str(args.async_scheduling)
    if args.default_gc:
        overlap += ",default-gc"
    print(f"driver: {'asyncio (legato.aio)' if args.asyncio else 'trio'}")
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores")
    print(
        f"{'streams':>8} {'tokens/stream':>14} {'executor':>9} {'overlap':>8} {'seconds':>8} "
        f"{'output tok/s':>13} {'us/req/step':>12} {'cpu us/req/step':>16}"
    )
    rows = [(f"{i + 1}", *result) for i, result in enumerate(results)]
    if len(results) > 1:  # the round of median throughput (an odd count has one)
        rows.append(("median", *sorted(results)[len(results) // 2]))
    for label, rate, elapsed, cpu in rows:
        print(
            f"{args.streams:>8} {args.output_len:>14} {args.executor:>9} {overlap:>8} "
            f"{elapsed:>8.2f} {rate:>13.0f} {elapsed / steps / args.streams * 1e6:>12.2f} "
            f"{cpu / steps / args.streams * 1e6:>16.2f}" + (f"  {label}" if len(rows) > 1 else "")
        )
    if args.idle_memory:
        per_stream = trio.run(idle_stream_bytes, args.streams, args.executor)
        print(f"memory per idle open stream: {per_stream / 1024:.1f} KiB (Python heap)")


if __name__ == "__main__":
    main()
