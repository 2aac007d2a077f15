"""``merge_delta_outputs``: several DELTA outputs of one request folded into one, for a
consumer that took them late (the trio ``OutputSlot`` and the asyncio stream both use it).

Pure; never imports trio or torch.
"""

from __future__ import annotations

import itertools

from ..protocol.outputs import CompletionOutput, RequestOutput


def merge_delta_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """One DELTA output equivalent to ``outputs`` (oldest first) delivered in turn.

    Completions are concatenated per index (sorted by index); the finish info,
    cumulative logprob, ``finished`` and metrics of the newest win; prompt
    logprobs come from the first output that carries them.
    """
    first, last = outputs[0], outputs[-1]
    by_index: dict[int, list[CompletionOutput]] = {}
    for output in outputs:
        for completion in output.outputs:
            by_index.setdefault(completion.index, []).append(completion)
    return RequestOutput(
        request_id=last.request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        prompt_logprobs=next(
            (o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None
        ),
        outputs=[_merge_completions(by_index[i]) for i in sorted(by_index)],
        finished=last.finished,
        num_cached_tokens=last.num_cached_tokens,
        metrics=last.metrics,
    )


def _merge_completions(parts: list[CompletionOutput]) -> CompletionOutput:
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    has_logprobs = any(p.logprobs is not None for p in parts)
    return CompletionOutput(
        index=last.index,
        text="".join(p.text for p in parts),
        token_ids=list(itertools.chain.from_iterable(p.token_ids for p in parts)),
        cumulative_logprob=last.cumulative_logprob,
        logprobs=(
            list(itertools.chain.from_iterable(p.logprobs or () for p in parts))
            if has_logprobs
            else None
        ),
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
    )
