"""Fast plain-torch versions of the hot paths, for CPU (and any device).

Same results as :mod:`legato.kernels.reference` (tests check them against it),
but vectorised over the batch and with per-step work hoisted out of the layers:

- :func:`plan_attention` turns one step's attention metadata into a
  :class:`AttentionPlan` once; :func:`attend` then runs each layer. Decode
  sequences (query length 1, leading the batch) are handled together: on the
  CPU by the native kernel of :mod:`legato.models.cpu_kernels`, which reads
  their K/V in place through the block table, else (no compiler, another
  device or dtype) by one gather of their KV blocks and one batched attention.
  Prefill sequences, which carry enough work to amortise a Python call, run
  one ``scaled_dot_product_attention`` each; on the CPU a fresh fp32 prompt
  (no cached context) of 96 tokens or more runs the native causal kernel instead
  (``cpu_kernels.prefill_attention``: 1.3-1.8x SDPA's speed from 96 to 1024 tokens).
- :func:`rotary_tables` gathers cos/sin for the step's positions once;
  :func:`rotate_neox` applies them to queries and keys in one pass.

Never imports trio.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension.

    As transformers' LlamaRMSNorm: normalised in fp32, rounded to the input
    dtype, then scaled by the weight. Three full-size ops (``F.rms_norm`` is a
    composite of about ten on CPU).
    """
    inv = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    inv = inv.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    out: torch.Tensor = (x * inv) if x.dtype == torch.float32 else (x.float() * inv).to(x.dtype)
    return out.mul_(weight)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``; return ``(rms_norm(residual), residual)``."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` in the input's dtype."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[T, Hkv, D]`` at ``slot_mapping`` ``[T]`` (int64, all >= 0)."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


# ------------------------------------------------------------------ rotary


