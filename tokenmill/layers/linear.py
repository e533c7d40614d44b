"""Linear layers, tensor-parallel aware (vLLM's names). Merged projections hold several checkpoint matrices
concatenated along the output dimension, so one matrix product replaces two or three.

Column-parallel layers keep a slice of the output rows on each rank; row-parallel layers keep a slice of
the input columns and sum the partial outputs across ranks. With one rank they are plain linears."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed import all_reduce, shard_range, tp_rank, tp_size
from tokenmill.kernels import get_ops


class Linear(nn.Module):
    """Replicated linear: every rank holds the whole matrix."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.checkpoint_shapes: dict[int | None, tuple[int, int]] = {None: (out_features, in_features)}
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.ops = get_ops(torch.get_default_device())

    def _local(self, name: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        """The part of a checkpoint tensor this rank keeps."""
        return tensor

    def load_shard(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        """Copy a checkpoint tensor ('weight' or 'bias') into this layer (or one shard of it)."""
        param = getattr(self, name)
        if param is None:
            raise ValueError(f"checkpoint has a {name} the layer does not expect")
        tensor = self._local(name, tensor, shard)
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
        param.data.copy_(tensor)

    def forward(self, x: torch.Tensor, *, rms_eps: float | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b; rms_eps: x RMS-normalized first (a norm folded into W); residual: added to the output."""
        return self.ops.linear(x, self.weight, self.bias, rms_eps=rms_eps, residual=residual)

    @torch.no_grad()
    def fold_norm(self, norm_weight: torch.Tensor) -> bool:
        """Take the weight of the RMSNorm that feeds this projection: scale the input columns by it (each product
        rounded once: both are in the model's dtype), since norm(x) W^T = rms(x) (W diag(g))^T."""
        self.weight.mul_(norm_weight.to(self.weight.dtype))
        return True

    def fold_silu_and_mul(self) -> bool:
        """Whether this projection computes SiLU·mul of its cat(gate, up) input itself (FP8 ones do); a float
        one does not."""
        return False

    def silu_and_mul(self, x: torch.Tensor, *, rms_eps: float | None = None) -> torch.Tensor:
        """silu(gate) * up of this projection's output cat(gate, up) (a merged gate/up projection): the product,
        then the SiLU·mul kernel. A quantized projection may do both in one kernel (QuantLinear)."""
        return self.ops.silu_and_mul(self(x, rms_eps=rms_eps))


class ColumnParallelLinear(Linear):
    """Output rows split over ranks; each rank produces its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.row_range = shard_range(out_features)
        super().__init__(in_features, self.row_range[1] - self.row_range[0], bias)
        self.checkpoint_shapes = {None: (out_features, in_features)}

    def _local(self, name: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        start, end = self.row_range
        return tensor[start:end]


class RowParallelLinear(Linear):
    """Input columns split over ranks; partial products are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.col_range = shard_range(in_features)
        super().__init__(self.col_range[1] - self.col_range[0], out_features, bias)
        self.checkpoint_shapes = {None: (out_features, in_features)}

    def _local(self, name: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        start, end = self.col_range
        return tensor[:, start:end] if name == "weight" else tensor

    def forward(self, x: torch.Tensor, *, rms_eps: float | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        if tp_size() == 1:  # the residual add goes into the matmul's store; with ranks it must follow the sum
            return super().forward(x, rms_eps=rms_eps, residual=residual)
        if rms_eps is not None:
            raise ValueError("a rank's slice of the input columns cannot be normalized on its own")
        y = all_reduce(self.ops.linear(x, self.weight))
        y = y if self.bias is None else y + self.bias
        return y if residual is None else y + residual


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (QKV, gate/up). Shard i keeps
    rows [start, start + size) of its checkpoint matrix (all of them with one rank)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 shard_slices: list[tuple[int, int]] | None = None) -> None:
        self.shard_slices = shard_slices or [(0, n) for n in output_sizes]
        local_sizes = [size for _, size in self.shard_slices]
        super().__init__(in_features, sum(local_sizes), bias)
        self.output_sizes = local_sizes
        self.offsets = [sum(local_sizes[:i]) for i in range(len(local_sizes))]
        self.checkpoint_shapes = {i: (n, in_features) for i, n in enumerate(output_sizes)}

    def _local(self, name: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        if shard is None:
            return tensor
        start, size = self.shard_slices[shard]
        return tensor[start:start + size]

    def load_shard(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if shard is None:
            return super().load_shard(name, tensor)
        param = getattr(self, name)
        if param is None:
            raise ValueError(f"checkpoint has a {name} the layer does not expect")
        tensor = self._local(name, tensor, shard)
        target = param.data.narrow(0, self.offsets[shard], self.output_sizes[shard])
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch for {name} shard {shard}: checkpoint {tuple(tensor.shape)}, "
                             f"model {tuple(target.shape)}")
        target.copy_(tensor)


class MergedColumnParallelLinear(MergedLinear):
    """gate/up: each projection's rows split evenly over ranks."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        slices = []
        for n in output_sizes:
            start, end = shard_range(n)
            slices.append((start, end - start))
        super().__init__(in_features, output_sizes, bias, slices)


def kv_heads_per_rank(num_kv_heads: int) -> int:
    """KV heads are split when there are at least as many as ranks, else each rank holds one (replicated)."""
    world = tp_size()
    if num_kv_heads >= world:
        if num_kv_heads % world:
            raise ValueError(f"{num_kv_heads} KV heads do not split evenly over tensor_parallel_size={world}")
        return num_kv_heads // world
    if world % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={world} is not a multiple of the {num_kv_heads} KV heads")
    return 1


class QKVParallelLinear(MergedLinear):
    """Q, K, V stacked; query heads split over ranks, KV heads split or replicated."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        world, rank = tp_size(), tp_rank()
        if num_heads % world:
            raise ValueError(f"{num_heads} attention heads do not split evenly over tensor_parallel_size={world}")
        q_heads, kv_heads = num_heads // world, kv_heads_per_rank(num_kv_heads)
        kv_start = rank * kv_heads if num_kv_heads >= world else rank * num_kv_heads // world
        q_slice = (rank * q_heads * head_dim, q_heads * head_dim)
        kv_slice = (kv_start * head_dim, kv_heads * head_dim)
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, [q_slice, kv_slice, kv_slice])
