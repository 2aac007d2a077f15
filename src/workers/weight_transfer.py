"""vLLM's weight-update calls on the worker: its "disk" backend, a local checkpoint.

vLLM's RL flow updates a running engine's weights in four calls, each a
``collective_rpc`` to every worker: ``init_weight_transfer_engine(init_info)``,
``start_weight_update()``, ``update_weights(update_info)`` (one or more),
``finish_weight_update()``. Of vLLM's backends, legato has the one that needs
no transport of its own: vLLM's ``"disk"`` backend, where ``update_info`` is
``{"path": "/abs/dir"}``, a checkpoint of the same architecture that every
rank can read. Each rank loads its own share of it between two steps (frames
are handled in order), so the next step runs on the new weights. The NCCL,
IPC and other transports (tensors streamed from a trainer) are not here; their
``init_info`` keys are refused by name.

As vLLM's disk backend: one checkpoint per update, between ``start`` and
``finish``; ``update_weights`` before ``start``, a second checkpoint, or
``finish`` without one raise RuntimeError; a bad ``path`` raises ValueError.
The worker reports each failure as the call's error and stays healthy.

Never imports trio or torch (the runner does the loading).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_WEIGHT_FILES = (".safetensors", ".gguf")


class DiskWeightTransfer:
    """One worker's weight-update session (see the module docstring)."""

    METHODS = frozenset(
        {"init_weight_transfer_engine", "start_weight_update", "update_weights",
         "finish_weight_update"}
    )  # fmt: skip

    def __init__(self, runner: object) -> None:
        """``runner``: the worker's runner; its ``reload_weights(model_dir)`` loads (the
        null-model runner has none: every update is then refused)."""
        self._runner = runner
        self._initialized = False
        self._active = False
        self._loaded = False

    def init_weight_transfer_engine(self, init_info: dict[str, Any] | None = None) -> None:
        """vLLM's disk backend takes no init info: any key is refused by name."""
        if init_info:
            raise ValueError(
                f"init_info: the disk weight transfer takes no init info, got {sorted(init_info)}"
                " (legato updates weights from a local checkpoint only)"
            )
        self._initialized = True

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        if not is_checkpoint_format:
            raise ValueError("is_checkpoint_format: the disk backend loads checkpoint format only")
        if not self._initialized:
            raise RuntimeError("init_weight_transfer_engine must be called first")
        if self._active:
            raise RuntimeError("A shared-disk weight update is already active")
        self._active, self._loaded = True, False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load the checkpoint at ``update_info["path"]`` (absolute, a local directory
        holding the weights) into the model, this rank's share. Any failure ends the
        session, as vLLM's disk backend's does."""
        if not self._active:
            raise RuntimeError("start_weight_update must be called before loading a checkpoint")
        try:
            self._load(update_info)
        except Exception:
            self._active = False
            raise
        self._loaded = True

    def _load(self, update_info: dict[str, Any]) -> None:
        if self._loaded:
            raise RuntimeError("The disk backend accepts exactly one checkpoint per update session")
        unknown = sorted(set(update_info) - {"path"})
        if unknown:
            raise ValueError(f"update_info: unknown key(s) {unknown}; the disk backend takes path")
        path = checkpoint_dir(update_info.get("path"))
        reload = getattr(self._runner, "reload_weights", None)
        if reload is None:
            raise RuntimeError("this worker's runner has no weights to update")
        reload(Path(path))

    def finish_weight_update(self) -> None:
        if not self._active:
            raise RuntimeError("No shared-disk weight update is active")
        self._active = False
        if not self._loaded:
            raise RuntimeError("No checkpoint was loaded during the shared-disk update session")
        self._loaded = False


def checkpoint_dir(path: object) -> str:
    """``path`` if it is an absolute local directory holding weights; ValueError naming
    ``update_info.path`` otherwise (checked before anything is touched)."""
    if not isinstance(path, str) or not path:
        raise ValueError("update_info.path: must be a non-empty absolute local directory")
    if not os.path.isabs(path):
        raise ValueError(f"update_info.path: must be an absolute local directory, got {path!r}")
    if not os.path.isdir(path):
        raise ValueError(f"update_info.path: not a local directory: {path}")
    with os.scandir(path) as entries:
        if not any(e.is_file() and e.name.endswith(_WEIGHT_FILES) for e in entries):
            raise ValueError(f"update_info.path: no safetensors or GGUF file in {path}")
    return path
