"""Embed the engine in a trio app: concurrent streams, the ``async with`` form, a cancel scope.

    python examples/embed_in_trio_app.py            # the embedded SmolLM2-135M-Instruct
    python examples/embed_in_trio_app.py toy        # the tiny toy model (gibberish, fast)
    python examples/embed_in_trio_app.py MODEL      # a local HF checkpoint dir or .gguf file

The engine lives inside ``open_engine``'s ``async with``; every request's
stream lives inside its own ``async with engine.generate(...)``. Leaving that
block for any reason (finishing, ``break``, an exception, a cancelled scope)
aborts the request and frees its KV-cache blocks within one engine step.
"""

from __future__ import annotations

import sys

import trio

from legato import RequestOutputKind, SamplingParams, open_engine
from legato.engine import AsyncEngine


async def stream_one(engine: AsyncEngine, name: str, prompt: str, max_tokens: int) -> str:
    """Generate one completion, collecting its DELTA outputs."""
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )
    text = ""
    async with engine.generate(prompt, params, request_id=name) as stream:
        async for output in stream:
            text += output.outputs[0].text
            if output.finished:
                print(f"[{name}] finished ({output.outputs[0].finish_reason}): {text!r}")
    return text


async def main(model: str | None) -> None:
    async with open_engine(model, executor="inproc") as engine:
        # Several requests at once: the engine batches them continuously.
        async with trio.open_nursery() as nursery:
            for i, prompt in enumerate(["Once upon a time", "The weather today", "In a galaxy"]):
                nursery.start_soon(stream_one, engine, f"story-{i}", prompt, 24)

        # A deadline on a request is just a cancel scope: when it expires the
        # request is aborted (cancellation is never an error).
        with trio.move_on_after(0.05) as scope:
            await stream_one(engine, "impatient", "A very long story begins", 400)
        if scope.cancelled_caught:
            print("[impatient] cut off by its deadline; its KV blocks are freed")

        # Health, as a server would check it.
        await engine.check_health()
        print(f"engine healthy: {engine.is_running}; model: {engine.model_name}")


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else None)
