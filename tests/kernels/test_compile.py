"""The GPU build of every kernel: compile for sm_90 with the real Triton compiler, on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills() -> None:
    pytest.importorskip("triton.compiler")
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("aot_compile.py")
    result = subprocess.run(
        [sys.executable, str(script), "90"], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
