"""Plain-torch reference versions of the hot paths; the Triton kernels match these.

Every function here defines a signature the Triton version in this package
keeps, so the model code calls one name whichever path runs. The references
favour clarity over speed; they compute in fp32 and cast back.

Paged KV-cache layout (per layer): ``key_cache`` and ``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's *slot* is
``block_id * block_size + offset``.

A flat batch holds ``num_seqs`` sequences; sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]`` (its new tokens this step) and has
``seq_lens[i]`` tokens of context *including* those new tokens, so its first
new token sits at position ``seq_lens[i] - query_len_i``. Attention is causal:
the query at position ``p`` sees keys ``0..p``. Prefill, chunked prefill, a
prefill after a prefix-cache hit and decode (query_len 1) are all this one case.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[T]``.

    Slots < 0 are padding and are skipped. Writes the caches in place.
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    flat_k[slots] = key[valid].to(key_cache.dtype)
    flat_v[slots] = value[valid].to(value_cache.dtype)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, num_heads, head_dim]`` over the paged cache.

    ``block_tables`` ``[num_seqs, max_blocks]`` (int32, unused entries arbitrary),
    ``seq_lens`` ``[num_seqs]`` and ``query_start_loc`` ``[num_seqs + 1]`` as
    described in the module docstring. The new tokens' K/V must already be
    written. GQA: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``.
    Returns ``[T, num_heads, head_dim]`` in the query's dtype.
    ``max_query_len`` / ``max_seq_len`` are the Triton path's sync-free hints;
    the reference reads the lengths itself and ignores them. With ``sliding_window``
    a query at position ``p`` sees only keys at ``p - sliding_window < k <= p`` (as
    transformers' sliding-window mask). With ``softcap`` the scores become
    ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2).
    """
    del max_query_len, max_seq_len
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        n_blocks = (ctx_len + block_size - 1) // block_size
        blocks = block_tables[i, :n_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[q_start:q_end].float().transpose(0, 1)  # [H, q_len, D]
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
        k_pos = torch.arange(ctx_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, ctx]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = torch.matmul(q, k.transpose(1, 2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.matmul(probs, v).transpose(0, 1).to(query.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``; return ``(rms_norm(residual), residual)``."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(summed, weight, eps), summed


def apply_rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``query`` ``[T, H, D]`` and ``key`` ``[T, Hkv, D]``.

    ``cos_sin_cache`` is ``[max_position, D]``: cos in the first ``D/2`` columns,
    sin in the last (precomputed, so llama3 and other scalings live there).
    Neox style rotates the two halves of the head; GPT-J style rotates
    interleaved pairs. Returns new tensors in the inputs' dtypes.
    """
    cos_sin = cos_sin_cache[positions.long()].float()
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if is_neox:
            x1, x2 = xf[..., :half], xf[..., half:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.flatten(-2).to(x.dtype)

    return rotate(query), rotate(key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dimension ``2d``."""
    d = x.shape[-1] // 2
    return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Routed SwiGLU experts: ``out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])``.

    ``x`` ``[T, H]``; ``w13`` ``[E, 2I, H]`` (gate rows, then up rows); ``w2`` ``[E, H, I]``;
    ``topk_weights`` / ``topk_ids`` ``[T, k]``. Each (token, slot) pair gathers its own
    expert's weights (clear, not fast); fp32 math, result in ``x``'s dtype.
    """
    xf = x.float()
    gate_up = torch.einsum("tkoh,th->tko", w13[topk_ids].float(), xf)
    hidden = silu_and_mul(gate_up)
    down = torch.einsum("tkhi,tki->tkh", w2[topk_ids].float(), hidden)
    return (down * topk_weights.float().unsqueeze(-1)).sum(dim=1).to(x.dtype)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_sizes: Sequence[int],
) -> None:
    """Add each token's LoRA update to ``y`` in place (multi-adapter, punica-style).

    ``x`` ``[T, in]``; ``token_slots`` ``[T]`` int: the adapter slot of each
    token, 0 for the base model (no update). A projection may be several fused
    slices (q, k, v) of ``slice_sizes`` output columns each. ``lora_a``
    ``[L, S * R, in]`` holds each slot's down-projections, slice ``s`` in rows
    ``s*R .. s*R+R``; ``lora_b`` ``[L, out, R]`` its up-projections (scaling
    folded in), slice ``s`` in the rows of its output columns. fp32 math, one
    token at a time; the result is rounded to ``y``'s dtype once.
    """
    rank = lora_a.shape[1] // len(slice_sizes)
    for t, slot in enumerate(token_slots.tolist()):
        if slot == 0:
            continue
        h = lora_a[slot].float() @ x[t].float()  # [S * R]
        start = 0
        for s, size in enumerate(slice_sizes):
            cols = slice(start, start + size)
            delta = lora_b[slot, cols].float() @ h[s * rank : (s + 1) * rank]
            y[t, cols] = (y[t, cols].float() + delta).to(y.dtype)
            start += size


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Structured outputs: ``logits[rows[i], t] = -inf`` wherever token ``t`` is not allowed.

    ``bitmask`` is ``int32[R, W]``, on the logits' device: bit ``t % 32`` of word
    ``t // 32`` of row ``i`` set means token ``t`` is allowed for logits row
    ``rows[i]`` (``int64[R]``). Tokens at or past ``32 * W`` are not allowed.
    Other rows are untouched. Writes ``logits`` in place.
    """
    vocab = logits.shape[-1]
    words = bitmask.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], words * 32)
    if words * 32 < vocab:
        allowed = F.pad(allowed, (0, vocab - words * 32), value=False)
    sub = logits.index_select(0, rows).masked_fill_(~allowed[:, :vocab], float("-inf"))
    logits.index_copy_(0, rows, sub)
