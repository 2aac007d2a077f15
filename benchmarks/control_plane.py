"""Control-plane throughput with the null-model runner (no model at all).

Drives N concurrent streams through renderer -> scheduler -> executor frames ->
detokenizer -> output slots, with ``runner="null"`` (a fixed token, instantly),
and prints output tokens per second: the ceiling the engine's own machinery
puts on any model.

    python benchmarks/control_plane.py --streams 256 --output-len 256
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


async def run(streams: int, output_len: int, executor: str) -> tuple[float, float]:
    import trio

    from legato.engine import open_engine
    from legato.protocol.params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    counts = [0] * streams
    async with open_engine(
        None,
        runner="null",
        executor=executor,
        max_num_seqs=streams,
        max_model_len=output_len + 64,
        num_kv_blocks=streams * ((output_len + 64) // 16 + 2),
        disable_log_stats=True,
    ) as engine:

        async def one(i: int) -> None:
            async with engine.generate("The quick brown fox", params, f"r{i}") as stream:
                async for out in stream:
                    counts[i] += len(out.outputs[0].token_ids)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, i)
        elapsed = time.perf_counter() - start
    total = sum(counts)
    assert total == streams * output_len, total
    return total / elapsed, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--executor", default="process", choices=["process", "inproc"])
    args = parser.parse_args()
    import trio

    rate, elapsed = trio.run(run, args.streams, args.output_len, args.executor)
    print(
        f"{'streams':>8} {'tokens/stream':>14} {'executor':>9} {'seconds':>8} {'output tok/s':>13}"
    )
    print(
        f"{args.streams:>8} {args.output_len:>14} {args.executor:>9} {elapsed:>8.2f} {rate:>13.0f}"
    )


if __name__ == "__main__":
    main()
