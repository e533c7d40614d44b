"""GGUF blocks straight into our formats, by byte slicing (no float round trip): Q8_0 is INT8 with group 32,
Q4_1 is INT4 with group 32 (scale d, min m), Q4_0 is INT4 with group 32 and min -8 d. GGML nibble order is
our packing order, so the 16 bytes of each block are copied as they are."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from tokenmill.model.gguf_loader import GGUFTensor
from tokenmill.quant.formats import PACK_BLOCK, QuantFormat, QuantizedWeight

# GGUF type -> (our format, bytes per 32-value block)
NATIVE_FORMATS = {QT.Q8_0: (QuantFormat(8, 32), 34), QT.Q4_0: (QuantFormat(4, 32), 18),
                  QT.Q4_1: (QuantFormat(4, 32), 20)}


def native_format(qtype: QT) -> QuantFormat | None:
    """The format a GGUF tensor type loads into without dequantizing, or None."""
    entry = NATIVE_FORMATS.get(qtype)
    return None if entry is None else entry[0]


def _fp16(blocks: np.ndarray, start: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0])


def gguf_to_quantized(tensor: GGUFTensor) -> QuantizedWeight:
    """A Q8_0 / Q4_0 / Q4_1 matrix as a QuantizedWeight (CPU tensors)."""
    if tensor.qtype not in NATIVE_FORMATS or len(tensor.shape) != 2:
        raise ValueError(f"GGUF tensor {tensor.name} ({tensor.qtype.name}, shape {tensor.shape}) has no native "
                         f"format; native types: {', '.join(t.name for t in NATIVE_FORMATS)}")
    fmt, block_bytes = NATIVE_FORMATS[tensor.qtype]
    rows, cols = tensor.shape
    blocks = np.asarray(tensor.data).reshape(rows, cols // PACK_BLOCK, block_bytes)
    scales = _fp16(blocks, 0)
    if tensor.qtype == QT.Q8_0:
        q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols))
        return QuantizedWeight(fmt, q, scales, None, cols)
    if tensor.qtype == QT.Q4_1:
        mins, start = _fp16(blocks, 2), 4
    else:
        mins, start = scales * -8, 2   # exact in fp16: a power-of-two multiple
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., start:]).reshape(rows, -1))
    return QuantizedWeight(fmt, q, scales, mins, cols)
