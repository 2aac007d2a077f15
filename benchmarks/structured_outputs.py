"""Structured outputs: what a constrained step costs, and how long a schema takes to compile.

Grammar side, measured on a real tokenizer (``--tokenizer DIR``; default: the
default model's when it is installed, else the toy model's):

- tokenizer: building the grammar engine's tokenizer once per engine;
- compile: a typical JSON schema (an object with strings, an integer, an enum
  and an array), cold (nothing cached) and warm (the engine's cache: a copy);
- per step, at each ``--batch-sizes`` B with B constrained sequences walking
  through that schema: ``mask`` = the bitmask rows for the step
  (llguidance, in parallel) + moving them to a tensor + applying them to
  ``[B, vocab]`` logits with the sampler's hook; ``accept`` = advancing every
  grammar over its sampled token. ``unconstrained`` is the same step's sampling
  without any of it (softmax + draw), the peer the overhead is measured against.

Prints a table (medians over ``--steps``); never asserted in tests. Run it
alone (``flock -x /tmp/legato-cpu.lock``)::

    python benchmarks/structured_outputs.py --batch-sizes 1 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from legato.protocol.structured import StructuredOutputsParams  # noqa: E402
from legato.structured import (  # noqa: E402
    GrammarCompiler,
    GrammarState,
    TokenizerInfo,
    allocate_bitmask,
)
from legato.structured.mask import apply_token_bitmask, bitmask_tensor  # noqa: E402

TYPICAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
        },
    },
    "required": ["name", "age", "role", "address"],
}


def default_tokenizer_dir() -> Path:
    try:
        from legato.default_model import default_model_dir  # type: ignore[import-not-found]

        return Path(default_model_dir())
    except Exception:
        from legato.toy_model import default_toy_model_dir

        return default_toy_model_dir()


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compiles", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tok_dir = args.tokenizer or default_tokenizer_dir()
    hf = AutoTokenizer.from_pretrained(tok_dir)
    vocab = len(hf)
    print(f"tokenizer: {tok_dir} ({vocab} tokens)")
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, torch threads {torch.get_num_threads()}")

    started = time.perf_counter()
    compiler = GrammarCompiler(TokenizerInfo.from_hf(hf, vocab_size=vocab))
    print(f"grammar tokenizer build: {(time.perf_counter() - started) * 1e3:.1f} ms")

    cold, warm = [], []
    for i in range(args.compiles):
        schema = {**TYPICAL_SCHEMA, "description": f"variant {i}"}  # a new text: nothing cached
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        t1 = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        t2 = time.perf_counter()
        cold.append(t1 - t0)
        warm.append(t2 - t1)
    print(f"compile typical schema: cold {median_ms(cold):.2f} ms, warm (cached) {median_ms(warm):.3f} ms")

    params = StructuredOutputsParams(json=TYPICAL_SCHEMA)
    gen = torch.Generator().manual_seed(args.seed)
    print()
    print(f"{'batch':>5} {'sampling ms':>12} {'+ mask ms':>10} {'+ accept ms':>12}")
    for batch in args.batch_sizes:
        states: list[GrammarState] = [compiler.compile(params) for _ in range(batch)]
        mask = allocate_bitmask(batch, compiler.vocab_size)
        rows = torch.arange(batch)
        plain_t, mask_t, accept_t = [], [], []
        for _ in range(args.steps):
            logits = torch.randn(batch, compiler.vocab_size, generator=gen) * 2
            t0 = time.perf_counter()
            torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            t1 = time.perf_counter()
            failed = compiler.fill_bitmasks([(s, i) for i, s in enumerate(states)], mask)
            apply_token_bitmask(logits, bitmask_tensor(mask, mask.shape[1], logits.device), rows)
            t2 = time.perf_counter()
            sampled = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0].tolist()
            t3 = time.perf_counter()
            for state, token in zip(states, sampled):
                state.accept([token])
            t4 = time.perf_counter()
            assert not failed, failed
            plain_t.append(t1 - t0)
            mask_t.append(t2 - t1)
            accept_t.append(t4 - t3)
            for i, state in enumerate(states):  # a finished output starts again (untimed)
                if state.is_terminated:
                    states[i] = compiler.compile(params)
        plain, masking, accepting = median_ms(plain_t), median_ms(mask_t), median_ms(accept_t)
        print(f"{batch:>5} {plain:>12.3f} {masking:>10.3f} {accepting:>12.3f}")


if __name__ == "__main__":
    main()
