"""Linear layers with quantized weights, swapped in for the model's Linear / MergedLinear after it is built
and before weights load, so model code never branches on formats or devices.

They subclass Linear / MergedLinear (without their float-weight constructors) so everything that treats
projections as projections, the checkpoint bookkeeping of load_weights included, keeps working. `weight`
is the packed tensor (a parameter, so a checkpoint missing it is reported), `weight_scale` / `weight_min`
are buffers. A shard arrives either as a float tensor (quantized on the layer's device) or as a
QuantizedWeight in the layer's format (GGUF blocks, a quantized checkpoint), copied as it is.

Tensor parallelism follows the float layers they replace (layers/linear.py): a column-parallel rank keeps its
output rows (QKV: its query heads, its KV heads or a replicated one), a row-parallel rank its input columns,
all-reducing its partial sums and adding the bias after; quant/sharding.py cuts the packed tensors.

The LM head can be quantized too (QuantLMHead, on request): it is the largest single matrix a decode step reads
(Llama-3-8B: 1.05 GB in bf16, 6-10% of a batch-1 step), and llama.cpp's quantized files carry it quantized.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.distributed import all_gather_last_dim, all_reduce, tp_size
from tokenmill.kernels import torch_ref
from tokenmill.kernels.cpu_quant import CpuPackedWeight, cpu_quant_linear, prepack, supports
from tokenmill.layers.embedding import ParallelLMHead
from tokenmill.layers.linear import ColumnParallelLinear, Linear, MergedLinear, RowParallelLinear
from tokenmill.quant import sharding
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
    """y = x W^T + b with W packed in `fmt`; the matmul dequantizes in registers (Triton) or per call (CPU).
    in_features / out_features are this rank's; row_start is the first checkpoint row it keeps
    (column-parallel), col_range the checkpoint inputs it keeps (row-parallel)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: QuantFormat,
                 device: torch.device | str, dtype: torch.dtype, row_start: int = 0,
                 col_range: tuple[int, int] | None = None) -> None:
        nn.Module.__init__(self)  # not Linear.__init__: no float weight is ever allocated
        if col_range is not None:
            sharding.check_row_parallel(fmt, in_features * tp_size(), tp_size())
        device = torch.device(device)
        if fmt.fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise ValueError(f"quantization 'fp8' needs FP8 support, a GPU of compute capability 8.9 or newer "
                             f"(Ada, Hopper); {name} has {torch.cuda.get_device_capability(device)}: use int8 or int4")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.row_start, self.col_range = row_start, col_range
        self.group = fmt.group(in_features)
        self.weight = nn.Parameter(torch.zeros(fmt.qweight_shape(out_features, in_features),
                                               dtype=fmt.qweight_dtype, device=device), requires_grad=False)
        meta = (out_features, fmt.num_groups(in_features))
        self.register_buffer("weight_scale", torch.zeros(meta, dtype=fmt.scale_dtype, device=device))
        self.register_buffer("weight_min", torch.zeros(meta, dtype=torch.float16, device=device)
                             if fmt.has_min else None)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.matmul = quant_linear_fn(device)
        self._cpu_packed: CpuPackedWeight | None = None
        self.register_buffer("input_norm", None)  # an RMSNorm's weight folded into FP8 input quantization
        self.silu_and_mul_input = False  # FP8: the input is cat(gate, up), SiLU·mul folded into its quantization

    def _rows(self, shard: int | None) -> tuple[int, int, int]:
        """(first row in this layer, first row in the checkpoint tensor, rows) of a checkpoint tensor."""
        if shard is not None:
            raise ValueError(f"a single projection has no shard {shard}")
        return 0, self.row_start, self.out_features

    def load_shard(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: int | None = None) -> None:
        """Copy this rank's part of a checkpoint tensor ('weight' or 'bias', or one shard of it)."""
        dst, src, size = self._rows(shard)
        if name == "bias":
            if self.bias is None:
                raise ValueError("checkpoint has a bias the layer does not expect")
            tensor = tensor[src:src + size]
            if tuple(tensor.shape) != (size,):
                raise ValueError(f"shape mismatch for bias: checkpoint {tuple(tensor.shape)}, model ({size},)")
            self.bias.data[dst:dst + size].copy_(tensor)
            return
        self._store(self._local(tensor, src, size), dst, size)

    def _local(self, tensor: torch.Tensor | QuantizedWeight, start: int, size: int) -> QuantizedWeight:
        """This rank's part of a checkpoint weight. A float matrix is quantized whole, as one rank quantizes it,
        and cut afterwards: a per-channel INT8 scale is the max over the whole row, so a rank quantizing only its
        columns would round differently, and quantizing the very tensor one rank quantizes is what makes every
        value equal, whatever the format and the reductions' order. Costs a rank the quantization of the whole
        tensor, at load only."""
        qw = tensor if isinstance(tensor, QuantizedWeight) else quantize(tensor.to(self.weight.device), self.fmt)
        qw = sharding.rows(qw, start, start + size)
        if self.col_range is None:
            return qw
        if qw.in_features != self.in_features * tp_size():
            raise ValueError(f"shape mismatch for weight: checkpoint has {qw.in_features} inputs, model "
                             f"{self.in_features} on each of {tp_size()} ranks")
        return sharding.columns(qw, *self.col_range)

    def _store(self, qw: QuantizedWeight, start: int, size: int) -> None:
        if (qw.fmt.bits, qw.fmt.fp8) != (self.fmt.bits, self.fmt.fp8) or qw.fmt.group(qw.in_features) != self.group:
            raise ValueError(f"checkpoint weight is {qw.fmt.name}, the layer expects {self.fmt.name}")
        if (qw.out_features, qw.in_features) != (size, self.in_features):
            raise ValueError(f"shape mismatch for weight: checkpoint {(qw.out_features, qw.in_features)}, "
                             f"model {(size, self.in_features)}")
        self._cpu_packed = None
        self.weight.data[start:start + size].copy_(qw.qweight)
        self.weight_scale[start:start + size].copy_(qw.scales)
        if self.weight_min is not None:
            self.weight_min[start:start + size].copy_(qw.mins)

    def load_local(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> None:
        """Hold a weight already cut to this rank (a float one is quantized here) and its bias."""
        qw = weight if isinstance(weight, QuantizedWeight) else quantize(weight.to(self.weight.device), self.fmt)
        self._store(qw, 0, self.out_features)
        if bias is not None:
            self.bias.data.copy_(bias)

    def scale_rows_(self, start: int, end: int, factor: float) -> None:
        """Multiply output rows [start, end) of the weight by factor (the bias is left alone)."""
        self._cpu_packed = None
        self.weight_scale[start:end] *= factor
        if self.weight_min is not None:
            self.weight_min[start:end] *= factor

    def _cpu_kernel_weight(self, x: torch.Tensor) -> CpuPackedWeight | None:
        """The weight in the CPU kernel's layout for x's dtype, prepared at first use (it holds a second copy
        of the packed weight); None where no CPU kernel fits and the twin runs."""
        packed = self._cpu_packed
        if packed is not None and packed.dtype is x.dtype and x.is_cpu:
            return packed
        if not x.is_cpu or self.fmt.fp8 or not supports(self.fmt.bits, self.group, self.in_features,
                                                         self.out_features, x.dtype):
            return None
        self._cpu_packed = prepack(self.weight.data, self.weight_scale, self.weight_min, self.in_features, self.group,
                                   x.dtype)
        return self._cpu_packed

    def fold_norm(self, norm_weight: torch.Tensor) -> bool:
        """FP8 takes the norm's weight into its input quantization (the kernel normalizes, scales and quantizes
        in one pass, triton_fp8_linear.quantize_rows); INT8 and INT4 leave the norm alone."""
        if not self.fmt.fp8:
            return False
        self.input_norm = norm_weight.detach()
        return True

    def fold_silu_and_mul(self) -> bool:
        """FP8 computes SiLU·mul of its cat(gate, up) input in its quantization kernel; INT8 and INT4 do not."""
        self.silu_and_mul_input = self.fmt.fp8
        return self.silu_and_mul_input

    def _norm(self, rms_eps: float | None) -> tuple[torch.Tensor, float] | None:
        """The folded norm the matmul applies to x, for an rms_eps from RMSNorm.for_projection."""
        if rms_eps is not None and self.input_norm is None:
            raise ValueError("a norm folds only into float or FP8 weights; this projection takes its output")
        return None if rms_eps is None else (self.input_norm, rms_eps)

    def silu_and_mul(self, x: torch.Tensor, *, rms_eps: float | None = None) -> torch.Tensor:
        """Linear.silu_and_mul in the matmul's call: INT4 at up to 16 rows on a GPU computes SiLU·mul in the
        product's store (triton_quant.quant_linear), the rest after it."""
        if self.col_range is not None and tp_size() > 1:
            raise ValueError("SiLU·mul needs whole gate and up sums; a row-parallel rank holds partial ones")
        return self._product(x, self.bias, None, rms_norm=self._norm(rms_eps), silu_and_mul_out=True)

    def forward(self, x: torch.Tensor, *, rms_eps: float | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        norm = self._norm(rms_eps)
        sharded = self.col_range is not None and tp_size() > 1  # partial sums: bias and residual follow the sum
        y = self._product(x, None if sharded else self.bias, None if sharded else residual, rms_norm=norm)
        if not sharded:
            return y
        y = all_reduce(y)
        y = y if self.bias is None else y + self.bias
        return y if residual is None else y + residual

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                 out_dtype: torch.dtype | None = None, rms_norm: tuple[torch.Tensor, float] | None = None,
                 silu_and_mul_out: bool = False) -> torch.Tensor:
        """This rank's x W^T + bias + residual, in out_dtype (default x's): torch's packed CPU kernel where one
        fits, else the device's quantized matmul (which, FP8, also runs the folded norm or SiLU·mul).
        silu_and_mul_out: silu(gate) * up of the result (Linear.silu_and_mul)."""
        if (packed := self._cpu_kernel_weight(x)) is None:
            return self.matmul(x, self.weight, self.weight_scale, self.weight_min, self.in_features, self.group,
                               bias, residual=residual, out_dtype=out_dtype, rms_norm=rms_norm,
                               silu_and_mul=self.silu_and_mul_input, silu_and_mul_out=silu_and_mul_out)
        y = cpu_quant_linear(x, packed, bias)
        y = y if residual is None else y + residual
        y = y if out_dtype is None else y.to(out_dtype)
        return torch_ref.silu_and_mul(y) if silu_and_mul_out else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}"


