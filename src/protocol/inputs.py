"""``EngineCoreRequest``: a prompt already processed for the engine, under vLLM's names.

vLLM code builds one with ``engine.input_processor.process_inputs(...)`` and passes it
to ``generate`` / ``add_request`` in place of a prompt; legato's input processor
(``legato.frontend.input_processor``) builds this one, and both entry points take it.
It is the caller-facing form: legato's scheduler runs its own ``EngineRequest``
(``protocol.messages``), built from this by the renderer with every check applied
again, so a hand-built request cannot skip validation.

Fields vLLM has that legato cannot act on stay at their empty value and are refused
by name if set: ``mm_features`` (multimodal), ``prompt_embeds``.

Never imports torch or trio.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .params import LoRARequest, PoolingParams, SamplingParams


@dataclass
class EngineCoreRequest:
    """vLLM's ``EngineCoreRequest`` fields (``prompt`` is legato's: the prompt's text,
    which the outputs report, when it was rendered from text)."""

    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: list[Any] | None
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
    eos_token_id: int | None
    arrival_time: float
    lora_request: LoRARequest | None
    cache_salt: str | None
    data_parallel_rank: int | None
    prompt_embeds: Any = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: Mapping[str, str] | None = None
    external_req_id: str | None = None
    prompt: str | None = None

    @property
    def params(self) -> SamplingParams | PoolingParams:
        """The sampling or pooling parameters, as vLLM's property."""
        params = self.sampling_params if self.sampling_params is not None else self.pooling_params
        if params is None:
            raise ValueError("EngineCoreRequest: neither sampling_params nor pooling_params")
        return params
