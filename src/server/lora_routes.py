"""LoRA adapters over HTTP: served as model names, listed in /v1/models, loaded at run time.

As in vLLM:

- ``legato serve --enable-lora --lora-modules name=path ...`` loads adapters at
  start-up (:func:`parse_lora_modules`, :func:`load_lora_modules`); a module
  may also be vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``.
- A request whose ``model`` is an adapter's name runs through that adapter
  (:func:`select_model`); the response names the adapter as its model.
- ``GET /v1/models`` lists the base model, then each adapter with its path as
  ``root`` and the served model (or its ``base_model_name``) as ``parent``.
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
  ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` exist only with
  ``--allow-runtime-lora-updating`` (404 otherwise); a bad adapter is a 400
  naming the field, and the engine keeps serving.

Imports trio (through the handlers' helpers); never torch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from ..protocol.errors import ValidationError
from ..protocol.params import LoRARequest
from .asgi import HTTPError, Request, send_json
from .openai_protocol import parse_request
from .state import ServingState
from .utility_protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

logger = logging.getLogger("legato.server")


def parse_lora_modules(values: Sequence[str]) -> tuple[LoRARequest, ...]:
    """``name=path`` or JSON modules -> LoRARequests with ids 1, 2, ...; ValueError if malformed."""
    modules = []
    for int_id, value in enumerate(values, start=1):
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                modules.append(
                    LoRARequest(spec["name"], int_id, spec["path"], spec.get("base_model_name"))
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"lora_modules: {value!r} is not a JSON object with name and path ({exc})"
                ) from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: expected name=path, got {value!r}")
        modules.append(LoRARequest(name, int_id, path))
    names = [m.lora_name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules: names must be unique, got {names}")
    return tuple(modules)


async def load_lora_modules(state: ServingState) -> None:
    """Load ``settings.lora_modules`` into the engine (a bad one raises its ValidationError)."""
    for module in state.settings.lora_modules:
        await state.engine.add_lora(module)


def _by_name(state: ServingState, name: str) -> LoRARequest | None:
    """The loaded adapter called ``name``, if any (through ``EngineClient.loaded_loras``)."""
    return next((lora for lora in state.engine.loaded_loras() if lora.lora_name == name), None)


def select_model(state: ServingState, model: str | None) -> LoRARequest | None:
    """The adapter a request's ``model`` names (None: the base model).

    404 ``model_not_found`` unless ``model`` is None, a name of the base model
    or a loaded adapter's name.
    """
    if model is None or model in state.aliases:
        return None
    adapter = _by_name(state, model)
    if adapter is None:
        raise HTTPError(
            404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )
    return adapter


def adapter_cards(state: ServingState) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the loaded adapters."""
    return [
        {
            "id": lora.lora_name,
            "object": "model",
            "created": state.created,
            "owned_by": "legato",
            "root": lora.lora_name,  # never a path of the host's file system
            "parent": lora.base_model_name or state.model_name,
            "max_model_len": state.engine.model_info().max_model_len,
        }
        for lora in state.engine.loaded_loras()
    ]


def confined_path(root: str, path: str) -> Path | None:
    """``path`` (relative to ``root``, or absolute) with symlinks resolved, if it lies
    under ``root``; None otherwise. Touches the file system: call it in a thread."""
    resolved = Path(root, path).resolve()
    return resolved if resolved.is_relative_to(Path(root).resolve()) else None


def _check_allowed(state: ServingState) -> None:
    if not state.settings.allow_runtime_lora_updating:
        raise HTTPError(
            404,
            "loading adapters at run time is off: start the server with "
            "--allow-runtime-lora-updating",
            code="not_found",
        )


async def load_lora_adapter(request: Request, state: ServingState) -> None:
    """``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``: 200 once loaded."""
    _check_allowed(state)
    state.check_available()
    body = await request.json(state.settings.max_body_bytes)
    load: LoadLoRAAdapterRequest = parse_request(LoadLoRAAdapterRequest, body)
    name, path = load.lora_name, load.lora_path
    if not name or name in state.aliases or _by_name(state, name) is not None:
        raise ValidationError("lora_name", f"{name!r} is already a served model name")
    int_id = max((lora.lora_int_id for lora in state.engine.loaded_loras()), default=0) + 1
    root = state.settings.lora_root
    assert root is not None  # ServerSettings requires it with allow_runtime_lora_updating
    resolved = await trio.to_thread.run_sync(confined_path, root, path)
    if resolved is None:
        raise ValidationError("lora_path", "must name an adapter directory under --lora-root")
    try:
        await state.engine.add_lora(LoRARequest(name, int_id, str(resolved)))
    except ValidationError as exc:
        if exc.field != "lora_path":
            raise
        # One answer for every unreadable path: no oracle for the host's files.
        logger.warning("loading adapter %r from %s failed: %s", name, resolved, exc.reason)
        raise ValidationError("lora_path", "is not a loadable adapter directory") from None
    await send_json(request.send, 200, {"message": f"LoRA adapter {name!r} loaded", "id": int_id})


async def unload_lora_adapter(request: Request, state: ServingState) -> None:
    """``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: 200 once unloaded; 404 if unknown."""
    _check_allowed(state)
    state.check_available()
    body = await request.json(state.settings.max_body_bytes)
    name = parse_request(UnloadLoRAAdapterRequest, body).lora_name
    adapter = _by_name(state, name)
    if adapter is None:
        raise HTTPError(404, f"no LoRA adapter named {name!r}", param="lora_name", code="not_found")
    await state.engine.remove_lora(adapter.lora_int_id)
    await send_json(request.send, 200, {"message": f"LoRA adapter {name!r} unloaded"})
