"""The scheduler's LoRA rule: at most ``max_loras`` distinct adapters among running requests.

The model runner has ``max_loras`` device slots and every adapter a step
uses must hold one, so the scheduler admits a waiting request only if its
adapter is already running or a slot is left. Running requests are never
refused: they were admitted under this rule, so they fit together.

Pure Python, driven synchronously: never imports torch or trio.
"""

from __future__ import annotations

from collections.abc import Iterable

from .request_state import Request


class AdapterLimit:
    """``admits(request, running)``: whether ``request`` may start beside ``running``.

    ``max_loras`` None: no limit (LoRA disabled; the runner refuses adapters).
    """

    def __init__(self, max_loras: int | None) -> None:
        self.max_loras = max_loras

    def admits(self, request: Request, running: Iterable[Request]) -> bool:
        lora = request.lora_request
        if lora is None or self.max_loras is None:
            return True
        active: set[int] = set()
        for other in running:
            if other.lora_request is not None:
                if other.lora_request.lora_int_id == lora.lora_int_id:
                    return True
                active.add(other.lora_request.lora_int_id)
        return len(active) < self.max_loras


def requests_per_adapter(requests: Iterable[Request]) -> dict[str, int]:
    """How many of ``requests`` run through each LoRA adapter, by adapter name."""
    counts: dict[str, int] = {}
    for req in requests:
        if req.lora_request is not None:
            name = req.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts
