"""Triton rotary embedding against the reference, neox and GPT-J styles."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from legato.kernels import reference, rotary


def _cos_sin_cache(max_position: int, head_dim: int, base: float = 500000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize(
    ("is_neox", "head_dim", "dtype"),
    [
        (True, 128, torch.float32),
        (False, 64, torch.float32),
        (True, 64, torch.float16),
        (False, 80, torch.float16),
        (True, 64, torch.bfloat16),
    ],
)
def test_apply_rotary(
    tol: Callable[[torch.dtype], dict[str, float]],
    device: str,
    is_neox: bool,
    head_dim: int,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_heads, num_kv_heads = 11, 6, 2
    # q and k as views of one fused projection, as the model produces them.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype).to(device)
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(device)
    cache = _cos_sin_cache(4096, head_dim).to(device)
    q_out, k_out = rotary.apply_rotary(query, key, positions, cache, is_neox)
    q_ref, k_ref = reference.apply_rotary(query, key, positions, cache, is_neox)
    assert q_out.dtype == dtype and k_out.dtype == dtype
    torch.testing.assert_close(q_out, q_ref, **tol(dtype))
    torch.testing.assert_close(k_out, k_ref, **tol(dtype))
