"""Fixtures of the quantization tests (tests/kernels is put on the path for its paged-attention cases)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_path: str) -> str:
    from quant_helpers import write_tiny_checkpoint
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), default_model_path)
