"""A FastAPI app that embeds a legato engine (``legato.aio``) and streams tokens as SSE.

The engine lives in the app's lifespan: it starts before the first request and
shuts down (worker reaped) when the server stops. ``POST /generate`` streams
``data: {"text": ..., "token_ids": [...]}`` events, then ``data: [DONE]``. A
client that disconnects mid-stream aborts its request (the engine frees its KV
blocks within a step). A dead engine answers 503, from ``/generate`` and
``/health`` alike; bad input answers 400 naming the field.

    pip install 'legato[fastapi]'
    python examples/fastapi_app.py --model toy --port 8000
    curl -N localhost:8000/generate -d '{"prompt": "Hello", "max_tokens": 16}' \\
        -H 'content-type: application/json'
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

import legato.aio
from legato import EngineDeadError, RequestOutputKind, SamplingParams, ValidationError


class GenerateBody(BaseModel):
    prompt: str = Field(max_length=100_000)
    max_tokens: int = Field(16, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0.0)
    ignore_eos: bool = False


def create_app(model: str | None = None, **engine_args: Any) -> FastAPI:
    """The app, serving ``model`` (None: legato's default model) with ``engine_args``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with legato.aio.open_engine(model, **engine_args) as engine:
            app.state.engine = engine
            yield

    app = FastAPI(lifespan=lifespan)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> Response:
        return JSONResponse({"error": f"engine dead: {exc}"}, status_code=503)

    @app.exception_handler(ValidationError)
    async def bad_input(request: Request, exc: ValidationError) -> Response:
        return JSONResponse({"error": str(exc), "field": exc.field}, status_code=400)

    @app.get("/health")
    async def health(request: Request) -> dict[str, str]:
        await request.app.state.engine.check_health()  # EngineDeadError -> 503
        return {"status": "ok"}

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request) -> StreamingResponse:
        engine: legato.aio.AioEngine = request.app.state.engine
        params = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            ignore_eos=body.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )
        stream = engine.generate(body.prompt, params, f"fastapi-{uuid.uuid4().hex}")
        # Submit before the response starts, so that bad input and a dead engine get
        # their status codes (400, 503) rather than a 200 with an error event.
        await stream.__aenter__()

        async def events() -> AsyncIterator[str]:
            # Starlette cancels this generator (or closes it) when the client goes:
            # either way the stream is aborted on the way out.
            async with stream:
                try:
                    async for out in stream:
                        completion = out.outputs[0]
                        event = {"text": completion.text, "token_ids": completion.token_ids}
                        if out.finished:
                            event["finish_reason"] = completion.finish_reason
                        yield f"data: {json.dumps(event)}\n\n"
                except EngineDeadError as exc:  # died mid-stream: the status is already 200
                    yield f"data: {json.dumps({'error': f'engine dead: {exc}'})}\n\n"
                    return
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="checkpoint dir, .gguf, or 'toy'")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(create_app(args.model), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
