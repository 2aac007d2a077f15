"""``InputProcessor``: vLLM's input-processor object over legato's Renderer.

vLLM code reaches for ``engine.input_processor.process_inputs(...)`` to turn a prompt
into an ``EngineCoreRequest`` ahead of ``generate`` / ``add_request``, and, in the older
``get_input_preprocessor()`` form, for ``preprocess(prompt)`` and ``get_tokenizer()``.
This class gives it those names over the Renderer every legato engine renders with,
so the request it builds is tokenized exactly as the engine would tokenize the prompt.

Where legato differs: the request is validated (against the vocabulary, the length
limits, the sampling checks) again when the engine takes it, not here; multimodal and
embedding prompts are refused by name; ``trace_headers`` are kept, unused (no tracing).

Never imports trio or torch.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from ..protocol.errors import ValidationError
from ..protocol.inputs import EngineCoreRequest
from ..protocol.params import LoRARequest, PoolingParams, SamplingParams
from .renderer import PromptType, Renderer


class InputProcessor:
    """``process_inputs`` and ``assign_request_id`` as vLLM's; ``preprocess`` and
    ``get_tokenizer`` as vLLM's older InputPreprocessor. Blocks while tokenizing (a
    prompt's length); call it off the event loop for long prompts."""

    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer

    @property
    def tokenizer(self) -> Any:
        return self.renderer.tokenizer

    def get_tokenizer(self) -> Any:
        return self.renderer.tokenizer

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType | EngineCoreRequest,
        params: SamplingParams | PoolingParams,
        supported_tasks: Iterable[str] | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
    ) -> EngineCoreRequest:
        """The prompt rendered into an EngineCoreRequest (vLLM's signature). Raises
        ValidationError naming the field (the prompt, a task the engine does not
        serve, a data-parallel rank other than 0)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        pooling = isinstance(params, PoolingParams)
        if not pooling and not isinstance(params, SamplingParams):
            raise ValidationError(
                "params", f"must be SamplingParams or PoolingParams, got {type(params).__name__}"
            )
        if supported_tasks is not None:
            task = params.task if isinstance(params, PoolingParams) else "generate"
            if task not in set(supported_tasks):
                raise ValidationError("params", f"task {task!r} is not supported by this engine")
        if data_parallel_rank not in (None, 0):
            raise ValidationError("data_parallel_rank", "legato runs one engine core (rank 0)")
        rendered = self.renderer.render_prompt(prompt, tokenization_kwargs=tokenization_kwargs)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=rendered.token_ids,
            mm_features=None,
            sampling_params=None if isinstance(params, PoolingParams) else params,
            pooling_params=params if isinstance(params, PoolingParams) else None,
            eos_token_id=self.renderer.eos_token_id,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            lora_request=lora_request,
            cache_salt=rendered.cache_salt,
            data_parallel_rank=data_parallel_rank,
            priority=priority,
            trace_headers=trace_headers,
            prompt=rendered.text,
        )

    def assign_request_id(self, request: EngineCoreRequest) -> None:
        """vLLM's: keep the caller's id as ``external_req_id`` and give the request an
        internal one, the caller's plus an 8-character random suffix."""
        if request.external_req_id is None:
            request.external_req_id = request.request_id
        request.request_id = f"{request.external_req_id}-{uuid.uuid4().hex[:8]}"

    def preprocess(
        self,
        prompt: PromptType,
        tokenization_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> dict[str, Any]:
        """vLLM's older ``InputPreprocessor.preprocess``: the prompt as a token input,
        ``{"type": "token", "prompt_token_ids": [...], "prompt": text}`` (and
        ``cache_salt`` if it asks for one)."""
        rendered = self.renderer.render_prompt(prompt, tokenization_kwargs=tokenization_kwargs)
        out: dict[str, Any] = {"type": "token", "prompt_token_ids": rendered.token_ids}
        if rendered.text is not None:
            out["prompt"] = rendered.text
        if rendered.cache_salt is not None:
            out["cache_salt"] = rendered.cache_salt
        return out
