"""The plain-torch multi-LoRA path (gather + batched matmul) against the per-token reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from legato.kernels import reference
from legato.models.lora_layers import LoRAStack, ProjectionSpec, _torch_plan, add_lora_torch


@pytest.mark.parametrize(
    "slots",
    [
        [2, 2, 2, 2],  # one adapter, every token: plain matmuls
        [0, 1, 0, 0, 1, 1],  # one adapter and the base
        [3, 0, 1, 2, 1, 3, 3, 0, 2],  # three adapters and the base, decode-like
        [1, 3, 3, 1, 3],  # two adapters, every token (slot 2 an empty group)
        [1] * 9 + [0] * 4 + [3] * 17 + [2] * 2,  # prefill-like runs
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_reference(slots: list[int], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(len(slots))
    spec = ProjectionSpec("self_attn.qkv_proj", ("q", "k", "v"), 32, (24, 8, 8))
    stack = LoRAStack(spec, num_slots=4, rank=4, dtype=dtype, device=torch.device("cpu"))
    stack.a[1:] = (torch.randn(stack.a[1:].shape, generator=g) * 0.2).to(dtype)
    stack.b[1:] = (torch.randn(stack.b[1:].shape, generator=g) * 0.2).to(dtype)
    x = torch.randn(len(slots), 32, generator=g).to(dtype)
    y = torch.randn(len(slots), 40, generator=g).to(dtype)
    token_slots = np.asarray(slots)
    expected = y.clone()
    reference.add_lora(
        expected, x, stack.a, stack.b, torch.from_numpy(token_slots), spec.out_features
    )
    got = y.clone()
    add_lora_torch(got, x, stack, _torch_plan(token_slots, torch.device("cpu")))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, expected, **tol)
    base = token_slots == 0
    assert torch.equal(got[base], y[base])
    assert not torch.allclose(got[~base], y[~base])


def test_slot_write_pads_rank_and_zeroes_missing_slices() -> None:
    from legato.models.lora_adapter import LoRAWeights

    spec = ProjectionSpec("mlp.gate_up_proj", ("gate_proj", "up_proj"), 8, (6, 6))
    stack = LoRAStack(spec, num_slots=2, rank=4, dtype=torch.float32, device=torch.device("cpu"))
    stack.a.fill_(7.0)
    w = LoRAWeights(a=torch.ones(2, 8), b=torch.full((6, 2), 3.0))
    stack.write(1, [None, w])
    assert torch.count_nonzero(stack.a[1, :4]) == 0  # gate has no update
    assert torch.equal(stack.a[1, 4:6], torch.ones(2, 8))
    assert torch.count_nonzero(stack.a[1, 6:]) == 0  # rank 2 padded to 4
    assert torch.count_nonzero(stack.b[1, :6]) == 0
    assert torch.equal(stack.b[1, 6:, :2], torch.full((6, 2), 3.0))
    assert torch.count_nonzero(stack.b[1, 6:, 2:]) == 0
    assert torch.all(stack.a[0] == 7.0)  # other slots untouched
