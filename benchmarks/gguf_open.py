"""Opening a GGUF file's header: legato's reader against ``gguf.GGUFReader``, same file, one run.

Prints, per reader, the seconds to parse the header (median of ``--reps``; each in a fresh
object) and the resident memory it adds (Linux, RssAnon of this process, first parse), then
the ratio. What a worker pays at every start before it loads a weight.

    python benchmarks/gguf_open.py [FILE.gguf]   # default: the default model's Q4_1 file
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from legato.models.gguf_header import GGUFHeader


def _anon_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _measure(open_file: Callable[[str], Any], path: str, reps: int) -> tuple[float, float]:
    before = _anon_mb()
    kept = open_file(path)
    grown = _anon_mb() - before
    del kept
    gc.collect()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        header = open_file(path)
        times.append(time.perf_counter() - began)
        del header
    return statistics.median(times), grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf", nargs="?", default=None)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.gguf is None:
        from legato.default_model import default_model_gguf

        args.gguf = str(default_model_gguf())
    from gguf import GGUFReader

    print(f"file: {args.gguf}")
    ours = _measure(GGUFHeader, args.gguf, args.reps)
    theirs = _measure(GGUFReader, args.gguf, args.reps)
    print(f"{'reader':<18} {'parse s':>9} {'+RSS MB':>8}")
    print(f"{'legato GGUFHeader':<18} {ours[0]:>9.3f} {ours[1]:>8.0f}")
    print(f"{'gguf.GGUFReader':<18} {theirs[0]:>9.3f} {theirs[1]:>8.0f}")
    print(f"speed-up {theirs[0] / ours[0]:.0f}x")


if __name__ == "__main__":
    main()
