"""The ``legato`` command: demo | generate | toy-model | bench (serve comes with the server).

Engine arguments use vLLM's flag names (``--max-model-len``, ``--dtype``, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per EngineConfig field (except ``model``, a positional)."""
    from .config import EngineConfig

    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineConfig):
        if field.name == "model":
            continue
        flag = "--" + field.name.replace("_", "-")
        default = field.default
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(default, int | float) and not isinstance(default, bool):
            group.add_argument(flag, type=type(default), default=default)
        elif field.name in ("max_model_len", "num_kv_blocks", "kv_cache_memory"):
            group.add_argument(flag, type=int, default=None)
        else:
            group.add_argument(flag, default=default)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from .config import EngineConfig

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"}


def cmd_toy_model(args: argparse.Namespace) -> int:
    from .toy_model import build_toy_model, describe

    path = build_toy_model(args.dir, seed=args.seed)
    print(describe(path))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Build (once) and describe the embedded toy model, round-trip text, generate."""
    import trio

    from .actors.renderer import load_tokenizer
    from .toy_model import default_toy_model_dir, describe

    started = time.monotonic()
    path = default_toy_model_dir()
    print(describe(path))
    tokenizer = load_tokenizer(str(path))
    text = "héllo 世界 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    back = tokenizer.decode(ids)
    print(f"tokenizer round trip: {text!r} -> {ids} -> {back!r} ({'ok' if back == text else 'MISMATCH'})")
    kwargs = engine_kwargs(args)
    trio.run(_stream_generate, str(path), args.prompt, args.max_tokens, 0.0, kwargs)
    print(f"done in {time.monotonic() - started:.1f} s")
    return 0 if back == text else 1


async def _stream_generate(
    model: str | None, prompt: str, max_tokens: int, temperature: float, kwargs: dict[str, Any]
) -> None:
    from .engine import open_engine
    from .protocol.params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, output_kind=RequestOutputKind.DELTA
    )
    async with open_engine(model, **kwargs) as engine:
        print(f"prompt: {prompt!r}\ncompletion: ", end="", flush=True)
        async with engine.generate(prompt, params, "cli") as stream:
            async for out in stream:
                print(out.outputs[0].text, end="", flush=True)
                reason = out.outputs[0].finish_reason
        print(f"\n[finish_reason={reason}]")


def cmd_generate(args: argparse.Namespace) -> int:
    import trio

    trio.run(_stream_generate, args.model, args.prompt, args.max_tokens, args.temperature, engine_kwargs(args))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="legato", description="trio-native LLM inference engine")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    toy = sub.add_parser("toy-model", help="build the deterministic toy checkpoint into DIR")
    toy.add_argument("dir")
    toy.add_argument("--seed", type=int, default=0)
    toy.set_defaults(func=cmd_toy_model)

    demo = sub.add_parser("demo", help="describe the toy model, round-trip text, generate a little")
    demo.add_argument("--prompt", default="Once upon a time")
    demo.add_argument("--max-tokens", type=int, default=16)
    add_engine_args(demo)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="local HF model dir (default: the toy model)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
