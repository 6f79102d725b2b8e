"""Shared test setup: the one GPU marker, and the Triton interpreter on CPU."""

import os

import pytest
import torch

# Triton decides at import time whether to interpret: without a GPU, run its
# kernels on CPU tensors (small sizes only; it is slow).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
