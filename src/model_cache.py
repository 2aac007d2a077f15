"""Where legato keeps the models it builds or converts, and how it writes them there safely.

``$LEGATO_HOME`` (default ``~/.cache/legato``) holds the toy model builds and the
converted default model. :func:`build_atomically` writes one directory so that no
reader ever sees it half written: the build goes into a temporary sibling, a marker
file is written last, and the directory is renamed into place in one step. A build
killed halfway leaves only its temporary sibling (a dot-name no reader looks at).
:func:`exclusive_lock` lets concurrent first starts wait for one build instead of
each doing the work.

Never imports torch, trio or transformers.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def legato_home() -> Path:
    """`$LEGATO_HOME`, else `$XDG_CACHE_HOME/legato`, else `~/.cache/legato`."""
    if home := os.environ.get("LEGATO_HOME"):
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "legato"


def is_complete(out: Path, marker_file: str, marker: dict[str, Any]) -> bool:
    """Whether ``out`` holds a finished build: its marker file holds exactly ``marker``."""
    try:
        found = json.loads((out / marker_file).read_text())
    except (OSError, ValueError):
        return False
    return bool(found == marker)


def build_atomically(
    out: Path,
    marker_file: str,
    marker: dict[str, Any],
    build: Callable[[Path], None],
    not_a_build: str,
) -> Path:
    """Make ``out`` a complete build: ``build(tmp)`` fills a temporary sibling, then it is renamed.

    Returns ``out`` untouched when it already holds this build (same ``marker``),
    also when another process renamed its own build into place first. Raises
    FileExistsError(``not_a_build``) when ``out`` holds anything else (an empty
    directory is replaced). If ``build`` raises, the temporary directory is
    removed and the error propagates. Blocks for as long as ``build`` does.
    """
    out = out.absolute()
    if is_complete(out, marker_file, marker):
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(not_a_build)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        build(tmp)
        (tmp / marker_file).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        for path in tmp.iterdir():  # mkdtemp and safetensors make owner-only files
            path.chmod(0o644)
        tmp.chmod(0o755)
        try:
            tmp.rename(out)  # atomic; replaces `out` only if it is an empty directory
        except OSError as exc:
            if is_complete(out, marker_file, marker):
                return out
            raise FileExistsError(not_a_build) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def remove_stale_builds(out: Path) -> None:
    """Remove temporary siblings of ``out`` left by killed builds. Call only under the lock."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if needed) for the block.

    Blocks until no other process holds it; the lock ends with the block or the process.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
