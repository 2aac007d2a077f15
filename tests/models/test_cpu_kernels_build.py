"""The native CPU kernels build wherever a C++ compiler is found.

Every native test skips when the kernels are unavailable, and the models fall back to the
plain-torch path, so a source that stops compiling would otherwise pass the suite with
hundreds of skips. This test turns that into a failure that shows the compiler's message.
"""

from __future__ import annotations

import os

import pytest

from legato.models import cpu_kernels


def test_the_kernels_build_and_load_where_a_compiler_is_found(
    caplog: pytest.LogCaptureFixture,
) -> None:
    if os.environ.get(cpu_kernels.ENV_SWITCH, "1").strip() == "0":
        pytest.skip(f"{cpu_kernels.ENV_SWITCH}=0 turns the native kernels off")
    if cpu_kernels._compiler() is None:
        pytest.skip("no C++ compiler here: the plain-torch path is the expected one")
    with caplog.at_level("WARNING", logger=cpu_kernels.logger.name):
        loaded = cpu_kernels.available()
    assert loaded, f"the native CPU kernels did not build or load: {caplog.text}"
