"""The checks ``AsyncEngine.generate`` and ``encode`` make before a stream exists.

Each bad argument raises ``ValidationError`` naming it, at once and for that
call alone; what passes becomes a ``StreamRequest``. Synchronous, cheap (no
rendering: that happens on submission). Never imports the actors, models or
torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..frontend.renderer import PromptType, check_tokenization_kwargs
from ..protocol.errors import ValidationError
from ..protocol.params import PoolingParams, SamplingParams, check_lora_request
from .request_stream import StreamRequest


def check_request(
    prompt: PromptType,
    sampling_params: object,
    *,
    scheduling_policy: str,
    lora_request: object = None,
    prompt_adapter_request: object = None,
    priority: object = 0,
    prompt_text: object = None,
    tokenization_kwargs: dict[str, Any] | None = None,
    data_parallel_rank: object = None,
    reasoning_ended: object = None,
    reasoning_parser_kwargs: object = None,
    pooling_params: PoolingParams | None = None,
) -> StreamRequest:
    """``generate``'s arguments, checked, as the request a stream submits."""
    check_vllm_extras(prompt, priority, scheduling_policy)
    assert isinstance(priority, int)  # check_vllm_extras made sure
    if prompt_adapter_request is not None:
        raise ValidationError("prompt_adapter_request", "prompt adapters are not supported")
    if reasoning_ended is not None and not isinstance(reasoning_ended, bool):
        raise ValidationError(
            "reasoning_ended", f"must be a bool, got {type(reasoning_ended).__name__}"
        )
    if reasoning_parser_kwargs is not None and not isinstance(reasoning_parser_kwargs, dict):
        raise ValidationError(
            "reasoning_parser_kwargs",
            f"must be a dict, got {type(reasoning_parser_kwargs).__name__}",
        )
    lora = None if lora_request is None else check_lora_request(lora_request)
    if data_parallel_rank not in (None, 0):
        raise ValidationError(
            "data_parallel_rank", f"this engine has one core, got {data_parallel_rank}"
        )
    params = sampling_params if sampling_params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValidationError(
            "sampling_params", f"must be SamplingParams, got {type(params).__name__}"
        )
    kwargs = check_tokenization_kwargs(tokenization_kwargs) or None
    if prompt_text is not None and not isinstance(prompt_text, str):
        raise ValidationError("prompt_text", f"must be a string, got {type(prompt_text).__name__}")
    return StreamRequest(
        prompt,
        params,
        priority,
        lora_request=lora,
        pooling_params=pooling_params,
        tokenization_kwargs=kwargs,
        prompt_text=prompt_text,
    )


def check_pooling_params(params: object) -> PoolingParams:
    """``params`` if they are PoolingParams; else ValidationError naming the field."""
    if not isinstance(params, PoolingParams):
        raise ValidationError(
            "pooling_params", f"must be PoolingParams, got {type(params).__name__}"
        )
    return params


def check_vllm_extras(prompt: object, priority: object, policy: str) -> None:
    """Refuse, as vLLM does, what a text-only, fcfs engine cannot honour (ValidationError)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValidationError("priority", f"must be an integer, got {type(priority).__name__}")
    if priority != 0 and policy != "priority":
        raise ValidationError(
            "priority",
            f"got {priority}, but priority scheduling is not enabled "
            "(scheduling_policy='priority')",
        )
    if isinstance(prompt, Mapping):
        for key in ("multi_modal_data", "mm_processor_kwargs"):
            if prompt.get(key):
                raise ValidationError(
                    f"prompt.{key}",
                    "multimodal inputs are not supported: legato serves text-only models",
                )
