"""The OpenAI-compatible companions of the generation endpoints: /v1/models, /health,
/metrics, /version, /tokenize and /detokenize.

Each handler takes the ``Request`` and the ``ServingState`` and answers through the
``asgi`` helpers. Handlers raise ``HTTPError``, ``ValidationError``, ``Unavailable`` or
``EngineDeadError``; the router in ``legato.server.http`` turns them into OpenAI error
bodies. The generation endpoints are serving classes (``serving_completion``,
``serving_chat``, ``serving_responses``, ``serving_messages``).

Imports trio; never torch.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from ..protocol.errors import EngineDeadError, ValidationError
from .asgi import Request, send_body, send_json
from .lora_routes import adapter_cards, select_model
from .openai_protocol import parse_request
from .state import ServingState, Unavailable
from .utility_protocol import DetokenizeRequest, TokenizeRequest


def check_model(state: ServingState, model: str | None) -> None:
    """404 ``model_not_found`` unless ``model`` is None or a name this server serves
    (the model's, or a LoRA adapter's)."""
    select_model(state, model)


async def list_models(request: Request, state: ServingState) -> None:
    """``GET /v1/models``: the served model, then its LoRA adapters."""
    card = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "legato",
        "root": state.engine.model_info().name,
        "parent": None,
        "max_model_len": state.engine.model_info().max_model_len,
    }
    await send_json(request.send, 200, {"object": "list", "data": [card, *adapter_cards(state)]})


async def health(request: Request, state: ServingState) -> None:
    """``GET /health``: 200 while serving; 503 while the server drains or the engine is
    dead or restarting."""
    state.check_available()
    try:
        await state.engine.check_health()
    except EngineDeadError as exc:
        state.check_available()  # died just now: engine_restarting if supervised
        raise Unavailable("engine_dead", f"the engine is dead: {exc}") from None
    await send_json(request.send, 200, {"status": "ok"})


async def metrics(request: Request, state: ServingState) -> None:
    """``GET /metrics``: the engine's Prometheus metrics."""
    await send_body(request.send, 200, state.engine.metrics_text(), CONTENT_TYPE_LATEST)


async def version(request: Request, state: ServingState) -> None:
    """``GET /version``."""
    await send_json(request.send, 200, {"version": __version__})


async def tokenize(request: Request, state: ServingState) -> None:
    """``POST /tokenize``: ``{"prompt"}`` or ``{"messages"}`` -> tokens, count, max_model_len."""
    body = await request.json(state.settings.max_body_bytes)
    typed: TokenizeRequest = parse_request(TokenizeRequest, body)
    check_model(state, typed.model)
    messages = typed.chat()
    if messages is not None:
        rendered = await state.engine.render_chat_prompt(
            messages, add_generation_prompt=typed.add_generation_prompt is not False
        )
        tokens = rendered["prompt_token_ids"]
    else:
        assert typed.prompt is not None
        tokens = await state.engine.tokenize(
            typed.prompt, add_special_tokens=typed.add_special_tokens is not False
        )
    result = {
        "tokens": tokens,
        "count": len(tokens),
        "max_model_len": state.engine.model_info().max_model_len,
    }
    await send_json(request.send, 200, result)


async def detokenize(request: Request, state: ServingState) -> None:
    """``POST /detokenize``: ``{"tokens"}`` -> ``{"prompt"}``."""
    body = await request.json(state.settings.max_body_bytes)
    typed: DetokenizeRequest = parse_request(DetokenizeRequest, body)
    check_model(state, typed.model)
    try:
        text = await state.engine.detokenize(typed.tokens)
    except ValidationError as exc:
        raise exc.renamed("tokens") from None
    await send_json(request.send, 200, {"prompt": text})
