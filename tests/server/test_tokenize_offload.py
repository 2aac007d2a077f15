"""``/tokenize`` and ``/detokenize`` on large inputs run in a worker thread (F16), as
generation's large prompts do: a held tokenizer there leaves the server answering."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import trio

from legato.actors.frontend import INLINE_MAX_PROMPT_CHARS
from legato.engine import AsyncEngine

from .conftest import MODEL, serving


async def test_a_large_tokenize_runs_off_the_event_loop(
    engine: AsyncEngine, held_tokenizer: Any
) -> None:
    """The held tokenizer raises on the event-loop thread, so an inline encode fails."""
    text = "the " * 1100
    assert len(text) > INLINE_MAX_PROMPT_CHARS
    async with (
        serving(engine) as server,
        httpx.AsyncClient(base_url=server.http_url, timeout=30) as client,
    ):
        twin = copy.copy(engine.renderer)
        twin.tokenizer = held_tokenizer
        engine.frontend.offload_renderer = twin  # the engine's thread tokenizes large texts
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await client.post("/tokenize", json={"model": MODEL, "prompt": text}))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            with trio.fail_after(30):
                await held_tokenizer.entered.wait()
            small = await client.post("/tokenize", json={"model": MODEL, "prompt": "hello"})
            assert small.status_code == 200 and small.json()["count"] >= 1
            assert (await client.get("/health")).status_code == 200
            assert not answers  # still tokenizing in its thread
            held_tokenizer.release.set()
        (answer,) = answers
        assert answer.status_code == 200, answer.text
        assert answer.json()["tokens"] == engine.renderer.encode(text)
        ids = answer.json()["tokens"] * 3
        back = await client.post("/detokenize", json={"model": MODEL, "tokens": ids})
        assert back.status_code == 200 and back.json()["prompt"] == engine.renderer.decode(ids)
