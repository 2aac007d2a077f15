"""Sampling one token per row of a logits batch, with vLLM's semantics.

Order of operations (as vLLM v1): the structured-outputs token bitmask
(disallowed tokens to -inf, before anything else) → raw logprobs (log-softmax of the model's
logits, before any processing) → allowed_token_ids → min_tokens (EOS and stop
ids masked) → logit_bias → penalties (repetition over prompt + output tokens,
presence / frequency over output tokens) → greedy argmax for temperature 0,
else temperature → min_p → top-k / top-p → a draw from the softmax by inverse
transform (:func:`random_sample`; vLLM races exponential noise instead: the same
distribution). A seeded row draws its uniform from its own ``torch.Generator``,
so it samples the same whatever else shares the batch; other rows draw from the
engine's generator.

Everything is vectorised over the batch; the only per-row loop is over the
seeded rows' generators. :class:`SamplingMetadata` is built by the input batch.

Never imports trio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..protocol.messages import TokenLogprobs
from ..structured.mask import apply_token_bitmask
from . import cpu_kernels

_NEG_INF = float("-inf")


@dataclass(slots=True)
class PenaltyInputs:
    """Penalty state of the rows that use penalties."""

    rows: torch.Tensor  # [P] int64 rows of the logits batch
    prompt_mask: torch.Tensor  # [P, V] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [P, V] int: occurrences in the output so far
    repetition: torch.Tensor  # [P] float32
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32


@dataclass(slots=True)
class SamplingMetadata:
    """What the sampler needs for one step's logits rows. None = no row uses it."""

    temperature: torch.Tensor  # [N] float32; greedy rows hold 1.0
    greedy: torch.Tensor | None  # [N] bool, None when no row is greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [N] int64, vocab size where unused
    top_p: torch.Tensor | None  # [N] float32, 1.0 where unused
    min_p: torch.Tensor | None  # [N] float32, 0.0 where unused
    generators: dict[int, torch.Generator]  # row -> its own generator (seeded rows)
    engine_generator: torch.Generator | None
    penalties: PenaltyInputs | None = None
    allowed_rows: torch.Tensor | None = None  # [A] int64
    allowed_mask: torch.Tensor | None = None  # [A, V] bool, True = allowed
    bias_rows: torch.Tensor | None = None  # [K] int64
    bias_cols: torch.Tensor | None = None  # [K] int64
    bias_values: torch.Tensor | None = None  # [K] float32
    banned_rows: torch.Tensor | None = None  # [M] int64 (min_tokens)
    banned_cols: torch.Tensor | None = None  # [M] int64
    logprob_rows: list[int] | None = None  # rows whose raw logprobs are wanted
    num_logprobs: list[int] | None = None  # top-k count per logprob row
    token_bitmask: torch.Tensor | None = None  # [G, W] int32 structured outputs, on device
    bitmask_rows: torch.Tensor | None = None  # [G] int64 rows the bitmask rows apply to


@dataclass(slots=True)
class SamplerOutput:
    """Sampled token per row, and top-k raw logprobs for the rows that asked."""

    sampled: torch.Tensor  # [N] int64
    logprobs: dict[int, TokenLogprobs]  # row -> logprobs of the sampled token


