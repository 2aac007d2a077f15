"""Rotary position embeddings with every rope scaling legato reads from a config.

:func:`rope_inv_freq` gives the inverse frequencies (and the cos/sin scale) for
one :class:`~legato.models.config.RopeConfig`, mirroring transformers'
``modeling_rope_utils`` step for step so fp32 matches it: default, linear,
llama3, YaRN, dynamic NTK and LongRoPE, and a GGUF file's ``rope_freqs``.

:class:`RotaryEmbedding` holds the cos/sin table the backends index by position.
Two scalings depend on how long the sequence is, not only on the position:

- LongRoPE uses its short factors while the sequence fits the original window
  and its long factors once it does not;
- dynamic NTK raises the base with the sequence length past
  ``max_position_embeddings``.

For them :meth:`RotaryEmbedding.for_step` chooses per sequence and per step,
from the sequence's length at the end of the step (its ``seq_lens`` entry),
exactly as transformers does per ``forward`` call: its whole prefill and each
decode step rotate with the frequencies of the length reached then, and keys
already in the cache keep the rotation they were written with. So a prompt
prefilled in chunks across the original window, or started from a cached prefix,
has its earlier keys rotated as at their own step (as transformers' own decode
has), not as one whole prefill would have them. The other scalings depend on
the position alone and are the same in every setting.

Never imports trio or transformers.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from .attention_backend import AttentionMetadata
from .config import RopeConfig

_LENGTH_DEPENDENT = ("longrope", "dynamic")


def _exponent(head_dim: int) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim


def _yarn(head_dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    if rope.original_max_position_embeddings is None:
        raise ValueError("rope_parameters: yarn needs original_max_position_embeddings")
    factor, dim, base = rope.factor, head_dim, rope.theta

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        assert orig is not None
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    if rope.original_max_position_embeddings is None:
        raise ValueError("rope_parameters: llama3 needs original_max_position_embeddings")
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_attention_factor(rope: RopeConfig) -> float:
    """LongRoPE's cos/sin scale (the same for short and long factors, as in transformers)."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    orig = rope.original_max_position_embeddings
    if rope.factor <= 1.0 or not orig:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(orig))


