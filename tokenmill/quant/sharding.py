"""The part of a quantized matrix one tensor-parallel rank keeps, cut from the packed tensors themselves so that
GGUF blocks and quantized checkpoints never go through float.

Column-parallel layers keep output rows: packed rows with their scale (and min) rows, in any format.
Row-parallel layers keep input columns, which must not cut a scale group nor an INT4 32-input packing block:
each rank's share of the inputs must be whole groups (every INT4 group size is a multiple of 32). Per-channel
INT8 has one scale per output row for the whole row, so every rank keeps the whole scale vector; its partial
sums are all-reduced like any row-parallel layer's."""
from __future__ import annotations

from tokenmill.quant.formats import PACK_BLOCK, QuantFormat, QuantizedWeight


def check_row_parallel(fmt: QuantFormat, in_features: int, tp: int) -> None:
    """Refuse a row-parallel split of in_features inputs over tp ranks that would cut a group."""
    share = in_features // tp
    if tp == 1 or fmt.group_size is None or share % fmt.group_size == 0:
        return
    blocks = f" and whole {PACK_BLOCK}-input packing blocks" if fmt.bits == 4 else ""
    raise ValueError(f"{fmt.name} weights do not split over tensor_parallel_size={tp} in a row-parallel layer of "
                     f"{in_features} inputs: each rank would get {share} inputs, which must be whole groups of "
                     f"{fmt.group_size}{blocks}; use a tensor_parallel_size that gives whole groups, a smaller "
                     "group size, or per-channel int8")


def rows(qw: QuantizedWeight, start: int, end: int) -> QuantizedWeight:
    """Output rows [start, end)."""
    mins = None if qw.mins is None else qw.mins[start:end]
    return QuantizedWeight(qw.fmt, qw.qweight[start:end], qw.scales[start:end], mins, qw.in_features)


def columns(qw: QuantizedWeight, start: int, end: int) -> QuantizedWeight:
    """Inputs [start, end); start must begin a group (check_row_parallel), end end one or the row."""
    if qw.fmt.group_size is None:
        return QuantizedWeight(qw.fmt, qw.qweight[:, start:end], qw.scales, None, end - start)
    group = qw.fmt.group_size
    groups = slice(start // group, -(-end // group))
    packed = slice(start, end) if qw.fmt.bits == 8 else \
        slice(start // 2, -(-end // PACK_BLOCK) * (PACK_BLOCK // 2))
    mins = None if qw.mins is None else qw.mins[:, groups]
    return QuantizedWeight(qw.fmt, qw.qweight[:, packed], qw.scales[:, groups], mins, end - start)
