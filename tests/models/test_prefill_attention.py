"""The native causal attention of a fresh prompt (cpu_kernels.prefill_attention) against
torch's SDPA in fp64, over the shapes that leave partial blocks, and what it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from legato.models import cpu_kernels, torch_ops

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available() or not cpu_kernels.prefill_attention_available(),
    reason="the native prefill attention needs the kernels and AVX-512",
)


def _qkv(length: int, heads: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as a fused projection's views (strided over tokens and heads), as models
    hand them over; k is then normed into a tensor of its own (Qwen3's strides)."""
    fused = torch.randn(
        length, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(seed)
    )
    q = fused[:, : heads * dim].view(length, heads, dim)
    k = fused[:, heads * dim : (heads + kv_heads) * dim].view(length, kv_heads, dim) * 1.5
    v = fused[:, (heads + kv_heads) * dim :].view(length, kv_heads, dim)
    return q, k, v


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.double().transpose(0, 1).unsqueeze(0)

    out = F.scaled_dot_product_attention(
        heads_first(q), heads_first(k), heads_first(v), is_causal=True, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return out.squeeze(0).transpose(0, 1).float()


# Lengths around the 16-position blocks and the 48-key score tiles.
LENGTHS = [1, 15, 16, 17, 47, 48, 49, 100, 300]
HEADS = [(9, 3, 64), (8, 8, 128), (4, 1, 64)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), HEADS, ids=[f"{h}-{k}-{d}" for h, k, d in HEADS]
)
@pytest.mark.parametrize("length", LENGTHS)
def test_matches_causal_sdpa(length: int, heads: int, kv_heads: int, dim: int) -> None:
    q, k, v = _qkv(length, heads, kv_heads, dim, seed=length + dim)
    scale = dim**-0.5
    got = cpu_kernels.prefill_attention(q, k, v, scale)
    assert got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, _reference(q, k, v, scale), atol=2e-5, rtol=2e-5)


def test_a_row_sees_no_later_key() -> None:
    """Changing the last token's key and value changes the last row only."""
    q, k, v = _qkv(40, 9, 3, 64, seed=1)
    before = cpu_kernels.prefill_attention(q, k, v, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 3.0
    v2[-1] -= 2.0
    after = cpu_kernels.prefill_attention(q, k2, v2, 0.125)
    assert torch.equal(after[:-1], before[:-1]) and not torch.equal(after[-1], before[-1])


def test_refuses_what_it_does_not_take() -> None:
    q, k, v = _qkv(8, 4, 2, 32, seed=2)  # head_dim 32
    with pytest.raises(ValueError, match="prefill_attention"):
        cpu_kernels.prefill_attention(q, k, v, 0.2)
    q, k, v = _qkv(8, 4, 2, 64, seed=3)
    with pytest.raises(ValueError, match="prefill_attention"):
        cpu_kernels.prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.2)
    with pytest.raises(ValueError, match="prefill_attention"):
        cpu_kernels.prefill_attention(q, k[:7], v[:7], 0.2)
    with pytest.raises(ValueError, match="prefill_attention"):  # an out it cannot write
        cpu_kernels.prefill_attention(q, k, v, 0.2, out=torch.empty(8, 64, 4).transpose(1, 2))


def test_writes_the_rows_of_a_given_out() -> None:
    """``out`` given (a slice of a wider step's output): the answer lands there, the rows
    around it untouched."""
    q, k, v = _qkv(100, 9, 3, 64, seed=5)
    step = torch.full((130, 9, 64), 7.0)
    got = cpu_kernels.prefill_attention(q, k, v, 0.125, out=step[20:120])
    assert got.data_ptr() == step[20:120].data_ptr()
    torch.testing.assert_close(step[20:120], _reference(q, k, v, 0.125), atol=2e-5, rtol=2e-5)
    assert (step[:20] == 7.0).all() and (step[120:] == 7.0).all()


@pytest.mark.parametrize(
    ("dtype", "lengths", "kernel_calls"),
    [
        (torch.float32, [96, 70], 1),  # from torch_ops.NATIVE_PREFILL_MIN_TOKENS on
        (torch.bfloat16, [96, 100], 0),  # bf16: SDPA (measured faster there)
        (torch.float32, [20, 33], 0),  # short prompts: SDPA
    ],
    ids=["fp32", "bf16", "fp32-short"],
)
def test_attend_sends_fresh_fp32_prompts_to_it(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, lengths: list[int], kernel_calls: int
) -> None:
    """torch_ops.attend runs a native plan's fresh fp32 prompts of 96 tokens or more through
    the kernel, one call a prompt, with SDPA's output; bf16 and shorter prompts keep SDPA."""
    calls = []
    kernel = cpu_kernels.prefill_attention

    def counted(*args: torch.Tensor | float, **kwargs: torch.Tensor) -> torch.Tensor:
        calls.append(args)
        result: torch.Tensor = kernel(*args, **kwargs)
        return result

    monkeypatch.setattr(cpu_kernels, "prefill_attention", counted)
    heads, kv_heads, dim, block = 9, 3, 64, 16
    rows = sum(lengths)
    q, k, v = (x.to(dtype) for x in _qkv(rows, heads, kv_heads, dim, seed=4))
    k = k.contiguous()
    cache = torch.zeros(14, block, kv_heads, dim, dtype=dtype)
    tables = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]], dtype=torch.int32)
    slots = torch.cat([torch.arange(lengths[0]), 7 * block + torch.arange(lengths[1])])
    starts = [0, lengths[0], rows]
    plan = torch_ops.plan_attention(
        tables, lengths, starts, slots, block, dtype, num_decodes=0, native=True
    )
    out = torch_ops.attend(q, k, v, cache, cache.clone(), plan, dim**-0.5)
    assert len(calls) == kernel_calls
    for start, end in zip(starts, starts[1:], strict=False):
        want = _reference(
            q[start:end].float(), k[start:end].float(), v[start:end].float(), dim**-0.5
        )
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[start:end].float(), want, atol=tol, rtol=tol)
