"""The model runner's LoRA state: loaded adapters, slots, and which request uses which.

:class:`RunnerLoRA` ties the three LoRA parts together for a
:class:`~legato.models.runner.ModelRunner`:

- :mod:`~legato.models.lora_adapter` reads PEFT directories,
- :mod:`~legato.models.lora_registry` keeps them (``max_cpu_loras`` loaded,
  ``max_loras`` in device slots, LRU, pins),
- :mod:`~legato.models.lora_layers` holds the slot weights and applies them.

``add`` / ``remove`` / ``pin`` / ``ids`` serve the engine's ``add_lora`` family;
``track`` / ``forget`` follow the requests the runner holds; ``unreadable``
loads again the adapters of a step's requests that were evicted from host
memory, and names the requests whose adapter can no longer be read (they fail
alone; the step goes on without them); ``begin_step`` puts the step's adapters
in slots and announces each token's slot.

Never imports trio.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from ..protocol.params import LoRARequest
from .config import ModelConfig
from .lora_adapter import LoRAAdapter, LoRAError, load_peft_adapter
from .lora_layers import LoRALayers
from .lora_registry import LoRACapacityError, LoRARegistry

logger = logging.getLogger(__name__)


class RunnerLoRA:
    """LoRA for one model: ``max_loras`` slots of rank ``max_lora_rank``."""

    def __init__(
        self,
        model: nn.Module,
        cfg: ModelConfig,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None,
        dtype: torch.dtype,
        device: torch.device,
        use_triton: bool,
    ) -> None:
        self.model_config = cfg
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.layers = LoRALayers(
            model, cfg, max_loras=max_loras, max_lora_rank=max_lora_rank,
            dtype=dtype, device=device, use_triton=use_triton,
        )  # fmt: skip
        self.registry: LoRARegistry[LoRAAdapter] = LoRARegistry(
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras or max_loras,
            write_slot=self.layers.write_slot,
        )
        self._requests: dict[str, LoRARequest] = {}  # held request -> its adapter

    # ------------------------------------------------------------ adapters

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """Read ``request``'s adapter from disk (blocks); LoRAError when it cannot serve."""
        if not request.lora_path:
            raise LoRAError("lora_path", f"adapter {request.lora_name!r} has no lora_path")
        return load_peft_adapter(
            request.lora_path,
            self.model_config,
            name=request.lora_name,
            int_id=request.lora_int_id,
            max_lora_rank=self.max_lora_rank,
            dtype=self.dtype,
        )

    def add(self, request: LoRARequest, *, keep: tuple[int, ...] = ()) -> bool:
        """Load ``request``'s adapter into host memory (again, if its id is loaded).

        Returns True. Raises LoRAError for an adapter that cannot be served and
        LoRACapacityError when every loaded adapter is pinned.
        """
        adapter = self.load(request)
        evicted = self.registry.add(request.lora_int_id, adapter, keep=keep)
        if evicted:
            logger.info("LoRA adapters %s evicted from host memory (LRU)", evicted)
        return True

    def remove(self, int_id: int) -> bool:
        return self.registry.remove(int_id)

    def pin(self, int_id: int) -> bool:
        """Exempt a loaded adapter from eviction; False when it is not loaded."""
        try:
            self.registry.pin(int_id)
        except KeyError:
            return False
        return True

    def ids(self) -> set[int]:
        return set(self.registry.ids())

    # ------------------------------------------------------------ requests

    def track(self, req_id: str, request: LoRARequest | None) -> None:
        if request is None:
            self._requests.pop(req_id, None)
        else:
            self._requests[req_id] = request

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    # --------------------------------------------------------------- steps

    def unreadable(self, req_ids: list[str]) -> dict[str, str]:
        """Load again every adapter of ``req_ids`` evicted from host memory; the requests
        whose adapter cannot be read any more (its files gone or corrupt), each with
        an error naming the adapter. Never raises for an adapter's files; blocks."""
        wanted = [self._requests.get(r) for r in req_ids]
        needed = {w.lora_int_id: w for w in wanted if w is not None}
        broken: dict[int, str] = {}
        for int_id, request in needed.items():
            if int_id in self.registry:
                continue
            try:  # its files were checked when it was added: any failure is theirs now
                self.add(request, keep=tuple(needed))
            except LoRACapacityError:
                raise
            except Exception as exc:
                broken[int_id] = (
                    f"LoRA adapter {request.lora_name!r} (id {int_id}) was evicted from host "
                    f"memory and cannot be read again from {request.lora_path!r}: {exc}"
                )
                logger.warning("%s", broken[int_id])
        return {
            r: broken[w.lora_int_id]
            for r, w in zip(req_ids, wanted, strict=True)
            if w is not None and w.lora_int_id in broken
        }

    def begin_step(self, req_ids: list[str], q_lens: np.ndarray) -> bool:
        """Slot every adapter the step's requests use; announce per-token slots.

        ``req_ids`` are the scheduled requests in the flat batch's order, each
        computing ``q_lens[i]`` tokens. Returns whether any token uses an adapter.
        Raises LoRACapacityError when the step needs more adapters than slots
        (call ``unreadable`` first: an evicted adapter is read here only as a
        fallback, and a failure to read it fails the step).
        """
        wanted = [self._requests.get(r) for r in req_ids]
        needed = {w.lora_int_id: w for w in wanted if w is not None}
        if not needed:
            self.layers.begin_step(None)
            return False
        for int_id, request in needed.items():
            if int_id not in self.registry:  # evicted from host memory: read it again
                self.add(request, keep=tuple(needed))
        slots = self.registry.activate(needed)
        per_request = np.fromiter(
            (0 if w is None else slots[w.lora_int_id] for w in wanted),
            dtype=np.int64,
            count=len(wanted),
        )
        self.layers.begin_step(np.repeat(per_request, q_lens))
        return True


__all__ = ["LoRACapacityError", "LoRAError", "RunnerLoRA"]
