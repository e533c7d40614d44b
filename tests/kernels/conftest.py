"""Fixtures of the kernel tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def nan_filled_allocations():
    """torch.empty returns NaN-filled memory while deterministic algorithms are on."""
    was_on, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was_on, warn_only=was_warn)
    torch.utils.deterministic.fill_uninitialized_memory = was_fill
