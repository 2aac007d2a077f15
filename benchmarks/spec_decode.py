"""Speculative decoding (n-gram drafts, or a draft model) against plain decoding, in one
run, default model.

Two workloads, each at 1 and at N concurrent streams, greedy:

* ``edit``: the model is asked to repeat a given text with small corrections (a
  repetitive workload: the answer copies the prompt, where prompt lookup shines);
* ``chat``: free questions, whose answers copy little.

Decode tok/s counts each stream's tokens after its first, over the time from the
first stream's first token to the last stream's last token (prefill excluded).
Acceptance is vLLM's: accepted draft tokens / draft tokens, and the mean accepted
length (1 + accepted / verifications: tokens a verified step yields); "drafted" is the
mean number of drafts a verification carried (below k where the proposer found fewer),
"undrafted" the share of the decoded tokens that came from steps verifying no draft (the
proposer found none, or the draft policy declined them). Prints a table; never asserted in tests.

Both engines (each with its worker) run side by side (the idle one waits on its
socket). Each round runs every workload once on the plain engine and once on the
speculative one, back to back, the order alternating from round to round (ABBA...),
so that the machine's drift (other processes, clock, caches) falls on both alike.
The engine started first ran 2-4% faster than an identical one started second (an
A/A run, ``--control``, which builds the second engine plain too: its ratios are the
pairs' own spread and any bias left, the yardstick for a speed-up near 1). So the
rounds run in two halves, each starting both engines afresh, in opposite orders. The
speed-up is the median of the per-pair ratios, with their spread (min-max); tok/s are
medians. Every run's outputs are compared with the first plain run's ("same out":
identical every run). ``--spec-first`` puts the speculative engine first in the first
round and starts it first in the first half.

``--draft-layers N`` proposes with a draft model instead: the default model's first
``N`` layers (its embeddings, norm and LM head kept), cut once from its dequantized
weights into ``$LEGATO_HOME`` (:func:`legato.models.layer_cut.cut_layers`).

    python benchmarks/spec_decode.py --streams 8 --max-tokens 128 --k 4 [--rounds 7] [--disable-by-batch-size 4]
    python benchmarks/spec_decode.py --streams 1 --workloads edit --k 8
    python benchmarks/spec_decode.py --streams 8 --max-tokens 64 --k 3 --draft-layers 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import common  # noqa: F401  (the offline environment)

EDIT_TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed La dame de fer, it was constructed as the centrepiece "
    "of the 1889 World's Fair, and to crown the centennial anniversary of the French "
    "Revolution. Although initially criticised by some of France's leading artists and "
    "intellectuals for its design, it has since become a global cultural icon of France."
)
EDIT_ASKS = [
    "Repeat the following text exactly, word for word:\n\n",
    "Copy this paragraph exactly as it is written:\n\n",
    "Rewrite the following text, changing nothing:\n\n",
    "Please repeat this text verbatim:\n\n",
]
CHAT_ASKS = [
    "Tell me about the history of Rome.",
    "What are some good habits for staying healthy?",
    "Explain how a rainbow forms.",
    "Write a short poem about the sea.",
    "What should I pack for a weekend hiking trip?",
    "Why is the sky blue?",
    "Give me three ideas for a birthday party.",
    "How do plants make their food?",
]


def prompts(workload: str, n: int, tokenizer: Any) -> list[str]:
    asks = [a + EDIT_TEXT for a in EDIT_ASKS] if workload == "edit" else CHAT_ASKS
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": asks[i % len(asks)]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(n)
    ]


def draft_model_dir(num_layers: int) -> str:
    """The default model's first ``num_layers`` layers as a draft model directory, made
    once (cut from fp32_model_dir.py's fp32 conversion of the GGUF file, through
    ``build_atomically`` as that is: its marker names the source and the layers)."""
    from fp32_model_dir import fp32_model_dir

    from legato.model_cache import build_atomically, legato_home
    from legato.models.layer_cut import cut_layers

    source = fp32_model_dir()
    out = legato_home() / f"smollm2-draft-{num_layers}-layers"
    built = build_atomically(
        out,
        "legato-draft-cut.json",
        {"source_dir": str(source), "layers": num_layers},
        lambda tmp: cut_layers(source, tmp, num_layers),
        f"{out} exists but is not this script's {num_layers}-layer cut of {source}; remove it",
    )
    return str(built)


async def measure(engine: Any, texts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tok/s over ``texts`` run concurrently, and each one's tokens."""
    import trio

    from legato import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )
    firsts: list[float] = []
    lasts: list[float] = []
    outputs: list[list[int]] = [[] for _ in texts]

    async def one(i: int) -> None:
        async with engine.generate(texts[i], params, f"b{i}-{time.monotonic_ns()}") as stream:
            async for out in stream:
                now = time.perf_counter()
                if not outputs[i]:
                    firsts.append(now)
                outputs[i] += out.outputs[0].token_ids
        lasts.append(time.perf_counter())

    async with trio.open_nursery() as nursery:
        for i in range(len(texts)):
            nursery.start_soon(one, i)
    decoded = sum(len(o) - 1 for o in outputs)
    return decoded / (max(lasts) - min(firsts)), outputs


