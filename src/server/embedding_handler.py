"""``POST /v1/embeddings``: each input pooled by the engine's ``encode``, in one response.

The body is parsed by :mod:`legato.server.embeddings` (OpenAI's shape);
``model`` may name a LoRA adapter (:func:`legato.server.lora_routes.select_model`).
Every input is one engine request, all submitted at once, so they share
the scheduler with each other and with generation. A bad input is a 400
naming the field (``input`` for a prompt the engine refuses) and no vector
is returned; a client that disconnects aborts every request of its body.

Imports trio; never torch.
"""

from __future__ import annotations

import uuid
from typing import cast

import trio

from ..protocol.client import PromptType
from ..protocol.errors import ValidationError
from ..protocol.params import LoRARequest, PoolingParams
from .asgi import Request, send_json
from .embeddings import embedding_response, parse_embedding_request
from .lora_routes import select_model
from .openai_protocol import PromptInput
from .openai_schemas import in_request_terms
from .serving_base import until_disconnect
from .state import ServingState, Unavailable

_RENAMES = {"prompt_token_ids": "input", "prompt": "input"}
"""Engine field -> the request's name for it."""


async def create_embeddings(request: Request, state: ServingState) -> None:
    """``POST /v1/embeddings``."""
    state.check_available()
    state.check_generates()
    body = await request.json(state.settings.max_body_bytes)
    parsed = parse_embedding_request(body, hidden_size=await state.engine.embedding_size())
    lora = select_model(state, parsed.model)
    request_id = f"embd-{uuid.uuid4().hex}"
    engine_ids = [f"{request_id}-{i}" for i in range(len(parsed.inputs))]
    kwargs = {"add_special_tokens": parsed.add_special_tokens}

    async def embed_all() -> tuple[list[list[float]], int]:
        return await embed_inputs(
            state, parsed.inputs, parsed.params, engine_ids, lora, kwargs, parsed.priority
        )

    with state.track(request_id, engine_ids) as live:
        vectors, prompt_tokens = await until_disconnect(request.receive, embed_all)
    if live.scope.cancelled_caught:
        raise Unavailable("shutting_down", "the server shut down before the embeddings were done")
    model = lora.lora_name if lora is not None else state.model_name
    response = embedding_response(model, vectors, prompt_tokens, parsed.encoding_format)
    await send_json(request.send, 200, response)


async def embed_inputs(
    state: ServingState,
    inputs: list[PromptInput],
    params: PoolingParams,
    engine_ids: list[str],
    lora: LoRARequest | None,
    tokenization_kwargs: dict[str, bool],
    priority: int,
) -> tuple[list[list[float]], int]:
    """Every input's vector (in order) and the prompt tokens in all; the first error
    (in input order) is raised as it is, and the other requests are aborted."""
    vectors: list[list[float]] = [[] for _ in inputs]
    tokens = [0] * len(inputs)
    errors: dict[int, Exception] = {}
    engine = state.engine

    async def one(i: int, cancel: trio.CancelScope) -> None:
        kwargs = tokenization_kwargs if isinstance(inputs[i], str) else None
        try:
            async for out in engine.encode(
                cast("PromptType", inputs[i]), params, engine_ids[i], lora, priority=priority,
                tokenization_kwargs=kwargs,
            ):  # fmt: skip
                vectors[i] = out.outputs.embedding
                tokens[i] = len(out.prompt_token_ids)
            if not vectors[i]:  # aborted (a shutdown past its grace period)
                raise Unavailable("shutting_down", "the request was aborted")
        except ValidationError as exc:
            errors[i] = in_request_terms(exc, _RENAMES)
            cancel.cancel()
        except Exception as exc:
            errors[i] = exc
            cancel.cancel()

    async with trio.open_nursery() as nursery:
        for i in range(len(inputs)):
            nursery.start_soon(one, i, nursery.cancel_scope)
    if errors:
        raise errors[min(errors)]
    return vectors, sum(tokens)
