"""Weight-only quantized matmuls on the CPU through torch's own packed kernels (those torchao's CPU path calls):
`_weight_int4pack_mm_for_cpu` for INT4 in groups and `_weight_int8pack_mm` for per-channel INT8.

Batch-1 decode on a CPU is bound by the bytes of weights it reads; these kernels read 4 or 8 bits per weight and
dequantize in registers, 2.5-3x faster than a bf16 matmul at one row (AVX-512 BF16, docs/BENCHMARKS.md). They take
16-bit activations only (with float32 ones they are ~50x slower), so the CPU path runs them for bf16 / fp16 models
and leaves float32 ones to the torch twin in quant_ref.py.

The kernels want the weight in their own layout, prepared once (prepack), and the scales in the activation dtype:
INT4 as w = (q - 8)·scale + zero per group, so our (s, m) become scale = s, zero = m + 8·s, rounded to 16 bits
there. `reference_scales` gives the (s, m) the kernel effectively multiplies by, for the tests' oracle.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.quant.formats import unpack_int4

INT4_GROUPS = (32, 64, 128, 256)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
N_MULTIPLE = 16   # the INT4 packing tiles output rows by 16
K_MULTIPLE = 16   # the INT8 kernel reads inputs 16 at a time (other K give garbage or a crash)


@dataclass
class CpuPackedWeight:
    bits: int
    weight: torch.Tensor   # INT4: uint8 [N, K / 2] in the kernel's layout; INT8: int8 [N, K]
    scales: torch.Tensor   # INT4: [K / group, N, 2] (scale, zero); INT8: [N]
    group: int
    dtype: torch.dtype     # the activation dtype the scales are in


def supports(bits: int, group: int, in_features: int, out_features: int, dtype: torch.dtype) -> bool:
    """Whether a kernel exists for this format, shape and activation dtype (else the caller uses the twin)."""
    if dtype not in ACTIVATION_DTYPES:
        return False
    if bits == 8:
        return group == in_features and in_features % K_MULTIPLE == 0 and dtype == torch.bfloat16
    return group in INT4_GROUPS and in_features % group == 0 and out_features % N_MULTIPLE == 0


def reference_scales(scales: torch.Tensor, mins: torch.Tensor | None, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float32 (s, m) the kernel computes with once its scales are rounded to `dtype`."""
    s = scales.to(dtype)
    if mins is None:
        return s.float(), None
    zero = (mins.float() + 8 * scales.float()).to(dtype)
    return s.float(), zero.float() - 8 * s.float()


def prepack(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, in_features: int, group: int,
            dtype: torch.dtype) -> CpuPackedWeight:
    """Our packed weight (formats.py) in the kernel's layout; call only where supports() holds."""
    if qweight.dtype == torch.int8:
        return CpuPackedWeight(8, qweight.contiguous(), scales[:, 0].to(dtype).contiguous(), group, dtype)
    packed = torch._convert_weight_to_int4pack_for_cpu(unpack_int4(qweight, in_features).to(torch.int32), 1)
    zero = (mins.float() + 8 * scales.float()).to(dtype)
    scale_zero = torch.stack((scales.to(dtype), zero), dim=-1).transpose(0, 1).contiguous()
    return CpuPackedWeight(4, packed, scale_zero, group, dtype)


def cpu_quant_linear(x: torch.Tensor, w: CpuPackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias for x [..., K] in w.dtype."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if w.bits == 8:
        y = torch._weight_int8pack_mm(x2, w.weight, w.scales)
    else:
        y = torch._weight_int4pack_mm_for_cpu(x2, w.weight, w.group, w.scales)
    if bias is not None:
        y = y + bias
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])
