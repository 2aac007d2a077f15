"""Rendering without generating: vLLM's render endpoints, served by any ``EngineClient``
(a ``RenderOnlyClient`` included, which has no model).

- ``POST /v1/chat/completions/render``: a chat completions body, rendered as the chat
  endpoint would render it (the template, tools, ``tool_choice``, the request's own
  template when trusted) and checked as it would be (the sampling fields' ranges);
  the answer is vLLM's ``[conversation, engine_prompts]``: the messages as the
  template saw them and one ``{"prompt", "prompt_token_ids"}``.
- ``POST /v1/completions/render``: a completions body; one ``{"prompt",
  "prompt_token_ids"}`` per prompt given (text tokenized, token ids checked against
  the vocabulary and decoded).

Imports trio; never torch.
"""

from __future__ import annotations

from typing import Any

from ..protocol.errors import ValidationError
from . import openai_protocol as protocol
from .asgi import Request, send_json
from .chat_outputs import output_constraint
from .lora_routes import select_model
from .openai_protocol import parse_request
from .openai_schemas import in_request_terms
from .serving_chat import plan_and_render_chat
from .state import ServingState


async def render_chat_completion(request: Request, state: ServingState) -> None:
    """``POST /v1/chat/completions/render``: ``[conversation, [engine prompt]]``."""
    body = await request.json(state.settings.max_body_bytes)
    typed: protocol.ChatCompletionRequest = parse_request(protocol.ChatCompletionRequest, body)
    select_model(state, typed.model)
    _, _, rendered = await plan_and_render_chat(state, typed)
    conversation = [message.for_template() for message in typed.messages]
    prompt = {"prompt": rendered["prompt"], "prompt_token_ids": rendered["prompt_token_ids"]}
    await send_json(request.send, 200, [conversation, [prompt]])


async def render_completion(request: Request, state: ServingState) -> None:
    """``POST /v1/completions/render``: one engine prompt per prompt given."""
    body = await request.json(state.settings.max_body_bytes)
    typed: protocol.CompletionRequest = parse_request(protocol.CompletionRequest, body)
    select_model(state, typed.model)
    typed.to_sampling_params(
        max_n=state.settings.max_n, structured_outputs=output_constraint(typed)
    )
    engine = state.engine
    rendered: list[dict[str, Any]] = []
    for prompt in typed.prompts():
        if isinstance(prompt, str) or "prompt" in prompt:
            text = prompt if isinstance(prompt, str) else prompt["prompt"]
            ids = await engine.tokenize(text)
            rendered.append({"prompt": text, "prompt_token_ids": ids})
            continue
        ids = list(prompt["prompt_token_ids"])
        try:
            text = await engine.detokenize(ids, skip_special_tokens=False)
        except ValidationError as exc:
            raise in_request_terms(exc, typed.renames()) from None
        rendered.append({"prompt": text, "prompt_token_ids": ids})
    await send_json(request.send, 200, rendered)
