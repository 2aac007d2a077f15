"""16 streams at once on one GGUF file: legato against llama.cpp's batched decoding, alternately,
in one run on this machine.

Each stream gets its own ``--prompt-len``-token prompt (windows of one text, shifted per
stream and per run, so no engine reuses a prefix from an earlier run) and decodes
``--output-len`` greedy tokens, EOS ignored. Per engine and run: aggregate output tokens/s
over the whole batch (wall time from submitting the prompts to the last token, prefill
included) and over the decode phase only (after the last stream's first token).

- llama.cpp: llama-cpp-python's low-level API, as llama.cpp's ``batched`` example does: one
  context with ``n_seq_max`` = the stream count, every prompt prefilled in one
  ``llama_batch`` (one sequence id each), then one ``llama_decode`` per step over a batch of
  one token per stream; greedy argmax of each stream's logits.
- legato: ``LLM(file).generate`` of the prompts (the engine's continuous batching, the
  worker process included).

Each engine runs in its own process (llama.cpp's from the anchor's venv, set up by
``../shared/anchors/llama-cpp/setup.sh``), one warm-up then ``--runs`` timed runs per
process, the two engines alternating ``--reps`` times. Prints one JSON line per run, then
the medians and the ratio legato / llama.cpp, CPU named. Run nothing else meanwhile.

    python benchmarks/gguf_streams.py [FILE.gguf] [--streams 16] [--reps 2]
    python benchmarks/gguf_streams.py --engine llamacpp --gguf FILE   # one engine alone
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TEXT = (
    "The history of the city begins with a small settlement on the river, where traders met to "
    "exchange salt, wool and grain. Over the centuries the town grew into a market centre, then "
    "a port, and its people built walls, bridges, churches and schools. "
) * 12
# the anchor's venv, where its scripts put it ($ANCHOR_HOME, as theirs)
ANCHOR_HOME = Path(os.environ.get("ANCHOR_HOME", Path.home() / ".cache/legato-anchors"))
LLAMACPP_PYTHON = ANCHOR_HOME / "llamacpp/bin/python"


def prompts(ids: list[int], streams: int, length: int, run: int) -> list[list[int]]:
    """One window of ``ids`` per stream, shifted by stream and by run."""
    step = 9
    need = (streams - 1) * step + run * 3 + length
    if len(ids) < need:
        raise ValueError(f"the text has {len(ids)} tokens, {need} are needed")
    return [ids[s * step + run * 3 :][:length] for s in range(streams)]


def run_llamacpp(args: argparse.Namespace) -> list[dict[str, Any]]:
    import ctypes

    import llama_cpp as llama
    import numpy as np

    llama.llama_backend_init()
    model = llama.llama_model_load_from_file(args.gguf.encode(), llama.llama_model_default_params())
    vocab = llama.llama_model_get_vocab(model)
    n_vocab = llama.llama_vocab_n_tokens(vocab)
    params = llama.llama_context_default_params()
    params.n_ctx = args.streams * (args.prompt_len + args.output_len + 16)
    params.n_batch = args.streams * args.prompt_len
    params.n_seq_max = args.streams
    params.n_threads = params.n_threads_batch = args.threads
    ctx = llama.llama_init_from_model(model, params)
    text = TEXT.encode()
    buffer = (llama.llama_token * 8192)()
    count = llama.llama_tokenize(vocab, text, len(text), buffer, 8192, True, False)
    ids = list(buffer[:count])
    batch = llama.llama_batch_init(args.streams * args.prompt_len, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Decode (token, position, stream, wants logits) entries; greedy picks, in order."""
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if llama.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        picks = []
        for i, entry in enumerate(entries):
            if entry[3]:
                row = llama.llama_get_logits_ith(ctx, i)
                values = np.ctypeslib.as_array(
                    ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)
                )
                picks.append(int(values.argmax()))
        return picks

    rows = []
    for run in range(args.runs + 1):  # the first warms up
        llama.llama_memory_clear(llama.llama_get_memory(ctx), True)
        streams = prompts(ids, args.streams, args.prompt_len, run)
        began = time.perf_counter()
        entries = [
            (token, pos, s, pos == len(p) - 1)
            for s, p in enumerate(streams)
            for pos, token in enumerate(p)
        ]
        last = decode(entries)
        first = time.perf_counter()
        outputs = [[t] for t in last]
        for step in range(1, args.output_len):
            pos = args.prompt_len + step - 1
            last = decode([(t, pos, s, True) for s, t in enumerate(last)])
            for out, t in zip(outputs, last, strict=True):
                out.append(t)
        ended = time.perf_counter()
        if run:
            rows.append(_row("llamacpp", args, began, first, ended, outputs))
    llama.llama_batch_free(batch)
    llama.llama_free(ctx)
    llama.llama_model_free(model)
    return rows


