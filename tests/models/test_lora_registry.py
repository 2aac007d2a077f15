"""The LoRA registry's two LRU tiers (host memory, device slots) and pins."""

from __future__ import annotations

import pytest

from legato.models.lora_registry import LoRACapacityError, LoRARegistry


def _registry(
    max_loras: int, max_cpu_loras: int
) -> tuple[LoRARegistry[str], list[tuple[int, str]]]:
    writes: list[tuple[int, str]] = []
    reg: LoRARegistry[str] = LoRARegistry(
        max_loras=max_loras,
        max_cpu_loras=max_cpu_loras,
        write_slot=lambda slot, adapter: writes.append((slot, adapter)),
    )
    return reg, writes


def test_host_tier_evicts_least_recently_used() -> None:
    reg, _ = _registry(1, 2)
    assert reg.add(1, "a") == [] and reg.add(2, "b") == []
    reg.activate([1])  # 1 is now the most recently used
    assert reg.add(3, "c") == [2]
    assert reg.ids() == [1, 3]


def test_slots_are_reused_lru_and_written_once() -> None:
    reg, writes = _registry(2, 4)
    for i, name in enumerate("abcd", start=1):
        reg.add(i, name)
    assert reg.activate([1, 2]) == {1: 1, 2: 2}
    assert reg.activate([2, 1]) == {2: 2, 1: 1}  # already in place: nothing written
    assert writes == [(1, "a"), (2, "b")]
    assert reg.activate([3]) == {3: 2}  # 2 was least recently used of the two
    assert writes[-1] == (2, "c") and reg.slot_of(2) is None and reg.slot_of(1) == 1


def test_pinned_adapters_are_never_evicted() -> None:
    reg, _ = _registry(2, 2)
    reg.add(1, "a")
    reg.pin(1)
    assert reg.slot_of(1) is not None  # pinning puts it in a slot for good
    reg.add(2, "b")
    assert reg.add(3, "c") == [2]  # 1 is older but pinned
    assert reg.activate([3]) == {3: 2}
    reg.add(4, "d")
    assert reg.activate([4]) == {4: 2}
    assert reg.slot_of(1) == 1
    assert reg.ids() == [1, 4]  # adding 4 evicted 3 (not the pinned 1) from host memory
    with pytest.raises(KeyError):
        reg.activate([3])


def test_step_needing_more_adapters_than_slots_is_refused() -> None:
    reg, _ = _registry(2, 3)
    for i in (1, 2, 3):
        reg.add(i, str(i))
    with pytest.raises(LoRACapacityError, match="one step needs 3 adapters but only 2 slots"):
        reg.activate([1, 2, 3])


def test_full_of_pins_refuses_more() -> None:
    reg, _ = _registry(1, 1)
    reg.add(1, "a")
    reg.pin(1)
    with pytest.raises(LoRACapacityError, match="max_cpu_loras"):
        reg.add(2, "b")
    reg2, _ = _registry(1, 2)
    reg2.add(1, "a")
    reg2.add(2, "b")
    reg2.pin(1)
    with pytest.raises(LoRACapacityError, match="max_loras: all 1 slots hold pinned"):
        reg2.pin(2)
    with pytest.raises(KeyError):
        reg2.pin(9)


def test_needed_adapters_are_kept_while_loading_another() -> None:
    reg, _ = _registry(2, 2)
    reg.add(1, "a")
    reg.add(2, "b")
    assert reg.add(3, "c", keep=(1,)) == [2]


def test_remove_frees_the_slot_and_replace_rewrites_it() -> None:
    reg, writes = _registry(1, 2)
    reg.add(1, "a")
    reg.activate([1])
    reg.add(1, "a2")  # the same id again: its slot is rewritten in place
    assert writes == [(1, "a"), (1, "a2")]
    assert reg.remove(1) and not reg.remove(1)
    reg.add(2, "b")
    assert reg.activate([2]) == {2: 1}


def test_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="max_cpu_loras: must be >= max_loras"):
        _registry(2, 1)
    with pytest.raises(ValueError, match="max_loras"):
        _registry(0, 1)
