"""Shared fixtures. Environment set here before anything imports transformers or triton."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run under the numpy interpreter on CPU-only machines.
    os.environ.setdefault("TRITON_INTERPRET", "1")
