"""Accepting sampled tokens into a request, and the rules that stop it.

``check_stop`` says why a request stops after a token (EOS, a stop token id,
its length limit); ``accept_other`` takes a live request's answer other than
the common one-token case (a partial prefill chunk, a pooled vector, several
tokens). The scheduler's ``update_from_output`` handles the common case inline
and calls these for the rest. Pure Python; never imports torch or trio.
"""

from __future__ import annotations

from ..protocol.messages import FinishReason, ModelRunnerOutput
from .request_state import Request


def check_stop(req: Request, token_id: int) -> FinishReason | None:
    """Why the request stops after accepting ``token_id``, if it does.

    EOS (unless ``ignore_eos``) and stop token ids count only once
    ``min_tokens`` outputs exist; they win over a length limit reached by the
    same token. Sets ``req.stop_reason`` to a matched stop token id. Only a token in
    ``req.stopping_token_ids`` or reaching ``req.token_limit`` can stop it.
    """
    num_output = len(req.output_token_ids)
    if num_output >= req.min_tokens:
        if token_id == req.eos_token_id and not req.ignore_eos:
            return FinishReason.STOP
        if token_id in req.stop_token_ids:
            req.stop_reason = token_id
            return FinishReason.STOP
    if len(req.all_token_ids) >= req.token_limit:  # max_tokens, or max_model_len reached
        return FinishReason.LENGTH
    return None


def append_tokens(req: Request, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
    """Accept several sampled tokens, up to the first that stops the request."""
    new_ids: list[int] = []
    for token_id in tokens:
        req.append_output_token(token_id)
        new_ids.append(token_id)
        reason = check_stop(req, token_id)
        if reason is not None:
            return new_ids, reason
    return new_ids, None


def accept_other(
    req: Request, sampling: bool, tokens: list[int], runner_output: ModelRunnerOutput
) -> tuple[list[int], FinishReason | None, list[float] | None]:
    """A live request's answer other than one sampled token: a partial prefill chunk
    (nothing), a pooling request's vector (it finishes), or several tokens. Returns the
    accepted tokens, why it stops (if it does) and the pooled vector. A runner that
    left out what it owed raises ValueError."""
    request_id = req.request_id
    if not sampling:
        return [], None, None  # a partial prefill chunk samples nothing
    if req.pooling_params is not None:
        pooled = runner_output.pooled.get(request_id)
        if pooled is None:
            raise ValueError(f"model runner returned no pooled vector for {request_id!r}")
        return [], FinishReason.STOP, pooled
    if not tokens:
        raise ValueError(f"model runner returned no sampled token for {request_id!r}")
    new_ids, reason = append_tokens(req, tokens)
    req.num_tokens_sent += len(new_ids)
    return new_ids, reason, None
