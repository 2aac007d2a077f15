"""Sum a worker step timeline (``LEGATO_STEP_TIMELINE``, see legato.workers.step_timeline).

usage: python benchmarks/serve_timeline.py TIMELINE.tsv
Prints, over the file's steps and split by kind (prefill-only, mixed, decode-only, decode
rows verifying drafts): the worker's idle wait before each step, frame decoding, compute
wall and CPU seconds, and answer writing; then the busy span (first frame to last answer)
and the share of it the worker spent computing. A figure, never asserted.
"""

from __future__ import annotations

import csv
import statistics
import sys


def main(path: str) -> None:
    with open(path) as f:
        rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f, delimiter="\t")]
    if not rows:
        print("no steps")
        return
    # the first wait is the time before the first request: not part of the load
    rows[0]["wait_s"] = 0.0
    kinds: dict[str, list[dict[str, float]]] = {
        "prefill": [], "mixed": [], "decode": [], "verify": []
    }  # fmt: skip
    for r in rows:
        r.setdefault("draft_tokens", 0.0)  # a file from before the column
        kind = "decode" if not r["prefill_tokens"] else "mixed" if r["decode_rows"] else "prefill"
        if kind == "decode" and r["draft_tokens"]:
            kind = "verify"  # decode rows verifying drafts
        kinds[kind].append(r)
    cols = ("wait_s", "decode_s", "compute_s", "compute_cpu_s", "write_s")
    print(
        f"{'kind':8} {'steps':>6} {'pf tok':>7} {'rows':>7} {'drafts':>7} "
        + " ".join(f"{c:>13}" for c in cols)
        + "  cpu/wall  med compute ms"
    )
    for kind, rs in [*kinds.items(), ("all", rows)]:
        if not rs:
            continue
        sums = {c: sum(r[c] for r in rs) for c in cols}
        print(
            f"{kind:8} {len(rs):6d} {sum(r['prefill_tokens'] for r in rs):7.0f} "
            f"{sum(r['decode_rows'] for r in rs):7.0f} {sum(r['draft_tokens'] for r in rs):7.0f} "
            + " ".join(f"{sums[c]:13.3f}" for c in cols)
            + f"  {sums['compute_cpu_s'] / max(sums['compute_s'], 1e-9):8.2f}"
            + f"  {1000 * statistics.median(r['compute_s'] for r in rs):8.1f}"
        )
    total = sum(r["wait_s"] + r["decode_s"] + r["compute_s"] + r["write_s"] for r in rows)
    print(
        f"span {total:.2f} s: compute {sum(r['compute_s'] for r in rows) / total:.1%}, "
        f"idle wait {sum(r['wait_s'] for r in rows) / total:.1%} "
        f"(waits over 5 ms: {sum(r['wait_s'] for r in rows if r['wait_s'] > 0.005):.2f} s "
        f"in {sum(1 for r in rows if r['wait_s'] > 0.005)} steps)"
    )
    sizes = sorted(int(r["prefill_tokens"]) for r in rows if r["prefill_tokens"])
    if sizes:
        print(f"prefill tokens per step: median {statistics.median(sizes)}, max {sizes[-1]}")
    print(
        f"decode rows per step (decode-only steps): median "
        f"{statistics.median([r['decode_rows'] for r in kinds['decode']] or [0])}"
    )


if __name__ == "__main__":
    main(sys.argv[1])