def run_legato(args: argparse.Namespace) -> list[dict[str, Any]]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from legato import LLM, SamplingParams

    llm = LLM(args.gguf, dtype="float32")
    ids = llm.get_tokenizer()(TEXT)["input_ids"]
    sampling = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rows = []
    try:
        for run in range(args.runs + 1):
            batch = [
                {"prompt_token_ids": p} for p in prompts(ids, args.streams, args.prompt_len, run)
            ]
            began = time.monotonic()  # the clock of RequestOutput.metrics
            outs = llm.generate(batch, sampling, use_tqdm=False)
            ended = time.monotonic()
            first = max(o.metrics.first_token_time for o in outs if o.metrics is not None)
            if run:
                outputs = [list(o.outputs[0].token_ids) for o in outs]
                rows.append(_row("legato", args, began, first, ended, outputs))
    finally:
        llm.shutdown()
    return rows


def _row(engine: str, args: argparse.Namespace, began: float, first: float, ended: float, outputs: list[list[int]]) -> dict[str, Any]:  # fmt: skip
    tokens = sum(len(o) for o in outputs)
    return {
        "engine": engine,
        "streams": args.streams,
        "output_tokens": tokens,
        "aggregate_tok_s": round(tokens / (ended - began), 1),
        "decode_tok_s": round((tokens - len(outputs)) / (ended - first), 1),
        "prefill_s": round(first - began, 3),
        "first_ids": outputs[0][:6],
    }


def compare(args: argparse.Namespace) -> None:
    import torch

    if args.gguf is None:
        from legato.default_model import default_model_gguf

        args.gguf = str(default_model_gguf())
    pythons = {"legato": sys.executable, "llamacpp": args.llamacpp_python}
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"cpu: {_cpu_name()}, {cpu}, {os.cpu_count()} cores; file {args.gguf}")
    rows: list[dict[str, Any]] = []
    for _ in range(args.reps):
        for engine, python in pythons.items():
            command = [python, __file__, "--engine", engine, "--gguf", args.gguf]
            for flag in ("streams", "prompt_len", "output_len", "threads", "runs"):
                command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            lines = [line for line in done.stdout.splitlines() if line.startswith('{"engine"')]
            if done.returncode or not lines:
                print(f"{engine} failed:\n{done.stderr[-3000:]}")
                continue
            for line in lines:
                print(line)
                rows.append(json.loads(line))

    def median(engine: str, key: str) -> float:
        values = [r[key] for r in rows if r["engine"] == engine]
        return statistics.median(values) if values else float("nan")

    for key in ("aggregate_tok_s", "decode_tok_s"):
        ours, theirs = median("legato", key), median("llamacpp", key)
        print(
            f"{args.streams} streams, {key}: legato {ours:.1f}, llama.cpp {theirs:.1f},"
            f" ratio {ours / theirs:.2f}x"
        )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf_file", nargs="?", default=None)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--engine", choices=["legato", "llamacpp"], default=None)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2, help="timed runs per engine process")
    parser.add_argument("--reps", type=int, default=2, help="alternations of the two engines")
    parser.add_argument("--llamacpp-python", default=str(LLAMACPP_PYTHON))
    args = parser.parse_args()
    args.gguf = args.gguf or args.gguf_file
    if args.engine is None:
        compare(args)
        return
    rows = run_llamacpp(args) if args.engine == "llamacpp" else run_legato(args)
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
