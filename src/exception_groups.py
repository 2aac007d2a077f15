"""unwrap_single_error: give back the one error a nursery wrapped in a group.

trio's nurseries wrap what escapes them in an ExceptionGroup. Where a
nursery's own tasks never raise (the engine's actors report to the supervisor
instead) or one failure is all that can happen (a server failing to bind), a
group of one is that error: callers should see a ``ValueError`` or an
``EngineStartupError``, not a group around it.

Never imports torch or trio.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def unwrap_single_error() -> Iterator[None]:
    """Re-raise a group holding one exception as that exception; larger groups pass as they are."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            inner = group.exceptions[0]
            raise inner from inner.__cause__
        raise
