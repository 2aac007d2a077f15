"""Logprobs: the sampler's ``TokenLogprobs`` become the caller's ``Logprob`` dicts.

Sample logprobs add to a completion (and its cumulative logprob), prompt
logprobs to its request (the first completion's only). Token texts come from
the processor's ``TokenTexts`` table. Never imports trio or torch.
"""

from __future__ import annotations

from collections.abc import Callable

from ..protocol.messages import TokenLogprobs
from ..protocol.outputs import Logprob
from .output_state import CompletionState, RequestState

TokenText = Callable[[int], "str | None"]
"""A single token's text (None without a tokenizer)."""


def logprob_dict(entry: TokenLogprobs, token_text: TokenText | None) -> dict[int, Logprob]:
    """One position's logprobs by token id; decoded where ``token_text`` is given."""
    return {
        token_id: Logprob(lp, rank, None if token_text is None else token_text(token_id))
        for token_id, lp, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)
    }


def add_logprobs(
    completion: CompletionState, entries: list[TokenLogprobs] | None, token_text: TokenText
) -> None:
    """Add a step's sample logprobs to ``completion`` (nothing unless it asked for them)."""
    if completion.cumulative_logprob is None or not entries:
        return
    decode = token_text if completion.parent.params.detokenize else None
    new = [logprob_dict(e, decode) for e in entries]
    completion.cumulative_logprob += sum(e.logprobs[0] for e in entries if e.logprobs)
    if completion.new_logprobs is None:
        completion.new_logprobs = []
    completion.new_logprobs.extend(new)
    if completion.logprobs is not None:
        completion.logprobs.extend(new)


def add_prompt_logprobs(
    request: RequestState, entries: list[TokenLogprobs | None], token_text: TokenText
) -> None:
    """Add prompt logprobs to ``request`` (nothing unless it asked for them)."""
    if request.params.prompt_logprobs is None:
        return
    decode = token_text if request.params.detokenize else None
    if request.prompt_logprobs is None:
        request.prompt_logprobs = []
    request.prompt_logprobs.extend(None if e is None else logprob_dict(e, decode) for e in entries)