def rotary_tables(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width ``(cos, signed_sin)`` ``[T, 1, D]`` for :func:`rotate_neox`.

    ``cos_sin_cache`` is the reference layout ``[max_position, D]`` (cos | sin).
    """
    cos_sin = cos_sin_cache.index_select(0, positions)
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    cos_full = torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1)
    sin_signed = torch.cat((-sin, sin), dim=-1).to(dtype).unsqueeze(1)
    return cos_full, sin_signed


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of ``x`` ``[T, heads, D]`` (may be a strided view); a new tensor."""
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    out = x * cos
    out.addcmul_(rotated, sin_signed)
    return out


# --------------------------------------------------------------- attention


@dataclass(frozen=True, slots=True)
class PrefillSegment:
    """One non-decode sequence: query rows ``start:end`` over ``context_len`` keys.

    ``block_ids`` is None when the sequence has no earlier context (its keys are
    exactly this step's keys: causal attention over them, no cache read).
    """

    seq_index: int
    start: int
    end: int
    context_len: int
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None  # [q_len, context_len] bool, True = attend


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Per-step attention work shared by every layer.

    The first ``num_decodes`` sequences have one query row each (rows
    ``0..num_decodes-1``). With ``native`` the CPU kernel reads their blocks in
    place through ``decode_table`` / ``decode_lens``; otherwise their KV blocks
    are gathered as ``decode_block_ids`` (``[num_decodes * decode_blocks]``) and
    ``decode_mask`` hides the padding.
    """

    slot_mapping: torch.Tensor
    num_tokens: int
    num_decodes: int
    decode_blocks: int
    decode_block_ids: torch.Tensor | None
    decode_mask: torch.Tensor | None  # [nd,1,1,L]: bool (fp32), else additive in the dtype
    prefills: tuple[PrefillSegment, ...]
    native: bool = False
    decode_table: torch.Tensor | None = None  # [nd, >= blocks] int32
    decode_lens: torch.Tensor | None = None  # [nd] int32
    # ``prefills`` grouped: runs of adjacent fresh segments of one length (one batched call)
    prefill_runs: tuple[tuple[PrefillSegment, ...], ...] = ()


def native_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether attention on ``device`` in ``dtype`` can use the native CPU kernels."""
    return device.type == "cpu" and dtype in cpu_kernels.DTYPES and cpu_kernels.available()


# Shorter fresh prompts keep SDPA: there the native kernel's fixed cost (its parallel region,
# the keys' transposition) eats its saving (9 heads, head_dim 64, ms a call against SDPA's:
# 32 tokens 0.05 against 0.035, 64 tokens 0.085-0.093 against 0.078-0.090, 96 tokens
# 0.13-0.14 against 0.17-0.18, 128 tokens 0.18 against 0.25).
NATIVE_PREFILL_MIN_TOKENS = 96


@functools.cache
def _native_prefill_runs_here() -> bool:
    return cpu_kernels.prefill_attention_available()


def _native_prefill(plan: AttentionPlan, query: torch.Tensor, softcap: float | None) -> bool:
    """Whether fresh prompts of this step go to the native causal kernel (fp32, no soft
    cap, head_dim 64 or 128, a CPU with AVX-512)."""
    return (
        plan.native
        and softcap is None
        and query.dtype == torch.float32
        and query.shape[2] in (64, 128)
        and _native_prefill_runs_here()
    )


def plan_attention(
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    slot_mapping: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
    num_decodes: int | None = None,
    seq_lens_tensor: torch.Tensor | None = None,
    native: bool | None = None,
    sliding_window: int | None = None,
) -> AttentionPlan:
    """Build the :class:`AttentionPlan` for one step (host lists for lengths).

    ``num_decodes``: how many leading sequences have query length 1 (counted
    when None). Unused block-table entries may hold anything.
    ``seq_lens_tensor``: ``seq_lens`` as an int32 tensor, when the caller has it.
    ``native``: use the native CPU kernels for the KV write and decode attention
    (None: where :func:`native_available`).
    ``sliding_window``: a query at position ``p`` sees keys ``p - window < k <= p``.
    The native decode kernel attends to a whole context, so once a decode sequence
    is longer than the window its decodes take the gathered path, masked.
    """
    num_seqs = len(seq_lens)
    device = block_tables.device
    if num_decodes is None:
        num_decodes = 0
        while (
            num_decodes < num_seqs
            and query_start_loc[num_decodes + 1] - query_start_loc[num_decodes] == 1
        ):
            num_decodes += 1
    decode_block_ids = decode_mask = decode_table = decode_lens = None
    decode_blocks = 0
    if native is None:
        native = native_available(device, dtype)
    window = sliding_window
    decode_native = native and (window is None or max(seq_lens[:num_decodes], default=0) <= window)
    if num_decodes and decode_native:
        decode_table = block_tables[:num_decodes]
        if decode_table.dtype != torch.int32 or decode_table.stride(-1) != 1:
            decode_table = decode_table.to(torch.int32).contiguous()
        if seq_lens_tensor is not None and seq_lens_tensor.dtype == torch.int32:
            decode_lens = seq_lens_tensor[:num_decodes].contiguous()
        else:
            decode_lens = torch.tensor(seq_lens[:num_decodes], dtype=torch.int32, device=device)
    elif num_decodes:
        dec_lens = seq_lens[:num_decodes]
        # each row gathers from the block holding its first visible key (0 without a window)
        firsts = [max(n - window, 0) // block_size if window else 0 for n in dec_lens]
        decode_blocks = max(
            (n + block_size - 1) // block_size - f for n, f in zip(dec_lens, firsts, strict=True)
        )
        lens = torch.tensor(dec_lens, device=device)
        first = torch.tensor(firsts, device=device)
        needed = (lens + block_size - 1) // block_size
        cols = first[:, None] + torch.arange(decode_blocks, device=device)[None, :]
        table = block_tables[:num_decodes].long()
        table = table.gather(1, cols.clamp(max=table.shape[1] - 1))
        decode_block_ids = torch.where(cols < needed[:, None], table, 0).reshape(-1)
        keys = first[:, None] * block_size + torch.arange(decode_blocks * block_size, device=device)
        valid = keys < lens[:, None]
        if window is not None:  # the query sits at lens - 1
            valid &= keys >= lens[:, None] - window
        valid = valid[:, None, None, :]
        if dtype == torch.float32:
            decode_mask = valid
        else:
            decode_mask = torch.zeros(valid.shape, dtype=dtype, device=device)
            decode_mask.masked_fill_(~valid, float("-inf"))
    prefills: list[PrefillSegment] = []
    for i in range(num_decodes, num_seqs):
        start, end, ctx = query_start_loc[i], query_start_loc[i + 1], seq_lens[i]
        q_len = end - start
        if q_len == 0:
            continue
        windowed = window is not None and ctx > window
        if ctx == q_len and not windowed:
            prefills.append(PrefillSegment(i, start, end, ctx, None, None))
            continue
        n_blocks = (ctx + block_size - 1) // block_size
        q_pos = torch.arange(ctx - q_len, ctx, device=device)
        k_pos = torch.arange(ctx, device=device)[None, :]
        mask = k_pos <= q_pos[:, None]
        if windowed:
            assert window is not None
            mask &= k_pos > q_pos[:, None] - window
        if ctx == q_len:  # fresh, windowed: this step's keys, masked
            prefills.append(PrefillSegment(i, start, end, ctx, None, mask))
            continue
        blocks = block_tables[i, :n_blocks].long()
        prefills.append(PrefillSegment(i, start, end, ctx, blocks, mask))
    return AttentionPlan(
        slot_mapping=slot_mapping.long(),
        num_tokens=query_start_loc[-1],
        num_decodes=num_decodes,
        decode_blocks=decode_blocks,
        decode_block_ids=decode_block_ids,
        decode_mask=decode_mask,
        prefills=tuple(prefills),
        native=decode_native,
        decode_table=decode_table,
        decode_lens=decode_lens,
        prefill_runs=_prefill_runs(prefills),
    )


def _prefill_runs(prefills: list[PrefillSegment]) -> tuple[tuple[PrefillSegment, ...], ...]:
    """Group adjacent unmasked segments without earlier context whose query lengths are equal (and
    whose rows follow each other): such a run is one batched causal attention call."""
    runs: list[list[PrefillSegment]] = []
    for seg in prefills:
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and seg.block_ids is None
            and last.block_ids is None
            and seg.mask is None
            and last.mask is None
            and seg.start == last.end
            and seg.end - seg.start == last.end - last.start
        ):
            runs[-1].append(seg)
        else:
            runs.append([seg])
    return tuple(tuple(run) for run in runs)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; ``[T, H, D]`` in query's dtype.

    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the softmax
    (Gemma 2); the plan must then be a gathered one (``native`` False).
    """
    assert softcap is None or not plan.native, "the native kernel takes no soft cap"
    if plan.native:
        cpu_kernels.write_kv(key, value, key_cache, value_cache, plan.slot_mapping)
    else:
        write_kv(key, value, key_cache, value_cache, plan.slot_mapping)
    nd = plan.num_decodes
    if nd == plan.num_tokens:
        return _decode(query, key_cache, value_cache, plan, scale, softcap=softcap)
    out = query.new_empty(query.shape)
    if nd:
        _decode(query[:nd], key_cache, value_cache, plan, scale, out=out[:nd], softcap=softcap)
    native = _native_prefill(plan, query, softcap)
    for run in plan.prefill_runs:
        fresh = all(seg.block_ids is None and seg.mask is None for seg in run)
        if native and fresh and run[0].end - run[0].start >= NATIVE_PREFILL_MIN_TOKENS:
            for seg in run:
                rows = slice(seg.start, seg.end)
                cpu_kernels.prefill_attention(
                    query[rows], key[rows], value[rows], scale, out=out[rows]
                )
        elif len(run) == 1:
            seg = run[0]
            out[seg.start : seg.end] = _prefill(
                query, key, value, key_cache, value_cache, seg, scale, softcap
            )
        else:
            out[run[0].start : run[-1].end] = _fresh_prefills(
                query, key, value, run, scale, softcap
            )
    return out


def _fresh_prefills(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    run: tuple[PrefillSegment, ...],
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``run``'s equal-length fresh segments as one batch."""
    start, end, count = run[0].start, run[-1].end, len(run)
    length = run[0].end - run[0].start
    num_heads, head_dim = query.shape[1], query.shape[2]

    def batched(x: torch.Tensor) -> torch.Tensor:
        return x[start:end].view(count, length, x.shape[1], head_dim).transpose(1, 2)

    out = _sdpa(
        batched(query), batched(key), batched(value), None, scale=scale, softcap=softcap
    )
    return out.transpose(1, 2).reshape(end - start, num_heads, head_dim)


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    if plan.native:
        assert plan.decode_table is not None and plan.decode_lens is not None
        return cpu_kernels.decode_attention(
            query, key_cache, value_cache, plan.decode_table, plan.decode_lens, scale, out=out
        )
    result = _gathered_decode(query, key_cache, value_cache, plan, scale, softcap)
    if out is None:
        return result
    out.copy_(result)
    return out


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]``; bf16/fp16 move as int16 (index_select is several times
    faster on a 16-bit integer than on a 16-bit float)."""
    if cache.dtype in (torch.bfloat16, torch.float16):
        return cache.view(torch.int16).index_select(0, block_ids).view(cache.dtype)
    return cache.index_select(0, block_ids)


def _gathered_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    nd, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert plan.decode_block_ids is not None and plan.decode_mask is not None
    ctx = plan.decode_blocks * block_size
    k = _gather_blocks(key_cache, plan.decode_block_ids).view(nd, ctx, num_kv_heads, head_dim)
    v = _gather_blocks(value_cache, plan.decode_block_ids).view(nd, ctx, num_kv_heads, head_dim)
    if query.dtype == torch.float32:
        out = _sdpa(
            query.unsqueeze(2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            plan.decode_mask,
            scale=scale,
            softcap=softcap,
        )
        return out.view(nd, num_heads, head_dim)
    # Half precision: CPU SDPA with a mask is slow here; batched matmuls in the
    # cache dtype (softmax accumulates in fp32 inside) are several times faster.
    group = num_heads // num_kv_heads
    k = k.transpose(1, 2).contiguous()
    v = v.transpose(1, 2).contiguous()
    q = (query * scale).view(nd, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2))
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores.add_(plan.decode_mask)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).view(nd, num_heads, head_dim)


def _prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seg: PrefillSegment,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    _, _, num_kv_heads, head_dim = key_cache.shape
    q = query[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
    if seg.block_ids is None:
        k = key[seg.start : seg.end]
        v = value[seg.start : seg.end]
    else:
        k = _gather_blocks(key_cache, seg.block_ids).view(-1, num_kv_heads, head_dim)
        v = _gather_blocks(value_cache, seg.block_ids).view(-1, num_kv_heads, head_dim)
        k, v = k[: seg.context_len], v[: seg.context_len]
    out = _sdpa(
        q,
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        seg.mask,
        scale=scale,
        softcap=softcap,
    )
    return out.squeeze(0).transpose(0, 1)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, L, D]`` over ``k``/``v`` ``[B, Hkv, S, D]``; ``mask``
    (bool, True = attend; or additive) broadcast to ``[B, H, L, S]``, None = causal.

    Without ``softcap`` this is torch's SDPA. SDPA takes no soft cap, so with one the
    scores are computed whole, capped, masked and softmaxed in fp32, as transformers'
    eager Gemma 2 attention does.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )  # fmt: skip
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        length, context = scores.shape[-2:]
        mask = torch.ones(length, context, dtype=torch.bool, device=q.device).tril(
            context - length
        )
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The reference ``paged_attention`` contract, computed with the fast path.

    K/V must already be in the cache (as for the reference). Plans afresh on
    each call; the model plans once per step and calls :func:`attend` instead.
    """
    lens = [int(x) for x in seq_lens.tolist()]
    starts = [int(x) for x in query_start_loc.tolist()]
    block_size = key_cache.shape[1]
    empty = torch.empty(0, dtype=torch.long, device=query.device)
    plan = plan_attention(
        block_tables, lens, starts, empty, block_size, query.dtype, seq_lens_tensor=seq_lens,
        sliding_window=sliding_window, native=False if softcap is not None else None,
    )  # fmt: skip
    nd = plan.num_decodes
    out = query.new_empty(query.shape)
    if nd:
        _decode(query[:nd], key_cache, value_cache, plan, scale, out=out[:nd], softcap=softcap)
    for seg in plan.prefills:
        if seg.block_ids is None:  # the keys are not passed in here: read them from the cache
            n_blocks = (seg.context_len + block_size - 1) // block_size
            blocks = block_tables[seg.seq_index, :n_blocks].long()
            seg = PrefillSegment(
                seg.seq_index, seg.start, seg.end, seg.context_len, blocks, seg.mask
            )
        out[seg.start : seg.end] = _prefill(
            query, query, query, key_cache, value_cache, seg, scale, softcap
        )
    return out
