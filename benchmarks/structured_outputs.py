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

    python benchmarks/structured_outputs.py --batch-sizes 1 32 --e2e-tokens 64

``--e2e-tokens N`` adds the end-to-end figure: the engine's output tok/s on the default model
for the same workload with and without a json_schema, alternated in the same run.
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
    parser.add_argument(
        "--e2e-tokens",
        type=int,
        default=0,
        help="also run the engine end to end (default model) with this many tokens per request",
    )
    parser.add_argument("--e2e-repeats", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tok_dir = args.tokenizer or default_tokenizer_dir()
    hf = AutoTokenizer.from_pretrained(tok_dir)
    vocab = len(hf)
    print(f"tokenizer: {tok_dir} ({vocab} tokens)")
    print(
        f"cpu: {torch.backends.cpu.get_cpu_capability()}, torch threads {torch.get_num_threads()}"
    )

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
    print(
        f"compile typical schema: cold {median_ms(cold):.2f} ms, warm (cached) {median_ms(warm):.3f} ms"
    )

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
    if args.e2e_tokens:
        end_to_end(args.batch_sizes, args.e2e_tokens, args.e2e_repeats)


def end_to_end(batch_sizes: list[int], tokens: int, repeats: int) -> None:
    """The engine's output tok/s on the default model with and without a json_schema on the
    same workload (B chat requests of ``tokens`` tokens each, ignore_eos so both make the same
    number of tokens), alternated in one run; the best of ``repeats`` each."""
    from legato import LLM, SamplingParams

    print()
    print(f"end to end: default model, {tokens} tokens per request, best of {repeats}")
    print(f"{'batch':>5} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>6} {'ms/step +':>10}")
    with LLM() as llm:
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "Describe a person as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        common: dict[str, Any] = dict(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=0)
        kinds = {
            "free": SamplingParams(**common),
            "json": SamplingParams(
                **common, structured_outputs=StructuredOutputsParams(json=TYPICAL_SCHEMA)
            ),
        }
        for params in kinds.values():  # warm up (the grammar tokenizer is built here)
            llm.generate([prompt], params.clone(max_tokens=4), use_tqdm=False)
        for batch in batch_sizes:
            best = {name: float("inf") for name in kinds}
            for _ in range(repeats):
                for name, params in kinds.items():
                    started = time.perf_counter()
                    outs = llm.generate([prompt] * batch, params, use_tqdm=False)
                    elapsed = time.perf_counter() - started
                    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
                    best[name] = min(best[name], elapsed)
            free, constrained = (batch * tokens / best[k] for k in ("free", "json"))
            extra_ms = (best["json"] - best["free"]) / tokens * 1e3
            print(
                f"{batch:>5} {free:>11.1f} {constrained:>11.1f} {constrained / free:>6.2f}"
                f" {extra_ms:>10.2f}"
            )


if __name__ == "__main__":
    main()
