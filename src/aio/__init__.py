"""legato.aio: the engine for asyncio code (FastAPI, aiohttp, Ray Serve ...).

``open_engine`` here is an asyncio ``async with`` that yields ``AioEngine``, an
``EngineClient`` with the trio engine's methods and contract, spelled for
asyncio::

    async with legato.aio.open_engine(model="toy") as engine:
        async with engine.generate("Hello", SamplingParams(max_tokens=8), "r1") as stream:
            async for out in stream:
                ...

How: the trio engine (``legato.engine.open_engine``) runs in a thread of its
own, one ``trio.run`` per engine. Calls cross into it with
``TrioToken.run_sync_soon``; answers and stream outputs cross back through one
outbox that the event loop drains with a single ``call_soon_threadsafe`` per
batch (one engine step's outputs for every stream arrive together). Each asyncio
stream is served by one trio task that iterates the trio ``RequestStream``, so
everything the trio engine promises holds: cancelling the asyncio task that
waits on a stream cancels that trio task, which aborts the request within one
engine step; a dead engine ends every stream with its ``EngineDeadError``.
The app's event loop never runs engine work, and an app that blocks its loop
for a while does not stall the engine (or trip its heartbeat).

Shutdown: leaving ``open_engine`` (also by cancellation, as ``asyncio.run``
does to tasks still open when its main coroutine returns) shuts the engine
down, ends open streams with EngineDeadError and reaps the worker. If the event
loop is closed while the engine is still open, the engine thread notices
(within a second, or at once when it next has output) and shuts down by itself;
an engine still open at interpreter exit is shut down by an ``atexit`` hook.

The only module of legato that imports asyncio; never imports torch.
"""

from __future__ import annotations

from .engine import AioEngine, AioStream, open_engine

__all__ = ["AioEngine", "AioStream", "open_engine"]
