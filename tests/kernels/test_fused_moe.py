"""Triton fused MoE against the plain-torch reference (fp32 under the interpreter on CPU).

Tiny shapes keep the interpreter fast: few experts, odd token counts, top-2, an
expert with no tokens and one with more pairs than a block, hidden and
intermediate sizes that are not powers of two (masked column and K tiles).
"""

from __future__ import annotations

import pytest
import torch

from legato.kernels import fused_moe, reference
from legato.models.attention_backend import select_backend
from legato.models.moe import grouped_experts, route


def _case(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, device: str, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, -1] = -1e4  # the last expert gets no tokens
    logits[:, 0] += 3.0  # expert 0 gets most tokens (more than one block when tokens > 16)
    weights, chosen = route(logits, top_k, renormalize=True)
    return tuple(t.to(device) for t in (x, w13, w2, weights, chosen))


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts"),
    [(7, 40, 80, 4), (1, 24, 20, 3), (19, 40, 24, 5)],
)
def test_fused_moe_matches_reference(
    device: str, tokens: int, hidden: int, inter: int, experts: int
) -> None:
    x, w13, w2, weights, chosen = _case(tokens, hidden, inter, experts, 2, device, seed=tokens)
    out = fused_moe.fused_moe(x, w13, w2, weights, chosen)
    want = reference.fused_moe(x, w13, w2, weights, chosen)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_align_groups_every_pair_once_one_expert_per_block(device: str) -> None:
    *_, chosen = _case(19, 8, 8, 5, 2, device, seed=3)
    sorted_pairs, block_experts, num_padded = fused_moe.align_by_expert(chosen, 5)
    used = sorted_pairs[: int(num_padded)].cpu()
    real = used[used < chosen.numel()]
    assert sorted(real.tolist()) == list(range(chosen.numel()))
    flat = chosen.reshape(-1).cpu()
    for b, expert in enumerate(block_experts[: int(num_padded) // fused_moe.BLOCK_M].tolist()):
        block = used[b * fused_moe.BLOCK_M : (b + 1) * fused_moe.BLOCK_M]
        block = block[block < chosen.numel()]
        assert block.numel() > 0 and (flat[block.long()] == expert).all(), b


def test_triton_backend_routes_experts_through_the_fused_kernel(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's grouped_experts on the Triton backend runs the fused kernel (a spy
    that delegates counts the calls) and equals the torch backend's result."""
    calls: list[int] = []
    real = fused_moe.fused_moe

    def spy(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(fused_moe, "fused_moe", spy)
    x, w13, w2, weights, chosen = _case(9, 40, 24, 4, 2, device, seed=5)
    got = grouped_experts(x, w13, w2, weights, chosen, select_backend("triton", x.device))
    want = grouped_experts(x, w13, w2, weights, chosen, select_backend("torch", x.device))
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