def apply_penalties(logits: torch.Tensor, p: PenaltyInputs) -> None:
    """Repetition, frequency and presence penalties on ``logits[p.rows]``, in place."""
    sub = logits.index_select(0, p.rows)
    output_mask = p.output_counts > 0
    seen = p.prompt_mask | output_mask
    rep = torch.where(seen, p.repetition[:, None], torch.ones_like(sub))
    sub = torch.where(sub > 0, sub / rep, sub * rep)
    sub -= p.frequency[:, None] * p.output_counts.to(sub.dtype)
    sub -= p.presence[:, None] * output_mask.to(sub.dtype)
    logits.index_copy_(0, p.rows, sub)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < min_p[:, None] * top, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits and its smallest nucleus of mass ``top_p``.

    Ties at the k-th value are kept; the most likely token always survives.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    if top_p is None:
        assert top_k is not None
        # top-k only: a partial topk up to the largest k in use, no full sort
        unused = top_k >= vocab
        k = top_k.masked_fill(unused, 1).clamp_(min=1)
        values = logits.topk(int(k.max()), dim=-1).values
        threshold = values.gather(1, (k - 1)[:, None]).masked_fill_(unused[:, None], _NEG_INF)
        return logits.masked_fill(logits < threshold, _NEG_INF)
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab))[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum_(dim=-1)
    drop = cum <= (1 - top_p)[:, None]
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return sorted_logits.scatter(1, order, sorted_logits)


def random_sample(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    engine_generator: torch.Generator | None,
) -> torch.Tensor:
    """One draw from each row of ``probs`` ``[N, V]`` (non-negative, any positive row sum):
    :func:`inverse_transform` with one ``u ~ U[0, 1)`` per row.

    One random number per row, not one per vocabulary entry: the exponential race
    (``argmax(probs / Exponential(1))``, vLLM's native sampler) drew ``N * V`` of them,
    and on the CPU that draw cost more than the rest of sampling together. The
    distribution is the same. A seeded row takes its ``u`` from its own generator, so it
    draws the same whatever shares the batch. ``probs`` is overwritten.
    """
    n = probs.shape[0]
    u = torch.empty(n, 1, dtype=probs.dtype, device=probs.device)
    if len(generators) < n:
        u.uniform_(generator=engine_generator)
    for row, gen in generators.items():
        u[row].uniform_(generator=gen)
    return inverse_transform(probs, u)


def inverse_transform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` ``[N, V]``, the first token whose cumulative mass exceeds
    ``u`` ``[N, 1]`` (in ``[0, 1]``) times the row's mass: ``[N]`` int64.

    A token of zero mass is never returned, whatever ``u`` (``u = 1`` gives the last
    token of positive mass). ``probs`` is overwritten with its cumulative sums.
    """
    cdf = probs.cumsum_(dim=-1)
    total = cdf[:, -1:]
    # Keep the target strictly below the row's mass, so that a token of positive mass
    # always lies above it (u = 1, or u * total rounded up).
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # A row of NaN mass (logits a hostile temperature overflowed) finds no place and would
    # come back as V, an id past the vocabulary that kills the next step's embedding:
    # clamp, as the exponential race's argmax stayed in range on such a row.
    return torch.searchsorted(cdf, target, right=True).view(-1).clamp_(max=cdf.shape[-1] - 1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``; on the CPU the native kernel (parallel over rows; bf16
    logits without an fp32 copy)."""
    native = logits.dtype in (torch.float32, torch.bfloat16) and logits.stride(-1) == 1
    if logits.device.type == "cpu" and native and cpu_kernels.available():
        return cpu_kernels.argmax(logits)
    return logits.argmax(dim=-1)


def process_logits(
    logits: torch.Tensor, md: SamplingMetadata
) -> tuple[torch.Tensor, _PendingLogprobs | None]:
    """Everything before the draw: the bitmask, the raw logprobs (top-k pending the
    chosen tokens), allowed ids, min_tokens' bans, logit bias and penalties. Returns
    the processed fp32 logits (``logits`` itself when it is fp32) and the logprobs."""
    logits = logits.float()
    if md.token_bitmask is not None and md.bitmask_rows is not None:
        apply_token_bitmask(logits, md.token_bitmask, md.bitmask_rows)
    logprobs = None
    if md.logprob_rows:
        raw = torch.log_softmax(logits[md.logprob_rows], dim=-1)
        logprobs = gather_logprobs(raw, md.num_logprobs or [0] * len(md.logprob_rows))
    if md.allowed_rows is not None and md.allowed_mask is not None:
        sub = logits.index_select(0, md.allowed_rows).masked_fill_(~md.allowed_mask, _NEG_INF)
        logits.index_copy_(0, md.allowed_rows, sub)
    if md.banned_rows is not None and md.banned_cols is not None:
        logits.index_put_((md.banned_rows, md.banned_cols), logits.new_full((), _NEG_INF))
    if md.bias_rows is not None and md.bias_cols is not None and md.bias_values is not None:
        logits.index_put_((md.bias_rows, md.bias_cols), md.bias_values, accumulate=True)
    if md.penalties is not None:
        apply_penalties(logits, md.penalties)
    return logits, logprobs


def sampling_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution a processed row is drawn from: temperature, min_p, top-k / top-p,
    softmax (greedy rows come out at temperature 1; the caller takes their argmax).
    Modifies ``logits``."""
    logits = logits.div_(md.temperature[:, None])
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
    return torch.softmax(logits, dim=-1)


def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """One token per row of ``logits`` ``[N, V]`` (any float dtype; fp32 is modified in place)."""
    logits, logprobs = process_logits(logits, md)
    greedy_tokens = greedy(logits) if md.greedy is not None or md.all_greedy else None
    if md.all_greedy:
        assert greedy_tokens is not None
        sampled = greedy_tokens
    else:
        probs = sampling_probs(logits, md)
        sampled = random_sample(probs, md.generators, md.engine_generator)
        if greedy_tokens is not None and md.greedy is not None:
            sampled = torch.where(md.greedy, greedy_tokens, sampled)

    out: dict[int, TokenLogprobs] = {}
    if logprobs is not None and md.logprob_rows:
        rows = torch.tensor(md.logprob_rows, device=sampled.device)
        out = logprobs.finish(sampled.index_select(0, rows), md.logprob_rows)
    return SamplerOutput(sampled=sampled, logprobs=out)


@dataclass(slots=True)
class _PendingLogprobs:
    """Top-k of a log-probability matrix, waiting for the chosen tokens."""

    logprobs: torch.Tensor  # [R, V] float32
    top_values: torch.Tensor  # [R, max_k]
    top_ids: torch.Tensor  # [R, max_k]
    num: list[int]

    def finish(self, chosen: torch.Tensor, keys: list[int]) -> dict[int, TokenLogprobs]:
        """``TokenLogprobs`` per key (one per row): ``chosen`` token first, then the top-k."""
        chosen = chosen.long()
        chosen_lp = self.logprobs.gather(1, chosen[:, None])
        ranks = (self.logprobs > chosen_lp).sum(dim=-1) + 1
        chosen_l, lp_l, rank_l = chosen.tolist(), chosen_lp[:, 0].tolist(), ranks.tolist()
        ids_l, vals_l = self.top_ids.tolist(), self.top_values.tolist()
        out: dict[int, TokenLogprobs] = {}
        for i, key in enumerate(keys):
            k = self.num[i]
            out[key] = TokenLogprobs(
                token_ids=[chosen_l[i], *ids_l[i][:k]],
                logprobs=[lp_l[i], *vals_l[i][:k]],
                ranks=[rank_l[i], *range(1, k + 1)],
            )
        return out


def gather_logprobs(logprobs: torch.Tensor, num: list[int]) -> _PendingLogprobs:
    """Top-``num[i]`` entries of each row of ``logprobs`` ``[R, V]`` (``-1`` = whole vocab)."""
    vocab = logprobs.shape[-1]
    counts = [vocab if n < 0 else min(n, vocab) for n in num]
    max_k = max(counts, default=0)
    top = logprobs.topk(max_k, dim=-1) if max_k else None
    empty = logprobs.new_empty(logprobs.shape[0], 0)
    return _PendingLogprobs(
        logprobs=logprobs,
        top_values=top.values if top is not None else empty,
        top_ids=top.indices if top is not None else empty.long(),
        num=counts,
    )


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, num: int) -> list[TokenLogprobs]:
    """Raw logprobs of ``targets`` ``[R]`` under ``logits`` ``[R, V]``, with the top ``num``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    pending = gather_logprobs(lp, [num] * lp.shape[0])
    done = pending.finish(targets, list(range(lp.shape[0])))
    return [done[i] for i in range(lp.shape[0])]
