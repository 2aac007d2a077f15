"""Worst-case interpreter time of request fields at their limits (issue 26: F2, F9, F14).

Each row is one hostile input at the largest size a request may send, timed in
this process (best of ``--repeat``), beside the old path where there is one:

* ``grammar sniff``: is the grammar Lark or GBNF? llguidance's regex (quadratic on
  blank lines, holds the GIL) against ``legato.structured.grammar.is_lark``;
* ``gbnf_to_lark``: GBNF conversion of a cap-sized grammar (pure Python);
* ``json schema``: ``json.loads`` of a cap-sized schema (one C call);
* ``partial_stop_length`` / ``find_stop_string``: one sequence's stop-string work
  per step at the stop caps, with a text built to defeat early exits;
* ``tools duplicate check``: the old ``list.count`` scan against a set, at
  20,000 tools (what 1 MiB held before the cap) and at the cap.

Prints a table::

    python benchmarks/hostile_specs.py
    python benchmarks/hostile_specs.py --newlines 8000 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable

from llguidance.gbnf_to_lark import gbnf_to_lark

from legato.outputs.detokenizer import find_stop_string, partial_stop_length
from legato.protocol.params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from legato.protocol.structured import SPEC_LIMITS
from legato.server.openai_protocol import MAX_TOOLS
from legato.structured.grammar import is_lark

SNIFF = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--newlines", type=int, default=8000, help="blank lines for the sniff")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    r = args.repeat
    rows: list[tuple[str, str, float]] = []
    blank = "\n" * args.newlines
    rows.append((f"grammar sniff, {args.newlines} blank lines", "llguidance regex",
                 best_ms(lambda: SNIFF.search(blank), r)))  # fmt: skip
    rows.append(("", "is_lark", best_ms(lambda: is_lark(blank), r)))
    cap = SPEC_LIMITS["grammar"]
    rows.append((f"grammar sniff, {cap} blank lines (cap)", "is_lark",
                 best_ms(lambda: is_lark("\n" * cap), r)))  # fmt: skip
    rules = "".join(f'r{i} ::= "a" | r{i + 1}\n' for i in range(cap // 20))[:cap]
    rows.append((f"gbnf_to_lark, {len(rules)} chars (cap)", "llguidance",
                 best_ms(lambda: _try(gbnf_to_lark, rules), r)))  # fmt: skip
    schema_cap = SPEC_LIMITS["json"]
    props = {f"p{i}": {"type": "string"} for i in range(schema_cap // 30)}
    schema = json.dumps({"type": "object", "properties": props})[: schema_cap - 2] + "}}"
    rows.append((f"json schema, {len(schema)} chars (cap)", "json.loads",
                 best_ms(lambda: _try(json.loads, schema), r)))  # fmt: skip
    # Every prefix of each stop ends like the text, and only the one-character one fits.
    stops = ["a" * (MAX_STOP_CHARS - 1) + "b"] * MAX_STOP_STRINGS
    text = "x" * 4000 + "ca"
    rows.append((f"partial_stop_length, {MAX_STOP_STRINGS} x {MAX_STOP_CHARS}-char stops",
                 "per sequence per step", best_ms(lambda: partial_stop_length(text, stops), r)))  # fmt: skip
    rows.append(("find_stop_string, same", "per sequence per step",
                 best_ms(lambda: find_stop_string(text, len(text) - 8, stops), r)))  # fmt: skip
    for count in (20_000, MAX_TOOLS):
        names = [f"f{i:05d}" for i in range(count)]
        rows.append((f"tools duplicate check, {count} tools", "list.count (old)",
                     best_ms(lambda names=names: next((n for n in names if names.count(n) > 1), None), 1)))  # fmt: skip
        rows.append(
            ("", "set (new)", best_ms(lambda names=names: len(set(names)) == len(names), r))
        )
    print(f"{'input':<48} {'path':<24} {'ms':>10}")
    for name, path, ms in rows:
        print(f"{name:<48} {path:<24} {ms:>10.3f}")


def _try(fn: Callable[[str], object], text: str) -> None:
    try:
        fn(text)
    except Exception:  # noqa: BLE001 - the cost is what is measured, not the verdict
        pass


if __name__ == "__main__":
    main()
