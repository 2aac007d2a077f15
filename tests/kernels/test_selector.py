"""The kernel selector: cheap import, both backends with the same call signatures."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import legato.kernels as kernels
from legato.kernels import KernelSet, get_kernels, triton_available


def test_import_is_cheap() -> None:
    """``import legato.kernels`` itself pulls in neither torch nor triton."""
    code = (
        "import sys, legato; before = set(sys.modules); import legato.kernels; "
        "added = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "assert not added & {'torch', 'triton'}, added"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_triton_available_here() -> None:
    # conftest turns the interpreter on where there is no CUDA device.
    assert triton_available()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernel_sets_agree(device: str, backend: kernels.Backend) -> None:
    ks = get_kernels(backend)
    assert isinstance(ks, KernelSet) and ks.backend == backend
    x = torch.randn(3, 2 * 32, device=device)
    torch.testing.assert_close(ks.silu_and_mul(x), get_kernels("torch").silu_and_mul(x))
    # paged_attention takes the sync-avoiding hints on either backend.
    cache = torch.randn(2, 16, 1, 32, device=device)
    query = torch.randn(1, 2, 32, device=device)
    table = torch.tensor([[1]], dtype=torch.int32, device=device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=device)
    out = ks.paged_attention(
        query, cache, cache, table, lens, starts, 0.2, max_query_len=1, max_seq_len=5
    )
    expected = get_kernels("torch").paged_attention(query, cache, cache, table, lens, starts, 0.2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_kernels("cuda")  # type: ignore[arg-type]


def test_triton_backend_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs triton"):
        get_kernels("triton")