class QuantMergedLinear(QuantLinear, MergedLinear):
    """Several projections of the same input stacked along the output dim, quantized row-wise (so each shard
    quantizes on its own exactly as the stacked matrix would). output_sizes are this rank's; shard i keeps
    rows [start, start + size) of its checkpoint matrix (all of them with one rank)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, fmt: QuantFormat,
                 device: torch.device | str, dtype: torch.dtype,
                 shard_slices: list[tuple[int, int]] | None = None) -> None:
        QuantLinear.__init__(self, in_features, sum(output_sizes), bias, fmt, device, dtype)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.shard_slices = shard_slices or [(0, n) for n in output_sizes]

    def _rows(self, shard: int | None) -> tuple[int, int, int]:
        if shard is None:
            return 0, 0, self.out_features
        return self.offsets[shard], self.shard_slices[shard][0], self.output_sizes[shard]


class QuantLMHead(QuantLinear):
    """ParallelLMHead with a packed weight: this rank's slice of the vocabulary (the checkpoint's rows from
    vocab_start on), float32 logits gathered across ranks. A tied head becomes a quantized copy of the embedding
    (the embedding itself stays in 16-bit: its lookups read one row a token)."""

    def __init__(self, head: ParallelLMHead, fmt: QuantFormat) -> None:
        super().__init__(head.weight.shape[1], head.vocab_end - head.vocab_start, False, fmt, head.weight.device,
                         head.weight.dtype, row_start=head.vocab_start)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(self._product(hidden, None, None, torch.float32))


def to_quant_linear(module: Linear | ParallelLMHead, fmt: QuantFormat,
                    weight: torch.Tensor | QuantizedWeight | None) -> QuantLinear:
    """The quantized twin of a Linear / MergedLinear (tensor-parallel ones included) or of the LM head on its
    device, holding `weight`, the module's own rank-local weight (a float matrix is quantized here), and the
    module's bias; with weight None it is empty and waits for load_shard."""
    if isinstance(module, ParallelLMHead):
        head = QuantLMHead(module, fmt)
        if weight is not None:
            head.load_local(weight, None)
        return head
    device, dtype = module.weight.device, module.weight.dtype
    has_bias = module.bias is not None
    if isinstance(module, MergedLinear):
        q: QuantLinear = QuantMergedLinear(module.in_features, module.output_sizes, has_bias, fmt, device, dtype,
                                           module.shard_slices)
    elif isinstance(module, RowParallelLinear):
        q = QuantLinear(module.in_features, module.out_features, has_bias, fmt, device, dtype,
                        col_range=module.col_range)
    else:
        row_start = module.row_range[0] if isinstance(module, ColumnParallelLinear) else 0
        q = QuantLinear(module.in_features, module.out_features, has_bias, fmt, device, dtype, row_start)
    if weight is not None:
        q.load_local(weight, module.bias.data if has_bias else None)
    return q


def scale_rows_(module: Linear, start: int, end: int, factor: float) -> None:
    """Multiply output rows [start, end) of any projection's weight by factor, quantized or not."""
    if isinstance(module, QuantLinear):
        module.scale_rows_(start, end, factor)
    else:
        module.weight.data[start:end] *= factor
