"""Backend selection and dispatch: which path runs where, and that no hot path bypasses it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from legato.kernels import get_kernels, triton_available
from legato.models.attention_backend import KernelBackend, select_backend
from legato.models.config import load_model_config
from legato.models.loader import build_model, fill_weights
from legato.models.step_metadata import build_metadata

HOT_PATHS = (
    "write_kv",
    "paged_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "apply_rotary",
    "silu_and_mul",
)


def test_auto_picks_triton_on_cuda_and_torch_on_cpu() -> None:
    if not triton_available():
        pytest.skip("triton cannot run here")
    # Only the device's type matters to the choice, so a CPU machine can ask about CUDA.
    assert select_backend("auto", torch.device("cuda")).name == "triton"
    assert select_backend("auto", torch.device("cpu")).name == "torch"
    assert select_backend("torch", torch.device("cuda")).name == "torch"  # forced either way
    assert select_backend("triton", torch.device("cpu")).name == "triton"


class _Counting:
    """A kernel set whose every function counts its calls, then runs the reference."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        inner = get_kernels("torch")
        for name in HOT_PATHS:
            setattr(self, name, self._wrap(name, getattr(inner, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return call


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_every_hot_path_goes_through_the_kernel_set(
    kind: str, make_checkpoint: Callable[..., Any]
) -> None:
    """One forward of a mixed batch calls each kernel once per layer (norms: as many as
    the model has), with the hints; the output matches transformers."""
    ck = make_checkpoint(kind)
    cfg = load_model_config(ck.path)
    kernels = _Counting()
    backend = KernelBackend("counting", kernels, hints=True)
    model = build_model(cfg, backend, torch.float32, torch.device("cpu"), 64)
    fill_weights(model, ck.path)
    ids = [[5, 9, 2, 7, 1], [3]]
    starts = np.array([0, 0])
    q_lens = np.array([5, 1])
    order = [1, 0]  # decodes first
    table = np.array([[1], [2]], dtype=np.int32)
    meta, _, _ = build_metadata(starts[order], q_lens[order], table[order], 16, torch.device("cpu"))
    flat = torch.tensor(ids[1] + ids[0])
    layers = cfg.num_layers
    shape = (4, 16, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(layers)]
    with torch.inference_mode():
        hidden = model(flat, kv, meta)
        logits = model.compute_logits(hidden)
    qk_norms = 2 * layers if kind == "qwen3" else 0
    assert kernels.calls == {
        "write_kv": layers,
        "paged_attention": layers,
        "rms_norm": 1 + qk_norms,
        "fused_add_rms_norm": 2 * layers,
        "apply_rotary": layers,
        "silu_and_mul": layers,
    }
    with torch.no_grad():
        expected = ck.hf_model(torch.tensor([ids[0]])).logits[0, -1]
    torch.testing.assert_close(logits[-1], expected, rtol=1e-4, atol=1e-4)
