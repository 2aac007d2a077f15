"""What a caller receives: RequestOutput, CompletionOutput, Logprob, PoolingRequestOutput.

Shapes follow vLLM so consumers carry over: the same fields under the same names,
``RequestOutput.add``, ``CompletionOutput.lora_request``, ``PoolingOutput.data`` a
tensor, ``RequestOutput``'s positional order. Where legato still differs:
``RequestMetrics`` holds ``time.monotonic()`` seconds.

Never imports torch or trio.
"""

from __future__ import annotations

from collections.abc import MutableSequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from .params import LoRARequest


@dataclass
class Logprob:
    """One candidate token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the sampled token first, then the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic() seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    """One completion of a request (index < n)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    lora_request: LoRARequest | None = None  # the adapter it was generated through

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One step's report on a request; ``finished`` is True on the last one only.

    vLLM's fields in vLLM's positional order: ``lora_request`` is the adapter the request ran through;
    the encoder-prompt fields and ``multi_modal_placeholders`` stay empty
    (legato serves decoder-only text models); ``kv_transfer_params`` stays
    None (no KV connector).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    lora_request: LoRARequest | None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int | None = None
    _: KW_ONLY
    multi_modal_placeholders: dict[str, Any] = field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one, as vLLM's ``add``.

        ``aggregate``: append each completion's new text, token ids and
        logprobs to the one of the same index (DELTA outputs); otherwise
        replace it (CUMULATIVE). A completion of a new index is appended. The
        finish fields and cumulative logprob of ``next_output`` win.
        """
        self.finished |= next_output.finished
        self.kv_transfer_params = next_output.kv_transfer_params
        for following in next_output.outputs:
            for i, completion in enumerate(self.outputs):
                if completion.index != following.index:
                    continue
                if aggregate:
                    completion.text += following.text
                    if not isinstance(completion.token_ids, MutableSequence):
                        completion.token_ids = list(completion.token_ids)
                    completion.token_ids.extend(following.token_ids)
                    if following.logprobs:
                        completion.logprobs = (completion.logprobs or []) + following.logprobs
                    completion.cumulative_logprob = following.cumulative_logprob
                    completion.finish_reason = following.finish_reason
                    completion.stop_reason = following.stop_reason
                else:
                    self.outputs[i] = following
                break
            else:
                self.outputs.append(following)


@dataclass
class PoolingOutput:
    """A pooled vector. ``data`` is a 1-D float32 ``torch.Tensor``, as vLLM's, when the
    engine builds it. The wire carries no torch: a PoolingOutput crosses it with
    ``data`` a list of floats (``embedding``), and is decoded so."""

    data: Any = field(default_factory=list)

    @property
    def embedding(self) -> list[float]:
        """The vector as a list of floats, as vLLM's EmbeddingOutput gives it."""
        tolist = getattr(self.data, "tolist", None)
        return [float(x) for x in (tolist() if callable(tolist) else self.data)]


@dataclass
class PoolingRequestOutput:
    """The result of an ``encode`` request; vLLM's positional order."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
