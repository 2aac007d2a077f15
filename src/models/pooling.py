"""Pooling: a prompt's final hidden states become one embedding vector.

As vLLM's embedding runner does for Llama-family decoders, the default is the
hidden state of the last prompt token (after the final norm), L2-normalised.
``MEAN`` averages every prompt token's hidden state and ``CLS`` takes the
first. Prompts may arrive in chunks (chunked prefill): :class:`Pooler` keeps
what each request needs between chunks (nothing for ``LAST``, a running fp32
sum for ``MEAN``, the first row for ``CLS``) and returns the vector on the
chunk that completes the prompt.

``MEAN`` and ``CLS`` need every prompt token (or the first) to be computed by
this runner, so such a request must not start from a prefix-cache hit;
:meth:`Pooler.add` refuses one that does.

Never imports trio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ..protocol.params import PoolingParams

PoolingType = Literal["LAST", "MEAN", "CLS"]


@dataclass
class _Pending:
    params: PoolingParams
    num_prompt_tokens: int
    acc: torch.Tensor | None = None  # MEAN: the fp32 sum so far; CLS: the first row


def pooling_needs_all_tokens(pooling_type: PoolingType) -> bool:
    """Whether every prompt token must be computed (no prefix-cache start)."""
    return pooling_type != "LAST"


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> list[float]:
    """Truncate to ``params.dimensions`` (when set), L2-normalise when asked; fp32 list."""
    v = vector.float()
    if params.dimensions is not None:
        v = v[: params.dimensions]
    if params.normalize:
        v = F.normalize(v, p=2, dim=-1)
    out: list[float] = v.tolist()
    return out


class Pooler:
    """Per-request pooling state of one model runner."""

    def __init__(self, pooling_type: PoolingType) -> None:
        if pooling_type not in ("LAST", "MEAN", "CLS"):
            raise ValueError(f"pooling_type: unknown pooling {pooling_type!r}")
        self.pooling_type: PoolingType = pooling_type
        self._pending: dict[str, _Pending] = {}

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def add(
        self, req_id: str, params: PoolingParams, num_prompt_tokens: int, num_computed: int
    ) -> None:
        """Start pooling ``req_id``; raises ValueError for a cached start MEAN/CLS cannot use."""
        if num_computed and pooling_needs_all_tokens(self.pooling_type):
            raise ValueError(
                f"request {req_id!r}: {self.pooling_type} pooling needs every prompt token "
                f"computed, but it starts at token {num_computed} (a prefix-cache hit)"
            )
        self._pending[req_id] = _Pending(params, num_prompt_tokens)

    def remove(self, req_id: str) -> None:
        self._pending.pop(req_id, None)

    def chunk(self, req_id: str, rows: torch.Tensor, start: int) -> list[float] | None:
        """Take the hidden states ``rows`` ``[n, H]`` of prompt positions ``start..start+n-1``.

        Returns the finished vector when the chunk reaches the end of the prompt
        (the request is then forgotten), else None.
        """
        pending = self._pending[req_id]
        end = start + rows.shape[0]
        if self.pooling_type == "MEAN":
            part = rows.float().sum(dim=0)
            pending.acc = part if pending.acc is None else pending.acc + part
        elif self.pooling_type == "CLS" and start == 0:
            pending.acc = rows[0].float()
        if end < pending.num_prompt_tokens:
            return None
        del self._pending[req_id]
        if self.pooling_type == "LAST":
            vector = rows[-1]
        elif self.pooling_type == "MEAN":
            assert pending.acc is not None
            vector = pending.acc / pending.num_prompt_tokens
        else:
            assert pending.acc is not None
            vector = pending.acc
        return finish_vector(vector, pending.params)
