"""A step's host arrays reach the device in one copy: a pinned host buffer and its device twin, both reused
every step. One copy instead of one per array matters on a GPU, where each small copy costs microseconds of host
time the device spends idle between steps."""
from __future__ import annotations

import numpy as np
import torch

# bytes: every array starts where any dtype's view of it may start, and 16-byte aligned like a torch allocation:
# Triton compiles a kernel variant per pointer alignment, so an array that is 16-byte aligned in one step and not
# in the next would compile a second variant in the middle of serving.
ALIGN = 16


def device_tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on device, queued without waiting. torch.tensor(data, device=cuda) copies
    from pageable memory, and torch then synchronizes the stream: the host would wait for every step already
    queued, and async scheduling would lose its overlap. A copy from pinned memory is queued like a kernel (torch's
    pinned-memory cache keeps the buffer until the copy has run)."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class StagingBuffer:
    def __init__(self, device: torch.device, nbytes: int = 1 << 16) -> None:
        self.device = device
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> None:
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def wait_host_free(self) -> None:
        """The previous copy has read the host buffer: it may be written again."""
        if self.copied is not None:
            self.copied.synchronize()

    def write(self, offset: int, array: np.ndarray) -> int:
        """Put array's bytes at offset of the host buffer; the offset where the next array may go."""
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.host_np[offset: offset + flat.size] = flat
        return offset + _padded(flat.size)

    def copy(self, nbytes: int) -> None:
        """Send the first nbytes of the host buffer to the device (asynchronous on CUDA)."""
        self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The device tensor of that dtype and shape at offset."""
        return self._view(self.dev, offset, dtype, shape)

    def host_view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """Its twin in the host buffer, as numpy (written in place, then sent by copy())."""
        return self._view(self.host, offset, dtype, shape).numpy()

    @staticmethod
    def _view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = int(np.prod(shape)) * dtype.itemsize
        return buffer[offset: offset + n].view(dtype).view(shape)

    def to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device copies of arrays, all sent in one transfer. They stay valid until the next call."""
        total = sum(_padded(a.nbytes) for a in arrays)
        self.wait_host_free()
        if total > self.host.numel():
            self._allocate(max(total, 2 * self.host.numel()))
        offsets, offset = [], 0
        for a in arrays:
            offsets.append(offset)
            offset = self.write(offset, a)
        self.copy(offset)
        return [self.view(o, _TORCH_DTYPES[a.dtype], a.shape) for a, o in zip(arrays, offsets)]


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