def rope_inv_freq(
    head_dim: int, rope: RopeConfig, *, long: bool = False
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2] fp32, attention_factor)`` for ``rope``, where
    ``head_dim`` is the number of rotated dims (all of a head's, or its rotary part).

    ``attention_factor`` scales cos and sin (YaRN, LongRoPE; 1.0 otherwise).
    ``long`` picks LongRoPE's long factors. Dynamic NTK gives its frequencies at
    lengths within ``max_position_embeddings`` (see :func:`dynamic_inv_freq`).
    ``freq_factors``, when given, divide the result one by one.
    """
    kind = rope.rope_type
    inv_freq = 1.0 / (rope.theta ** _exponent(head_dim))
    attention_factor = 1.0
    if kind == "linear":
        inv_freq = inv_freq / rope.factor
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, rope)
    elif kind == "yarn":
        inv_freq, attention_factor = _yarn(head_dim, rope)
    elif kind == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        if len(factors) != head_dim // 2:
            raise ValueError(
                f"rope_parameters: longrope factors have {len(factors)} entries, "
                f"expected head_dim / 2 = {head_dim // 2}"
            )
        ext = torch.tensor(factors, dtype=torch.float32)
        inv_freq = 1.0 / (ext * rope.theta ** _exponent(head_dim))
        attention_factor = longrope_attention_factor(rope)
    elif kind not in ("default", "dynamic"):
        raise ValueError(f"rope scaling {kind!r} is not supported")
    if rope.freq_factors:
        if len(rope.freq_factors) != head_dim // 2:
            raise ValueError(
                f"rope_freqs has {len(rope.freq_factors)} entries, "
                f"expected head_dim / 2 = {head_dim // 2}"
            )
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    return inv_freq, attention_factor


def dynamic_inv_freq(head_dim: int, rope: RopeConfig, seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK: ``[N, head_dim // 2]`` fp32 inverse frequencies for sequences of
    ``seq_lens`` ``[N]`` int64 tokens; the base grows once a length passes
    ``max_position_embeddings`` (the expression is transformers', so fp32 agrees)."""
    max_pos = rope.max_position_embeddings
    if max_pos is None:
        raise ValueError("rope_parameters: dynamic needs max_position_embeddings")
    seq_len = torch.clamp(seq_lens, min=max_pos)
    factor, dim = rope.factor, head_dim
    base = rope.theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    exponent = _exponent(head_dim).to(seq_lens.device)
    return 1.0 / (base.unsqueeze(-1) ** exponent)


def cos_sin_rows(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_factor: float = 1.0,
    head_dim: int | None = None,
) -> torch.Tensor:
    """``[N, head_dim]`` fp32, cos | sin of ``positions * inv_freq`` (``inv_freq`` ``[R/2]``
    or ``[N, R/2]``), each times ``attention_factor``. With ``head_dim`` > R (partial
    rotary) each half is padded with cos 1, sin 0: pairs that do not rotate."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    pad = (head_dim or 2 * freqs.shape[-1]) // 2 - freqs.shape[-1]
    if pad:
        cos = torch.cat((cos, cos.new_ones(*cos.shape[:-1], pad)), dim=-1)
        sin = torch.cat((sin, sin.new_zeros(*sin.shape[:-1], pad)), dim=-1)
    return torch.cat((cos, sin), dim=-1)


def rope_cos_sin_cache(
    head_dim: int, rope: RopeConfig, max_positions: int, device: torch.device, *, long: bool = False
) -> torch.Tensor:
    """``[max_positions, head_dim]`` fp32: cos in the first half of the columns, sin in the
    last (with partial rotary, see :func:`cos_sin_rows` and :func:`partial_rotary_order`)."""
    inv_freq, attention_factor = rope_inv_freq(rope.rotary_dim(head_dim), rope, long=long)
    positions = torch.arange(max_positions, dtype=torch.float32)
    return cos_sin_rows(positions, inv_freq, attention_factor, head_dim).to(device)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims under which partial rotary is full-width neox rotary.

    transformers rotates the first ``rotary_dim`` dims of a head in neox pairs
    ``(i, i + rotary_dim / 2)`` and passes the rest through. Reordered so, the
    rotary pairs sit at ``(j, j + head_dim / 2)`` for ``j < rotary_dim / 2`` and the
    passed-through dims fill the other columns, which the padded cos/sin table
    leaves alone; applied to the query and key projection rows of each head (the
    scores are the same under one order applied to both), the kernels need no
    partial-rotary variant. ``new[j] = old[order[j]]``.
    """
    half, rhalf = head_dim // 2, rotary_dim // 2
    rest = torch.arange(rotary_dim, head_dim)
    return torch.cat(
        (
            torch.arange(rhalf),
            rest[: half - rhalf],
            torch.arange(rhalf, rotary_dim),
            rest[half - rhalf :],
        )
    )


def _token_seq_lens(meta: AttentionMetadata) -> torch.Tensor:
    """``[T]`` int64: each token's sequence length at the end of this step (no host sync)."""
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    return torch.repeat_interleave(
        meta.seq_lens.to(torch.int64), query_lens, output_size=meta.positions.shape[0]
    )


class RotaryEmbedding(nn.Module):
    """The cos/sin table of one rope config, for positions below ``max_positions``.

    :meth:`for_step` gives the table and the metadata whose ``positions`` index it
    for one step; for the length-dependent scalings these are chosen per sequence
    (see the module docstring), otherwise they are the table and ``meta`` as given.
    """

    cos_sin_cache: torch.Tensor

    def __init__(
        self, head_dim: int, rope: RopeConfig, max_positions: int, device: torch.device
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.max_positions = max_positions
        table = rope_cos_sin_cache(head_dim, rope, max_positions, device)
        if rope.rope_type == "longrope":  # short rows, then long rows
            long = rope_cos_sin_cache(head_dim, rope, max_positions, device, long=True)
            table = torch.cat((table, long))
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def for_step(self, meta: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
        """``(cos_sin_cache, meta)`` for :meth:`Backend.begin_step`."""
        kind = self.rope.rope_type
        if kind not in _LENGTH_DEPENDENT:
            return self.cos_sin_cache, meta
        seq_lens = _token_seq_lens(meta)
        if kind == "longrope":
            orig = self.rope.original_max_position_embeddings
            assert orig is not None
            offset = (seq_lens > orig).to(torch.int64) * self.max_positions
            return self.cos_sin_cache, dataclasses.replace(meta, positions=meta.positions + offset)
        inv_freq = dynamic_inv_freq(self.rope.rotary_dim(self.head_dim), self.rope, seq_lens)
        rows = cos_sin_rows(meta.positions, inv_freq, head_dim=self.head_dim)
        positions = torch.arange(rows.shape[0], dtype=torch.int64, device=rows.device)
        return rows, dataclasses.replace(meta, positions=positions)
