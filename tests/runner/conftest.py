"""Fixtures of the runner tests."""
import pytest
import torch


@pytest.fixture
def no_device_sync():
    """torch raises on any call that makes the host wait for the GPU (a pageable copy, .item(), a boolean
    mask): async scheduling launches a step while the device still runs the previous one."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    yield
    torch.cuda.set_sync_debug_mode(0)
