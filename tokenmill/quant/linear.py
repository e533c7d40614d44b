"""Linear layers with quantized weights, swapped in for the model's Linear / MergedLinear after it is built
and before weights load, so model code never branches on formats or devices.

They subclass Linear / MergedLinear (without their float-weight constructors) so everything that treats
projections as projections, the checkpoint bookkeeping of load_weights included, keeps working. With one
tensor-parallel rank (the only case supported here) the column/row-parallel layers are plain linears. `weight`
is the packed tensor (a parameter, so a checkpoint missing it is reported), `weight_scale` / `weight_min`
are buffers. A shard arrives either as a float tensor (quantized on the layer's device) or as a
QuantizedWeight in the layer's format (GGUF blocks, a quantized checkpoint), copied as it is.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.distributed import tp_size
from tokenmill.kernels.cpu_quant import CpuPackedWeight, cpu_quant_linear, prepack, supports
from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.quant.formats import QuantFormat, QuantizedWeight, quantize

QuantLinearFn = Callable[..., torch.Tensor]


def quant_linear_fn(device: torch.device) -> QuantLinearFn:
    """The matmul for packed weights on a device: Triton on CUDA, the torch twin elsewhere (QuantLinear takes
    torch's packed CPU kernels first where one fits, kernels/cpu_quant.py)."""
    if device.type == "cuda":
        from tokenmill.kernels.triton_quant import quant_linear
        return quant_linear
    from tokenmill.kernels.quant_ref import quant_linear
    return quant_linear


class QuantLinear(Linear):
    """y = x W^T + b with W packed in `fmt`; the matmul dequantizes in registers (Triton) or per call (CPU)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: QuantFormat,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)  # not Linear.__init__: no float weight is ever allocated
        device = torch.device(device)
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.group = fmt.group(in_features)
        self.weight = nn.Parameter(torch.zeros(fmt.qweight_shape(out_features, in_features),
                                               dtype=fmt.qweight_dtype, device=device), requires_grad=False)
        meta = (out_features, fmt.num_groups(in_features))
        self.register_buffer("weight_scale", torch.zeros(meta, dtype=torch.float16, device=device))
        self.register_buffer("weight_min", torch.zeros(meta, dtype=torch.float16, device=device)
                             if fmt.has_min else None)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.matmul = quant_linear_fn(device)
        self._cpu_packed: CpuPackedWeight | None = None

    def _rows(self, shard: int | None) -> tuple[int, int]:
        if shard is not None:
            raise ValueError(f"a single projection has no shard {shard}")
        return 0, self.out_features

    def load_shard(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: int | None = None) -> None:
        start, size = self._rows(shard)
        if name == "bias":
            if self.bias is None:
                raise ValueError("checkpoint has a bias the layer does not expect")
            if tuple(tensor.shape) != (size,):
                raise ValueError(f"shape mismatch for bias: checkpoint {tuple(tensor.shape)}, model ({size},)")
            self.bias.data[start:start + size].copy_(tensor)
            return
        qw = tensor if isinstance(tensor, QuantizedWeight) else quantize(tensor.to(self.weight.device), self.fmt)
        if qw.fmt.bits != self.fmt.bits or qw.fmt.group(qw.in_features) != self.group:
            raise ValueError(f"checkpoint weight is {qw.fmt.name}, the layer expects {self.fmt.name}")
        if (qw.out_features, qw.in_features) != (size, self.in_features):
            raise ValueError(f"shape mismatch for weight: checkpoint {(qw.out_features, qw.in_features)}, "
                             f"model {(size, self.in_features)}")
        self._cpu_packed = None
        self.weight.data[start:start + size].copy_(qw.qweight)
        self.weight_scale[start:start + size].copy_(qw.scales)
        if self.weight_min is not None:
            self.weight_min[start:start + size].copy_(qw.mins)

    def scale_rows_(self, start: int, end: int, factor: float) -> None:
        """Multiply output rows [start, end) of the weight by factor (the bias is left alone)."""
        self._cpu_packed = None
        self.weight_scale[start:end] *= factor
        if self.weight_min is not None:
            self.weight_min[start:end] *= factor

    def _cpu_kernel_weight(self, x: torch.Tensor) -> CpuPackedWeight | None:
        """The weight in the CPU kernel's layout for x's dtype, prepared at first use (it holds a second copy
        of the packed weight); None where no CPU kernel fits and the twin runs."""
        if x.device.type != "cpu" or not supports(self.fmt.bits, self.group, self.in_features, self.out_features,
                                                  x.dtype):
            return None
        if self._cpu_packed is None or self._cpu_packed.dtype != x.dtype:
            self._cpu_packed = prepack(self.weight.data, self.weight_scale, self.weight_min, self.in_features,
                                       self.group, x.dtype)
        return self._cpu_packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (packed := self._cpu_kernel_weight(x)) is not None:
            return cpu_quant_linear(x, packed, self.bias)
        return self.matmul(x, self.weight, self.weight_scale, self.weight_min, self.in_features, self.group,
                           self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}"


class QuantMergedLinear(QuantLinear, MergedLinear):
    """Several projections of the same input stacked along the output dim, quantized row-wise (so each shard
    quantizes on its own exactly as the stacked matrix would)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, fmt: QuantFormat,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        QuantLinear.__init__(self, in_features, sum(output_sizes), bias, fmt, device, dtype)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def _rows(self, shard: int | None) -> tuple[int, int]:
        if shard is None:
            return 0, self.out_features
        return self.offsets[shard], self.output_sizes[shard]


def to_quant_linear(module: Linear, fmt: QuantFormat, weight: torch.Tensor | QuantizedWeight | None) -> QuantLinear:
    """The quantized twin of a Linear / MergedLinear on its device, holding `weight` (a float matrix is
    quantized here) and the module's bias; with weight None it is empty and waits for load_shard."""
    if tp_size() > 1:
        raise ValueError("quantized weights need tensor_parallel_size=1 (their shards are not split over ranks)")
    device, dtype = module.weight.device, module.weight.dtype
    has_bias = module.bias is not None
    if isinstance(module, MergedLinear):
        q: QuantLinear = QuantMergedLinear(module.in_features, module.output_sizes, has_bias, fmt, device, dtype)
    else:
        q = QuantLinear(module.in_features, module.out_features, has_bias, fmt, device, dtype)
    if weight is not None:
        q.load_shard("weight", weight)
        if has_bias:
            q.load_shard("bias", module.bias.data)
    return q


def scale_rows_(module: Linear, start: int, end: int, factor: float) -> None:
    """Multiply output rows [start, end) of any projection's weight by factor, quantized or not."""
    if isinstance(module, QuantLinear):
        module.scale_rows_(start, end, factor)
    else:
        module.weight.data[start:end] *= factor
