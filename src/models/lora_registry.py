"""Which LoRA adapters are loaded, and which sit in the device slots a step reads.

Two least-recently-used tiers, as in vLLM:

- the **loaded** tier holds up to ``max_cpu_loras`` adapters in host memory
  (``add_lora`` puts one here; a request naming an adapter that fell out is
  loaded again from its path);
- the **slot** tier maps up to ``max_loras`` of them to device slots
  ``1..max_loras`` of the stacked LoRA weights; slot 0 is the base model.
  One step can use at most ``max_loras`` distinct adapters.

Pinned adapters (``pin``) are exempt from eviction in both tiers, so a pinned
adapter keeps its slot until it is removed. Eviction never picks an adapter the
current step needs. The registry is pure bookkeeping: it decides, and calls
``on_load`` / ``on_slot`` to do the work.

Never imports torch or trio.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

A = TypeVar("A")  # a loaded adapter


class LoRACapacityError(RuntimeError):
    """A tier is full of pinned (or currently needed) adapters."""


class LoRARegistry(Generic[A]):
    """Loaded adapters by int id, with LRU eviction and pins.

    ``load(int_id)`` returns a loaded adapter (it may block and raise: it is the
    caller's loader); ``write_slot(slot, adapter)`` copies it into a device slot.
    """

    def __init__(
        self,
        *,
        max_loras: int,
        max_cpu_loras: int,
        write_slot: Callable[[int, A], None],
    ) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {max_loras}")
        if max_cpu_loras < max_loras:
            raise ValueError(
                f"max_cpu_loras: must be >= max_loras ({max_loras}), got {max_cpu_loras}"
            )
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._write_slot = write_slot
        self._loaded: OrderedDict[int, A] = OrderedDict()  # LRU first
        self._slots: OrderedDict[int, int] = OrderedDict()  # int id -> slot, LRU first
        self._pinned: set[int] = set()

    # ------------------------------------------------------------ queries

    def __contains__(self, int_id: object) -> bool:
        return int_id in self._loaded

    def ids(self) -> list[int]:
        """The loaded adapters' ids, least recently used first."""
        return list(self._loaded)

    def get(self, int_id: int) -> A | None:
        return self._loaded.get(int_id)

    def slot_of(self, int_id: int) -> int | None:
        return self._slots.get(int_id)

    def is_pinned(self, int_id: int) -> bool:
        return int_id in self._pinned

    # ------------------------------------------------------------ changes

    def add(self, int_id: int, adapter: A, *, keep: Iterable[int] = ()) -> list[int]:
        """Hold ``adapter`` under ``int_id`` (replacing an older one); returns evicted ids.

        Evicts the least recently used unpinned adapter not in ``keep`` when the
        tier is full; raises :class:`LoRACapacityError` when none can go.
        """
        evicted: list[int] = []
        if int_id in self._loaded:
            self._loaded.pop(int_id)
            slot = self._slots.get(int_id)
            if slot is not None:  # a replaced adapter's weights are rewritten in place
                self._write_slot(slot, adapter)
        else:
            protected = self._pinned | set(keep)
            while len(self._loaded) >= self.max_cpu_loras:
                victim = next((i for i in self._loaded if i not in protected), None)
                if victim is None:
                    raise LoRACapacityError(
                        f"max_cpu_loras: all {self.max_cpu_loras} loaded adapters are pinned "
                        "or in use; remove one first"
                    )
                self.remove(victim)
                evicted.append(victim)
        self._loaded[int_id] = adapter
        return evicted

    def remove(self, int_id: int) -> bool:
        """Forget an adapter (its slot becomes free). False if it was not loaded."""
        self._pinned.discard(int_id)
        self._slots.pop(int_id, None)
        return self._loaded.pop(int_id, None) is not None

    def pin(self, int_id: int) -> None:
        """Exempt a loaded adapter from eviction and give it a slot for good.

        Raises KeyError when it is not loaded, :class:`LoRACapacityError` when
        every slot is already pinned.
        """
        if int_id not in self._loaded:
            raise KeyError(int_id)
        if int_id not in self._pinned:
            pinned_slots = sum(1 for i in self._slots if i in self._pinned)
            if int_id not in self._slots and pinned_slots >= self.max_loras:
                raise LoRACapacityError(
                    f"max_loras: all {self.max_loras} slots hold pinned adapters"
                )
            self._assign_slots([int_id])
        self._pinned.add(int_id)

    def activate(self, int_ids: Iterable[int]) -> dict[int, int]:
        """Put every adapter of one step in a slot; returns ``{int_id: slot}``.

        Every id must be loaded (KeyError otherwise). Raises
        :class:`LoRACapacityError` when the step names more adapters than the
        slots that pinned adapters leave free.
        """
        wanted = list(dict.fromkeys(int_ids))
        for int_id in wanted:
            if int_id not in self._loaded:
                raise KeyError(int_id)
            self._loaded.move_to_end(int_id)
        self._assign_slots(wanted)
        return {i: self._slots[i] for i in wanted}

    def _assign_slots(self, wanted: list[int]) -> None:
        needed = set(wanted)
        missing = [i for i in wanted if i not in self._slots]
        free = sorted(set(range(1, self.max_loras + 1)) - set(self._slots.values()))
        for int_id in missing:
            if free:
                slot = free.pop(0)
            else:
                victim = next(
                    (i for i in self._slots if i not in needed and i not in self._pinned), None
                )
                if victim is None:
                    raise LoRACapacityError(
                        f"max_loras: one step needs {len(needed)} adapters but only "
                        f"{self.max_loras} slots exist"
                        + (f" ({len(self._pinned)} pinned)" if self._pinned else "")
                    )
                slot = self._slots.pop(victim)
            self._write_slot(slot, self._loaded[int_id])
            self._slots[int_id] = slot
        for int_id in wanted:
            self._slots.move_to_end(int_id)
