"""The model runner's side of speculative decoding: drafts in, verified tokens out.

A step may carry drafts (``SchedulerOutput.scheduled_spec_decode_tokens``):
a decode request with ``k`` drafts computes ``k + 1`` tokens, its last known
token then the drafts. :func:`place_drafts` writes the drafts after the
request's known tokens (its known count stays put: drafts become tokens only
once accepted), :func:`logits_rows` picks the hidden rows to score (every
position of a drafted request, the last one of the others), and
:class:`SpecDecoder` verifies them (:mod:`.rejection_sampler`) and proposes the
next step's drafts (:mod:`.ngram_proposer`; or, given a draft model, the runner
asks its :class:`~.draft_proposer.ModelProposer`, whose draft distributions the
verification then uses).

Never imports trio.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import SpeculativeConfig
from ..protocol.messages import TokenLogprobs
from ..structured.mask import step_bitmask
from .draft_proposer import ModelProposer
from .input_batch import InputBatch
from .ngram_proposer import NgramProposer
from .rejection_sampler import verify


def place_drafts(
    batch: InputBatch, drafts: dict[str, list[int]], req_ids: list[str], order: np.ndarray
) -> np.ndarray:
    """Write each drafted request's drafts after its known tokens; returns the number of
    drafts per entry of ``order`` (indices into ``req_ids``). ValueError for drafts of a
    request not scheduled, or past ``max_model_len``."""
    lens = np.zeros(len(order), dtype=np.int64)
    position = {req_ids[int(k)]: i for i, k in enumerate(order)}
    for req_id, tokens in drafts.items():
        i = position.get(req_id)
        if i is None:
            raise ValueError(f"request {req_id!r}: drafts for a request not scheduled")
        row = batch.row(req_id)
        start = int(batch.num_tokens[row])
        if start + len(tokens) > batch.max_tokens:
            raise ValueError(f"request {req_id!r}: drafts past max_model_len")
        batch.token_ids[row, start : start + len(tokens)] = tokens
        lens[i] = len(tokens)
    return lens


def logits_rows(
    query_start_loc: list[int], sampling: np.ndarray, spec_lens: np.ndarray
) -> np.ndarray:
    """The flat hidden rows whose logits a step needs: for each sampling entry (index into
    the step's order), its last ``spec_lens[i] + 1`` rows, in order."""
    ends = np.asarray(query_start_loc[1:], dtype=np.int64)[sampling]
    counts = spec_lens[sampling] + 1
    first = np.repeat(ends - counts, counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    rows: np.ndarray = first + offsets
    return rows


@dataclass(slots=True)
class VerifiedStep:
    """Each sampling entry's emitted tokens (accepted drafts, then one more) and the
    logprobs of the entries that asked (by entry index)."""

    tokens: list[list[int]]
    logprobs: dict[int, list[TokenLogprobs]]


class SpecDecoder:
    """Verifies a step's drafts and proposes the next ones (n-gram proposals, unless a
    ``model_proposer`` proposes: the runner then asks it directly)."""

    def __init__(
        self, config: SpeculativeConfig, model_proposer: ModelProposer | None = None
    ) -> None:
        self.proposer = NgramProposer(config)
        self.model_proposer = model_proposer

    def verify(
        self,
        batch: InputBatch,
        logits: torch.Tensor,
        rows: np.ndarray,
        ids: list[str],
        drafts: dict[str, list[int]],
        grammar_bitmask: dict[str, bytes],
    ) -> VerifiedStep:
        """Verify the sampling entries ``rows`` (batch rows; ``ids`` their request ids),
        whose ``logits`` rows come from :func:`logits_rows`. A constrained request's
        ``grammar_bitmask`` entry holds one row per verified position (ValueError if not):
        a draft its grammar refuses is rejected where it stands."""
        per_entry = [drafts.get(r, []) for r in ids]
        expanded_rows = np.repeat(rows, [len(d) + 1 for d in per_entry])
        pending = [d[:j] for d in per_entry for j in range(len(d) + 1)]
        md = batch.sampling_metadata(expanded_rows, pending)
        if grammar_bitmask:  # a drafted request's entry holds a row per verified position
            masks = step_bitmask(
                grammar_bitmask, ids, batch.device, [len(d) + 1 for d in per_entry]
            )
            if masks is not None:
                md.token_bitmask, md.bitmask_rows = masks
        q = None
        if self.model_proposer is not None:
            q = self.model_proposer.draft_probs(ids, per_entry, logits.shape[1])
        out = verify(logits, md, per_entry, q)
        return VerifiedStep(out.tokens, out.logprobs)

    def propose(self, batch: InputBatch, row: int, limit: int) -> list[int]:
        """Drafts for the request at ``row``, from its tokens so far (at most ``limit``)."""
        return self.proposer.propose(batch.token_ids[row, : int(batch.num_tokens[row])], limit)
