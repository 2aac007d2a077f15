"""The engine-field renames of an error, and engine outputs -> OpenAI response objects.

Every body is parsed by its pydantic model alone (``openai_protocol``,
``responses_protocol``, ``messages_protocol``, ``utility_protocol``); the generation
models build their ``SamplingParams`` themselves. The response builders produce exactly OpenAI's shapes
(``id``, ``object``, ``created``, ``model``, ``choices``, ``usage``), plus vLLM's
``stop_reason`` per choice.

Pure code: never imports trio or torch.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..protocol.errors import ValidationError
from ..protocol.outputs import CompletionOutput, Logprob

DecodeToken = Callable[[int, Logprob | None], str]


# ------------------------------------------------------------------ errors


_REPR = reprlib.Repr()  # (keyword arguments need Python 3.12)
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 40


def show(value: object) -> str:
    """A short repr of a client's value for an error message (bounded in size and depth)."""
    return _REPR.repr(value)


def in_request_terms(exc: ValidationError, renames: Mapping[str, str]) -> ValidationError:
    """``exc`` naming the request's field (``renames``: engine field -> the request's)."""
    return exc.renamed(renames.get(exc.field, exc.field))


# ------------------------------------------------------------------ responses


@dataclass
class ChoiceState:
    """One choice accumulated over a request's DELTA outputs."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(
    token_ids: list[int],
    entries: list[dict[int, Logprob]],
    decode: DecodeToken,
    text_offset: int,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for the given positions."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries):
        sampled = entry.get(token_id)
        text = decode(token_id, sampled)
        tokens.append(text)
        token_logprobs.append(sampled.logprob if sampled is not None else None)
        top.append({decode(tid, lp): lp.logprob for tid, lp in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: list[int],
    entries: list[dict[int, Logprob]],
    decode: DecodeToken,
    top_k: int,
) -> dict[str, Any]:
    """The chat ``logprobs`` object (``content`` per token, each with its ``top_logprobs``)."""

    def item(token_id: int, lp: Logprob | None) -> dict[str, Any]:
        text = decode(token_id, lp)
        return {
            "token": text,
            "logprob": lp.logprob if lp is not None else None,
            "bytes": list(text.encode("utf-8")),
        }

    content = []
    for token_id, entry in zip(token_ids, entries):
        if any(lp.rank is not None for lp in entry.values()):
            ranked = sorted(
                (
                    (tid, lp)
                    for tid, lp in entry.items()
                    if lp.rank is not None and lp.rank <= top_k
                ),
                key=lambda pair: pair[1].rank or 0,
            )
        else:  # no ranks reported: keep the engine's order
            ranked = list(entry.items())
        one = item(token_id, entry.get(token_id))
        one["top_logprobs"] = [item(tid, lp) for tid, lp in ranked[:top_k]]
        content.append(one)
    return {"content": content, "refusal": None}


def openai_object(
    kind: str,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage_: dict[str, int] | None = None,
    *,
    include_usage: bool = True,
) -> dict[str, Any]:
    """A response or streamed chunk: ``kind`` is its ``object`` ("text_completion",
    "chat.completion", "chat.completion.chunk"). Chunks carry ``usage`` only when
    the client asked for it (null until the last one)."""
    obj: dict[str, Any] = {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if include_usage:
        obj["usage"] = usage_
    obj["system_fingerprint"] = None
    return obj


def completion_choice(
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: Any,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_choice(
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: Any,
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text, "refusal": None, "tool_calls": []},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_delta_choice(
    index: int,
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: Any = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
