"""The engine's LoRA adapters: which are loaded, by name and id, and the worker calls that load them.

:class:`EngineAdapters` is the facade-side half of LoRA (the model runner's
:mod:`legato.models.lora` is the other). ``add`` has the worker read and
check the PEFT directory (a checkpoint; it blocks the caller, not the
engine) and remembers the adapter under its name, so the server can select
it by model name. ``ensure`` is what ``generate`` / ``encode`` call for a
request's ``lora_request``: a known adapter costs nothing, an unknown one is
loaded first, and one that cannot be loaded fails that request alone with a
``ValidationError`` naming the field at fault (the engine lives).

The worker's ValidationError crosses the process boundary as its field and
reason (``UtilityResult.error_field`` / ``error_reason``); :func:`adapter_error`
hands it on.

Trio: every method that talks to the worker is a checkpoint; a caller
cancelled while waiting stops waiting, the worker still finishes the call
(an adapter may then be loaded in the worker and not listed here: the next
``ensure`` loads it again, harmlessly).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from .protocol.errors import ValidationError
from .protocol.params import LoRARequest, check_lora_request

WorkerCall = Callable[..., Awaitable[Any]]


def adapter_error(exc: Exception) -> ValidationError:
    """The worker's own ValidationError (``LoRAError``: its field and reason), carried
    across the boundary as fields by ``WorkerCallError.validation``; other failures
    (every loaded adapter pinned, say) name ``lora_request``."""
    validation = getattr(exc, "validation", None)
    if isinstance(validation, ValidationError):
        return validation
    return ValidationError("lora_request", str(exc))


class EngineAdapters:
    """Loaded adapters by int id (and name), for an engine with ``enabled`` LoRA.

    ``call(method, *args)`` runs a ModelRunner method on the worker and raises
    ``WorkerCallError`` (any exception with the worker's message) if it raised.
    """

    def __init__(self, enabled: bool, call: WorkerCall, call_error: type[Exception]) -> None:
        self.enabled = enabled
        self._call = call
        self._call_error = call_error
        self._by_id: dict[int, LoRARequest] = {}

    def _check(self, value: object, field: str = "lora_request") -> LoRARequest:
        lora = check_lora_request(value, field)
        if not self.enabled:
            raise ValidationError(
                field, "LoRA adapters need an engine started with enable_lora=True"
            )
        return lora

    def by_name(self, name: str) -> LoRARequest | None:
        """The loaded adapter called ``name``, if any."""
        for lora in self._by_id.values():
            if lora.lora_name == name:
                return lora
        return None

    def loaded(self) -> list[LoRARequest]:
        """Every adapter added and not removed, by int id."""
        return [self._by_id[i] for i in sorted(self._by_id)]

    async def add(self, lora: object) -> bool:
        """Load (or reload) an adapter on the worker. True once loaded.

        Raises ValidationError naming the field: not a LoRARequest, LoRA not
        enabled, a name already used by another id, or an adapter the worker
        refuses (bad path, rank above max_lora_rank, unknown module...).
        """
        request = self._check(lora)
        named = self.by_name(request.lora_name)
        if named is not None and named.lora_int_id != request.lora_int_id:
            raise ValidationError(
                "lora_name",
                f"{request.lora_name!r} is already loaded with lora_int_id {named.lora_int_id}",
            )
        try:
            await self._call("add_lora", dataclasses.asdict(request))
        except self._call_error as exc:
            raise adapter_error(exc) from None
        self._by_id[request.lora_int_id] = request
        return True

    async def ensure(self, lora: object) -> LoRARequest:
        """``lora`` loaded, for a request about to run through it (see ``add``)."""
        request = self._check(lora)
        if self._by_id.get(request.lora_int_id) != request:
            await self.add(request)
        return request

    async def remove(self, lora_id: int) -> bool:
        """Unload an adapter; False if it was not loaded. Requests already running
        through it finish through it (the worker reads it again if it must)."""
        if lora_id not in self._by_id:
            return False
        del self._by_id[lora_id]
        return bool(await self._call("remove_lora", lora_id))

    async def pin(self, lora_id: int) -> bool:
        """Exempt a loaded adapter from eviction; False if it is not loaded."""
        if lora_id not in self._by_id:
            return False
        return bool(await self._call("pin_lora", lora_id))

    def ids(self) -> set[int]:
        """The int ids of the loaded adapters."""
        return set(self._by_id)
