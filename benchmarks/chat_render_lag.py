"""How long a large chat stalls the event loop while its template renders.

Renders one chat of ``--chars`` characters with the toy model's tokenizer two
ways, alternated in one run: the server's old path (``Renderer.render_chat_prompt``
called on the event loop) and ``AsyncEngine.render_chat_prompt`` (a worker thread
for a large chat). A ticker task sleeping 1 ms measures the longest the loop
went without running it: what every other stream waits for meanwhile.

    python benchmarks/chat_render_lag.py --chars 400000 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Awaitable, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


async def worst_gap_while(render: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """The longest gap between a 1 ms ticker's wake-ups while ``render`` runs, and its time."""
    import trio

    worst = 0.0
    done = trio.Event()

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done.is_set():
            await trio.sleep(0.001)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0.01)
        start = time.perf_counter()
        await render()
        took = time.perf_counter() - start
        done.set()
    return worst, took


async def run(chars: int, rounds: int) -> None:
    import torch
    import trio

    from legato.engine import open_engine
    from legato.toy_model import default_toy_model_dir

    chat = [{"role": "user", "content": ("the " * (chars // 4 + 1))[:chars]}]
    model = str(default_toy_model_dir())
    async with open_engine(model, executor="inproc", disable_log_stats=True) as engine:

        async def on_the_loop() -> None:
            engine.renderer.render_chat_prompt(chat)
            await trio.lowlevel.checkpoint()

        async def through_the_engine() -> None:
            await engine.render_chat_prompt(chat)

        print(f"CPU: {torch.backends.cpu.get_cpu_capability()}; a chat of {chars:,} characters")
        print(f"{'round':>5} | {'path':<32} | {'worst loop gap ms':>17} | {'render ms':>9}")
        for i in range(rounds):
            for name, render in (
                ("on the event loop (before)", on_the_loop),
                ("AsyncEngine.render_chat_prompt", through_the_engine),
            ):
                gap, took = await worst_gap_while(render)
                print(f"{i:>5} | {name:<32} | {gap * 1e3:>17.1f} | {took * 1e3:>9.1f}")


def main() -> None:
    import trio

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chars", type=int, default=400_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trio.run(run, args.chars, args.rounds)


if __name__ == "__main__":
    main()
