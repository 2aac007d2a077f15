"""The runner's memory: the CPU KV cache costs resident memory only where it is written,
a reset hands its pages back (Linux: figures from /proc/self/status), and a GGUF file's
weights are held as their quantized blocks alone once loaded."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from legato.config import EngineConfig
from legato.models.loader import return_freed_heap
from legato.models.runner import ModelRunner

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")

KV_MB = 256  # a cache far larger than anything else the test allocates


def _anon_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_cpu_kv_cache_is_resident_only_where_written(
    llama: Any, make_runner: Callable[..., ModelRunner], mini_scheduler: Any
) -> None:
    # Loading trims the C heap (return_freed_heap): trim first, so that what earlier tests
    # in this process freed is not handed back inside the measurement.
    gc.collect()
    return_freed_heap()
    before = _anon_mb()
    runner = make_runner(llama, num_kv_blocks=None, kv_cache_memory=KV_MB << 20)
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    assert kv_bytes > (KV_MB - 1) << 20
    assert _anon_mb() - before < KV_MB / 4  # torch.zeros would make all of it resident

    sched = mini_scheduler(runner)
    sched.add("a", list(range(5, 40)), max_tokens=8)
    first = sched.run()["a"]
    assert _anon_mb() - before < KV_MB / 4  # one request writes a few blocks
    assert all(bool(k.any()) for k, _ in runner.kv_caches)  # ... and they hold its KV

    for key, value in runner.kv_caches:  # every page written
        key.fill_(1.0)
        value.fill_(1.0)
    assert _anon_mb() - before > KV_MB * 3 / 4
    runner.reset_kv_cache()
    assert _anon_mb() - before < KV_MB / 4  # the pages went back to the kernel
    assert not any(bool(k.any()) or bool(v.any()) for k, v in runner.kv_caches)

    again = mini_scheduler(runner)
    again.add("a", list(range(5, 40)), max_tokens=8)
    assert again.run()["a"] == first


def test_kv_cache_tensors_keep_their_addresses_across_a_reset(
    llama: Any, make_runner: Callable[..., ModelRunner]
) -> None:
    """The fused decode stack and the decode graphs hold the cache's addresses."""
    runner = make_runner(llama)
    addresses = [t.data_ptr() for pair in runner.kv_caches for t in pair]
    runner.reset_kv_cache()
    assert [t.data_ptr() for pair in runner.kv_caches for t in pair] == addresses


def _live_storages() -> dict[int, int]:
    """Every CPU tensor storage a Python tensor object holds now: data pointer -> bytes."""
    found = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


def test_no_dequantized_copy_survives_load(smollm2_gguf: Path) -> None:
    """The default model's weights held after load are its quantized blocks (Q4_1 repacked:
    1.2x the file's bytes) plus the norms and the rotary table: no fp32 copy of a matrix
    (the tied embedding alone would be 113 MB in fp32)."""
    gc.collect()
    before = _live_storages()
    runner = ModelRunner(EngineConfig(model=str(smollm2_gguf), device="cpu", num_kv_blocks=16))
    gc.collect()
    kv = {t.untyped_storage().data_ptr() for pair in runner.kv_caches for t in pair}
    held = sum(n for ptr, n in _live_storages().items() if ptr not in before and ptr not in kv)
    quantized = runner.model.quantized_bytes()
    size = smollm2_gguf.stat().st_size
    assert 1.1 * size < quantized < 1.25 * size
    assert held - quantized < 4 << 20, f"{(held - quantized) / 2**20:.0f} MB beyond the blocks"


def test_sleep_frees_the_kv_cache_the_decode_stack_held(
    smollm2_gguf: Path, mini_scheduler: Any
) -> None:
    """The default model decodes through the fused decode stack, which holds the KV cache:
    sleeping must let its pages go all the same."""
    config = EngineConfig(model=str(smollm2_gguf), device="cpu", kv_cache_memory=KV_MB << 20)
    runner = ModelRunner(config)
    sched = mini_scheduler(runner)
    sched.add("a", list(range(5, 40)), max_tokens=4)
    sched.run()
    for key, value in runner.kv_caches:
        key.fill_(1.0)
        value.fill_(1.0)
    gc.collect()
    filled = _anon_mb()
    runner.sleep(1)
    gc.collect()
    assert filled - _anon_mb() > KV_MB * 3 / 4