class Acceptance:
    """A stat logger counting drafts, draft tokens and accepted tokens (vLLM's figures)."""

    def __init__(self) -> None:
        self.drafts = self.tokens = self.accepted = 0

    def counts(self) -> tuple[int, int, int]:
        return self.drafts, self.tokens, self.accepted

    def record_step(self, step: Any) -> None:
        spec = step.scheduler.spec_decoding if step.scheduler is not None else None
        if spec is not None:
            self.drafts += spec.num_drafts
            self.tokens += spec.num_draft_tokens
            self.accepted += spec.num_accepted_tokens


def spread(values: list[float]) -> str:
    """``median (min-max)`` of ``values``."""
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


async def run(args: argparse.Namespace) -> None:
    from contextlib import AsyncExitStack

    from transformers import AutoTokenizer

    from legato.default_model import default_model_dir
    from legato.engine import open_engine
    from legato.metrics.logger_base import StepStatLogger

    class Counting(Acceptance, StepStatLogger):
        pass

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    spec: dict[str, Any] = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
    }
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    proposer = f"n-gram k={args.k}, lookup {args.lookup_min}..{args.lookup_max}"
    if args.draft_layers:
        spec = {"model": draft_model_dir(args.draft_layers), "num_speculative_tokens": args.k}
        proposer = f"draft model (the first {args.draft_layers} layers) k={args.k}"
    if args.control:
        proposer = "control: the 'spec' engine is a second plain engine (A/A)"
    cells = [(w, n) for w in args.workloads for n in dict.fromkeys((1, args.streams))]
    texts = {(w, n): prompts(w, n, tokenizer) for w, n in cells}
    tps: dict[tuple[str, int, bool], list[float]] = {
        (w, n, s): [] for w, n in cells for s in (False, True)
    }
    ratios: dict[tuple[str, int], list[float]] = {cell: [] for cell in cells}
    counts = {cell: [0, 0, 0] for cell in cells}
    decoded = {cell: 0 for cell in cells}  # the speculative runs' tokens after the first
    reference: dict[tuple[str, int], list[list[int]]] = {}
    differ: dict[tuple[str, int], int] = {cell: 0 for cell in cells}
    acceptance = Counting()
    elapsed = 0.0
    # The engine started first ran 2-4% faster than an identical one started second (an A/A
    # run, --control: chat x8 0.97x with the second engine measured as "spec", 1.01x the
    # other way round; the cause is not known). So the rounds run in two halves, each with
    # both engines started afresh, the plain one first in one half and second in the other.
    halves = [(not args.spec_first, range(0, (args.rounds + 1) // 2))]
    halves.append((args.spec_first, range((args.rounds + 1) // 2, args.rounds)))
    for plain_first, rounds in halves:
        if not rounds:
            continue
        async with AsyncExitStack() as stack:
            # Both engines (two workers) stay alive side by side; an idle one waits on its
            # socket, so the one measured has the CPUs.
            engines = {}
            for use_spec in (False, True) if plain_first else (True, False):
                engines[use_spec] = await stack.enter_async_context(
                    open_engine(
                        None,
                        gguf_dequantize=args.dequantize,
                        speculative_config=spec if use_spec and not args.control else None,
                        max_num_seqs=max(args.streams, 1),
                        disable_log_stats=True,
                        stat_loggers=[acceptance] if use_spec else [],
                    )
                )
            for engine in engines.values():  # warm-up: both prompt shapes, both batch sizes
                for w, n in cells:
                    await measure(engine, texts[(w, n)], 16)
            began = time.perf_counter()
            for r in rounds:
                # ABBA...: each round alternates which engine goes first in every pair
                order = (True, False) if (r % 2 == 0) == args.spec_first else (False, True)
                for cell in cells:
                    got: dict[bool, float] = {}
                    for use_spec in order:
                        before = acceptance.counts()
                        rate, outs = await measure(engines[use_spec], texts[cell], args.max_tokens)
                        got[use_spec] = rate
                        tps[(*cell, use_spec)].append(rate)
                        if use_spec:
                            for j, (now, then) in enumerate(zip(acceptance.counts(), before)):
                                counts[cell][j] += now - then
                            decoded[cell] += sum(len(o) - 1 for o in outs)
                        if cell not in reference:
                            reference[cell] = outs
                        elif outs != reference[cell]:
                            differ[cell] += 1
                    ratios[cell].append(got[True] / got[False])
                print(
                    f"  round {r + 1}/{args.rounds} ({'plain' if plain_first else 'spec'} "
                    "engine started first): "
                    + ", ".join(f"{w} x{n} {ratios[(w, n)][-1]:.2f}x" for w, n in cells),
                    flush=True,
                )
            elapsed += time.perf_counter() - began
    import torch

    if torch.cuda.is_available():
        print(f"device: {torch.cuda.get_device_name()} (torch {torch.__version__})")
    else:
        print(
            f"CPU capability: {torch.backends.cpu.get_cpu_capability()}, "
            f"threads {torch.get_num_threads()}"
        )
    print(
        f"default model ({'dequantized' if args.dequantize else 'kept quantized'}), greedy, "
        f"max_tokens={args.max_tokens}; {proposer}, "
        f"disable_by_batch_size={args.disable_by_batch_size}; {args.rounds} rounds of "
        f"alternating plain/spec pairs in {elapsed:.0f} s; tok/s are medians, speed-up the "
        f"median (min-max) of the per-pair ratios"
    )
    print(
        f"{'workload':8} {'streams':>7} {'plain tok/s':>12} {'spec tok/s':>11} "
        f"{'speed-up (min-max)':>20} {'accept':>7} {'mean len':>9} {'drafted':>8} "
        f"{'undrafted':>9} {'same out':>9}"
    )
    for w, n in cells:
        drafts, tokens, accepted = counts[(w, n)]
        rate = accepted / tokens if tokens else 0.0
        length = 1 + accepted / drafts if drafts else 1.0
        drafted = tokens / drafts if drafts else 0.0  # draft tokens a verification, <= k
        # steps that verified no draft: each yields one token, a verification 1 + accepted
        undrafted = (decoded[(w, n)] - drafts - accepted) / max(1, decoded[(w, n)])
        plain = statistics.median(tps[(w, n, False)])
        fast = statistics.median(tps[(w, n, True)])
        same = "yes" if not differ[(w, n)] else f"{differ[(w, n)]} differ"
        print(
            f"{w:8} {n:>7} {plain:>12.1f} {fast:>11.1f} {spread(ratios[(w, n)]):>20} "
            f"{100 * rate:>6.1f}% {length:>9.2f} {drafted:>8.2f} {100 * undrafted:>8.1f}% "
            f"{same:>9}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument(
        "--workloads", nargs="+", choices=("edit", "chat"), default=["edit", "chat"]
    )
    parser.add_argument(
        "--rounds", type=int, default=7, help="alternating plain/spec pairs per workload"
    )
    parser.add_argument("--repeats", type=int, dest="rounds", help="the old name of --rounds")
    parser.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="no drafts while more run"
    )
    parser.add_argument(
        "--dequantize", action="store_true", help="gguf_dequantize: dense weights, not the file's"
    )
    parser.add_argument(
        "--spec-first",
        action="store_true",
        help="the speculative engine first in the first round and started first in the first half",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="both engines plain: the pairs' own spread and any bias of the engine slots",
    )
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=0,
        help="0: n-gram drafts; N: a draft model, the default model's first N layers",
    )
    args = parser.parse_args()
    import trio

    trio.run(run, args)


if __name__ == "__main__":
    main()
