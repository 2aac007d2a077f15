"""Verifying speculative drafts: one step's target rows in, accepted tokens out.

A request verified with drafts ``d_0..d_{k-1}`` has ``k + 1`` target rows:
row ``j`` is the model's distribution for the token after the drafts
``d_0..d_{j-1}``, processed exactly as :func:`~legato.models.sampler.sample`
processes one row (bitmask, bans, bias, penalties counted with the drafts before
it, temperature, min_p, top-k / top-p). The output is the accepted drafts
followed by one more token, so every step yields between 1 and ``k + 1``:

* greedy rows accept ``d_j`` while it is the row's argmax, then take the argmax
  of the first row that disagrees (or of row ``k``): the tokens greedy decoding
  without drafts would give.
* random rows use rejection sampling (Leviathan et al., 2023): accept ``d_j``
  with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection draw
  from the normalised residual ``(p_j - q_j)^+``; if every draft is accepted, draw
  the bonus token from ``p_k``. Each emitted token is then distributed exactly as
  ``p`` (the target), whatever the drafts, provided ``d_j`` was drawn from ``q_j``.
  ``q`` is a point mass unless given (``draft_probs``: a draft model's sampled
  drafts): then the test is ``u < p_j(d_j)`` and the residual ``p_j`` without
  ``d_j``, as for the n-gram proposer's drafts.

Seeded rows draw from their own generator (seeded per output position), others
from the engine's.

Never imports trio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..protocol.messages import TokenLogprobs
from .sampler import SamplingMetadata, greedy, process_logits, random_sample, sampling_probs


@dataclass(slots=True)
class Verified:
    """Per verified request (in the order given): its emitted tokens (accepted drafts,
    then one more), and their logprobs for the requests that asked (by index)."""

    tokens: list[list[int]]
    logprobs: dict[int, list[TokenLogprobs]]


def verify(
    logits: torch.Tensor,
    md: SamplingMetadata,
    drafts: list[list[int]],
    draft_probs: torch.Tensor | None = None,
) -> Verified:
    """Verify ``drafts[i]`` against its ``len(drafts[i]) + 1`` rows of ``logits``
    ``[R, V]`` (the requests' rows one after another; ``md`` built for those rows, with
    the drafts before each row pending). ``draft_probs`` ``[R, V]``: the distribution
    each row's draft was drawn from (any row for a bonus token; None: point masses).
    Modifies ``logits`` when it is fp32."""
    device = logits.device
    logits, pending_logprobs = process_logits(logits, md)
    num_rows = logits.shape[0]
    starts: list[int] = []
    draft_at = [-1] * num_rows  # the draft each row checks (-1: the bonus row)
    row = 0
    for d in drafts:
        starts.append(row)
        draft_at[row : row + len(d)] = d
        row += len(d) + 1
    if row != num_rows:
        raise ValueError(f"verify: {num_rows} logits rows for {row} draft positions")
    draft_ids = torch.tensor(draft_at, dtype=torch.long, device=device)
    has_draft = draft_ids >= 0
    safe_ids = draft_ids.clamp(min=0)[:, None]
    greedy_ids = greedy(logits) if md.greedy is not None or md.all_greedy else None
    probs: torch.Tensor | None = None
    if md.all_greedy:
        assert greedy_ids is not None
        accept = greedy_ids == draft_ids
    else:
        probs = sampling_probs(logits, md)
        uniform = torch.empty(num_rows, device=device)
        if len(md.generators) < num_rows:
            uniform.uniform_(generator=md.engine_generator)
        for i, gen in md.generators.items():
            uniform[i : i + 1].uniform_(generator=gen)
        target_p = probs.gather(1, safe_ids)[:, 0]
        if draft_probs is None:
            accept = uniform < target_p
        else:  # u < p / q, without dividing
            accept = uniform * draft_probs.gather(1, safe_ids)[:, 0] < target_p
        if greedy_ids is not None and md.greedy is not None:
            accept = torch.where(md.greedy, greedy_ids == draft_ids, accept)
    accept_l = (accept & has_draft).tolist()
    num_accepted: list[int] = []
    for start, d in zip(starts, drafts, strict=True):
        a = 0
        while a < len(d) and accept_l[start + a]:
            a += 1
        num_accepted.append(a)
    final_rows = torch.tensor(
        [s + a for s, a in zip(starts, num_accepted, strict=True)], dtype=torch.long, device=device
    )
    if probs is None:
        assert greedy_ids is not None
        final = greedy_ids.index_select(0, final_rows)
    else:
        residual = probs.index_select(0, final_rows)
        rejected = has_draft.index_select(0, final_rows)  # its draft was refused: remove it
        rejected_ids = safe_ids.index_select(0, final_rows)
        if draft_probs is None:
            kept = residual.gather(1, rejected_ids) * ~rejected[:, None]
            residual.scatter_(1, rejected_ids, kept)
        else:
            diff = (residual - draft_probs.index_select(0, final_rows)).clamp_(min=0.0)
            # (p - q)^+ sums to 0 only where rounding met p == q: p itself then
            usable = rejected[:, None] & (diff.sum(1, keepdim=True) > 0)
            residual = torch.where(usable, diff, residual)
        generators = {
            k: md.generators[r] for k, r in enumerate(final_rows.tolist()) if r in md.generators
        }
        final = random_sample(residual, generators, md.engine_generator)
        if greedy_ids is not None and md.greedy is not None:
            final = torch.where(
                md.greedy.index_select(0, final_rows), greedy_ids.index_select(0, final_rows), final
            )
    final_l = final.tolist()
    tokens = [[*d[:a], f] for d, a, f in zip(drafts, num_accepted, final_l, strict=True)]
    logprobs: dict[int, list[TokenLogprobs]] = {}
    if pending_logprobs is not None and md.logprob_rows:
        chosen = draft_ids.clamp(min=0)
        chosen[final_rows] = final
        lp_rows = md.logprob_rows
        done = pending_logprobs.finish(
            chosen.index_select(0, torch.tensor(lp_rows, device=device)), lp_rows
        )
        for i, (start, a) in enumerate(zip(starts, num_accepted, strict=True)):
            if start in done:
                logprobs[i] = [done[start + j] for j in range(a + 1)]
    return Verified(tokens, logprobs)
