"""Which checkpoint a ``model`` argument names, and the name it is served under.

``model`` is what a user passes to ``open_engine``, ``LLM``, ``legato serve``:

- None: the embedded default, SmolLM2-135M-Instruct (:mod:`legato.default_model`),
  served as ``SmolLM2-135M-Instruct``;
- ``"toy"``: the deterministic toy model (:mod:`legato.toy_model`), served as
  ``legato-toy`` (a directory called ``toy`` is reached as ``./toy``);
- a local Hugging Face directory, or a ``.gguf`` file: itself, served under the
  argument as given (as vLLM does without ``--served-model-name``).

Anything else is a ModelLoadError whose one line names the argument. A
directory's config and a GGUF file (:func:`legato.models.gguf_checkpoint.open_gguf`)
are checked here, in the caller's process, so a corrupt or unsupported
checkpoint fails before any worker starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .protocol.errors import ModelLoadError

TOY_MODEL = "toy"
"""The ``model`` argument that names the toy model."""

TOY_MODEL_NAME = "legato-toy"
"""The served name of the toy model."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model argument: ``path`` to load (a directory or a GGUF file) and
    ``name`` to serve it under."""

    path: str
    name: str


def served_name(model: str | None) -> str:
    """The name ``model`` is served under by default (no I/O)."""
    if model is None:
        from .default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return TOY_MODEL_NAME if model == TOY_MODEL else model


def resolve_model_source(model: str | None) -> ModelSource:
    """The checkpoint ``model`` names (see the module docstring).

    Blocks: the first use of the default or the toy model builds it (seconds);
    a GGUF file's metadata is parsed. Raises ModelLoadError.
    """
    if model is None:
        from .default_model import default_model_dir

        return ModelSource(str(default_model_dir()), served_name(None))
    if model == TOY_MODEL:
        from .toy_model import default_toy_model_dir

        return ModelSource(str(default_toy_model_dir()), TOY_MODEL_NAME)
    if os.path.isdir(model) or model.lower().endswith(".gguf"):
        check_loadable(model)
        return ModelSource(model, model)
    if os.path.exists(model):
        raise ModelLoadError(f"model: {model}: a file, but not a GGUF file (*.gguf)")
    raise ModelLoadError(
        f"model: {model!r} is neither a local model directory nor a GGUF file"
        f" (leave it out for the default model, {served_name(None)}; 'toy' for the toy model)"
    )


def check_loadable(path: str) -> None:
    """Raise ModelLoadError unless ``path`` holds a checkpoint legato can serve: its
    config (config.json or GGUF metadata) parses and names a supported architecture,
    and a GGUF file is whole (see :func:`legato.models.gguf_checkpoint.open_gguf`)."""
    from .models.config import load_model_config
    from .models.registry import resolve_architecture

    try:
        resolve_architecture(load_model_config(path))
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"model: {path}: {exc}") from None
