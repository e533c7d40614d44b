"""The staging buffer that sends a step's host arrays to the GPU in one copy, exercised on the CPU (same code,
an ordinary host buffer): every array comes back equal, in its dtype and shape, at an aligned offset, and the
buffer grows when a step needs more than it holds. On a GPU, device_tensor never makes the host wait."""
import numpy as np
import pytest
import torch

from tokenmill.runner.staging import ALIGN, StagingBuffer, device_tensor


def test_arrays_come_back_equal_in_dtype_and_shape() -> None:
    rng = np.random.default_rng(0)
    staging = StagingBuffer(torch.device("cpu"), nbytes=64)
    for step in range(3):  # odd lengths, so later arrays start past padding; the buffer grows on the first step
        arrays = [rng.integers(-5, 1 << 40, size=7 + step).astype(np.int64),
                  rng.integers(0, 1 << 30, size=(3, 5 + step)).astype(np.int32),
                  np.zeros(0, dtype=np.int64), rng.integers(0, 9, size=13).astype(np.int32)]
        out = staging.to_device(arrays)
        for a, t in zip(arrays, out):
            assert t.dtype == {np.int64: torch.int64, np.int32: torch.int32}[a.dtype.type]
            assert tuple(t.shape) == a.shape and np.array_equal(t.numpy(), a)
            assert t.numel() == 0 or (t.data_ptr() - staging.dev.data_ptr()) % ALIGN == 0
    assert staging.host.numel() >= sum(-(-a.nbytes // ALIGN) * ALIGN for a in arrays)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_tensor_does_not_wait_for_the_device(no_device_sync) -> None:
    busy = torch.randn(4096, 4096, device="cuda")
    busy @ busy  # queued work a synchronizing copy would wait for
    t = device_tensor([3, 1, 2], torch.long, torch.device("cuda"))
    torch.cuda.set_sync_debug_mode(0)
    assert t.dtype == torch.long and t.tolist() == [3, 1, 2]
