"""The native CPU kernels agree with their plain-torch twins (legato.models.torch_ops),
refuse what they cannot take without writing anything, and switch off cleanly."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from legato.kernels import reference
from legato.models import cpu_kernels, torch_ops
from legato.models.attention_backend import TorchBackend, select_backend
from legato.models.config import RopeConfig
from legato.models.rotary import rope_cos_sin_cache

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="the native CPU kernels did not build here"
)

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def bf16_dot(request: pytest.FixtureRequest) -> Iterator[bool]:
    """bf16 decode attention pinned to vdpbf16ps (True; skipped on a CPU without
    AVX512_BF16) or to its widening fallback (False) for the test, then restored."""
    wanted: bool = request.param
    before = cpu_kernels.attention_bf16_dot()
    if cpu_kernels.attention_bf16_dot(wanted) != wanted:
        cpu_kernels.attention_bf16_dot(before)
        pytest.skip("this CPU has no AVX512_BF16")
    yield wanted
    cpu_kernels.attention_bf16_dot(before)


@pytest.mark.parametrize(
    ("dtype", "bf16_dot"),
    [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
    indirect=["bf16_dot"],
    ids=["float32", "bfloat16-widened", "bfloat16-dpbf16"],
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block"),
    [
        (4, 2, 16, 4),
        (6, 6, 64, 16),
        (8, 2, 128, 32),
        (4, 4, 24, 16),
        (8, 4, 64, 16),
        (9, 3, 64, 16),
        (6, 2, 48, 16),
        (4, 2, 32, 32),
    ],
)
def test_decode_attention_matches_reference(
    dtype: torch.dtype, bf16_dot: bool, heads: int, kv_heads: int, head_dim: int, block: int
) -> None:
    """Blocks shuffled over the pool, junk past each table's used entries, lengths that end
    mid-block and one that is a single token. The kernel reads 16 tokens at a time (a block
    of 4 spans four blocks, one of 32 two chunks); a head_dim that is not a multiple of 16
    (24) takes its scalar loops; 48 and 32 leave 3 and 2 of the value pass's 16-wide slices
    after its groups of 4 (128: two groups); 9:3 is the default model's GQA. bf16 runs both ways: widened to fp32, and on vdpbf16ps
    (head_dim a multiple of 32; q and the probabilities rounded to bf16 as the reference
    rounds them); both within the bf16 tolerance of the plain-torch reference."""
    lens = [1, block, 3 * block + 1, 5 * block - 1]
    num_blocks = sum(-(-n // block) for n in lens) + 2
    key_cache = _randn(num_blocks, block, kv_heads, head_dim, dtype=dtype, seed=1)
    value_cache = _randn(num_blocks, block, kv_heads, head_dim, dtype=dtype, seed=2)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).int()
    table = torch.full((len(lens), max(-(-n // block) for n in lens) + 1), 999, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        table[i, : -(-n // block)] = perm[used : used + -(-n // block)]
        used += -(-n // block)
    query = _randn(len(lens), heads, head_dim, dtype=dtype, seed=4)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = cpu_kernels.decode_attention(query, key_cache, value_cache, table, seq_lens, 0.3)
    safe = table.masked_fill(table == 999, 0)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    expected = reference.paged_attention(query, key_cache, value_cache, safe, seq_lens, starts, 0.3)
    torch.testing.assert_close(got.float(), expected.float(), **_tol(dtype))


def test_decode_attention_refuses_a_block_outside_the_cache() -> None:
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="decode_attention"):
        cpu_kernels.decode_attention(
            torch.zeros(1, 1, 8),
            cache,
            cache,
            torch.tensor([[5]], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32),
            1.0,
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_torch_and_skips_padding(dtype: torch.dtype) -> None:
    k_cache, v_cache = torch.zeros(4, 4, 2, 8, dtype=dtype), torch.zeros(4, 4, 2, 8, dtype=dtype)
    kv = _randn(5, 2, 2, 8, dtype=dtype)  # strided rows, as split off a fused qkv
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.tensor([3, 0, 15, -1, 6])
    cpu_kernels.write_kv(key, value, k_cache, v_cache, slots)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    keep = slots >= 0
    torch_ops.write_kv(key[keep], value[keep], ref_k, ref_v, slots[keep])
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_write_kv_refuses_a_slot_past_the_cache_before_writing() -> None:
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="write_kv"):
        cpu_kernels.write_kv(
            torch.ones(2, 1, 8), torch.ones(2, 1, 8), k_cache, v_cache, torch.tensor([1, 8])
        )
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_matches_torch(dtype: torch.dtype, fused: bool) -> None:
    x = _randn(70, 2 * 520, dtype=dtype)[:, :520]  # strided rows; over the parallel threshold
    weight = _randn(520, dtype=dtype, seed=1)
    if fused:
        residual = _randn(70, 520, dtype=dtype, seed=2)
        expected, expected_residual = torch_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
        got = cpu_kernels.rms_norm(x, weight, 1e-6, residual=residual)
        torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    else:
        expected = torch_ops.rms_norm(x, weight, 1e-6)
        got = cpu_kernels.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(got.float(), expected.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    x = _randn(33, 2 * 300, dtype=dtype) * 6  # exp's range, saturation included
    x[0, 0], x[0, 1] = -100.0, 100.0
    torch.testing.assert_close(
        cpu_kernels.silu_and_mul(x).float(), torch_ops.silu_and_mul(x).float(), **_tol(dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_neox_in_place_matches_torch(dtype: torch.dtype) -> None:
    cache = rope_cos_sin_cache(32, RopeConfig(theta=10000.0), 64, torch.device("cpu"))
    qkv = _randn(9, 7, 32, dtype=dtype)
    qk = qkv[:, :5]  # a strided view, as the model passes it
    positions = torch.tensor([0, 1, 5, 63, 2, 2, 40, 7, 8])
    cos, sin = torch_ops.rotary_tables(cache, positions, dtype)
    expected = torch_ops.rotate_neox(qk, cos, sin)
    untouched = qkv[:, 5:].clone()
    cpu_kernels.rotary_neox(qk, positions, cache)
    torch.testing.assert_close(qk.float(), expected.float(), **_tol(dtype))
    assert torch.equal(qkv[:, 5:], untouched)
    with pytest.raises(ValueError, match="rotary_neox"):
        cpu_kernels.rotary_neox(qk, torch.full((9,), 64), cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_torch_including_ties_and_nan(dtype: torch.dtype) -> None:
    """fp32 rows, and bf16 rows (the logits of a bf16 model, argmaxed without an fp32 copy
    of the batch) with the answer of their fp32 values; a column slice of a wider tensor."""
    wide = _randn(6, 1100, dtype=torch.float32).to(dtype)
    x = wide[:, 50:1050]
    x[1, 10] = x[1, 900] = 50.0  # a tie: the first wins
    x[2, 333] = float("nan")  # NaN counts as largest
    x[3] = float("-inf")
    x[4, 999] = 1e4  # the last column
    x[5, 500] = 65.0  # bf16: 65 beside 64.5 and 64.0 in its own row, each exact there
    x[5, 499], x[5, 501] = 64.5, 64.0
    assert torch.equal(cpu_kernels.argmax(x), x.float().argmax(dim=-1))
    assert cpu_kernels.argmax(x)[5] == 500


@pytest.fixture
def kernels_switched_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    yield
    monkeypatch.setattr(cpu_kernels, "_loaded", None)


def test_switched_off_kernels_leave_the_torch_path(kernels_switched_off: None) -> None:
    assert cpu_kernels.load() is None
    backend = select_backend("torch", torch.device("cpu"))
    assert isinstance(backend, TorchBackend) and not backend.native
    x = _randn(3, 16, dtype=torch.float32)
    torch.testing.assert_close(backend.silu_and_mul(x), torch_ops.silu_and_mul(x))
    with pytest.raises(RuntimeError, match="not available"):
        cpu_kernels.argmax(x)


def test_a_compiler_that_fails_leaves_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", "false")  # exits 1 for --version and for the build
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    assert cpu_kernels.load() is None
    assert "native CPU kernels unavailable" in caplog.text
    monkeypatch.setattr(cpu_kernels, "_loaded", None)


def test_every_part_is_included_and_in_the_build_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """cpu_kernels.cpp includes each header of native/ (and nothing else from there), and
    the build's key covers each part's text: an edit to a part rebuilds the library."""
    parts = sorted(p.name for p in cpu_kernels.PARTS.glob("*.h"))
    included = re.findall(r'^#include "native/([^"]+)"', cpu_kernels.SOURCE.read_text(), re.M)
    assert parts and sorted(included) == parts
    before = cpu_kernels._source_texts()
    copy = tmp_path / "native"
    shutil.copytree(cpu_kernels.PARTS, copy)
    edited = copy / parts[0]
    edited.write_text(edited.read_text() + "\n// edited\n")
    monkeypatch.setattr(cpu_kernels, "PARTS", copy)
    assert cpu_kernels._source_texts() != before
