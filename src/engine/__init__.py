"""The EngineClient facade over the actors: ``open_engine``, ``AsyncEngine``, ``RequestStream``.

``open_engine`` is an async context manager: it loads the model (in a worker
process by default), starts the actors in a nursery of its own under a
``Supervisor``, yields an ``AsyncEngine``, and on exit shuts everything down and
reaps the worker. The engine's death never cancels the caller's tasks; the
caller learns of it from the calls it makes (``EngineDeadError``).

A request's life, as the caller sees it::

    async with engine.generate(prompt, params, "r1") as stream:   # the safe form
        async for output in stream:
            ...

Leaving the ``async with``, cancelling the surrounding scope, ``aclose()`` or
breaking out of ``async for`` aborts the request: its KV blocks are freed
within one engine step and nothing more is computed for it.

Modules, by idea: ``async_engine`` (the engine, its start-up, requests and
health; ``open_engine``), ``controls`` (pause, sleep, caches, LoRA, profiler,
``collective_rpc``), ``request_stream`` (one request's outputs),
``request_checks`` (``generate``'s argument checks) and ``wiring`` (the
resolved model, the executor). The package never imports models, the worker
side or torch at import time.
"""

from .async_engine import AsyncEngine, open_engine
from .request_stream import RequestStream
from .wiring import make_executor, resolve_model

__all__ = ["AsyncEngine", "RequestStream", "make_executor", "open_engine", "resolve_model"]
