"""How decode attention over an e4m3 cache (triton_fp8_decode.py) splits each sequence's context over programs
(flash-decoding).

The grid is fixed from static shapes, so a launch can be captured in a CUDA graph: (sequences, KV heads,
num_parts), where num_parts covers the block table's longest context at the longest partition. The partition
length is chosen per sequence at run time from its own context: ctx / target (a power of two, so a small
batch still gives every multiprocessor work) rounded up to a multiple of min_partition, never longer than
max_partition; a context gets at most `target` partitions unless it is longer than target * max_partition. Partitions past a context exit at once.

Why at run time: CUDA graphs size block tables for max_model_len, and partitions fixed from the table's width
were sized for the longest context it could hold. H200, e4m3 cache, tables 8,192 tokens wide (docs/BENCHMARKS.md):
8 sequences of 2,048 tokens took 34.2 us with fixed 512-token partitions (4 one-warp programs a sequence and KV
head) and 21.2 with 16 of 128 tokens; 32 x 1,024: 41.3 against 32.8; one sequence of 16,000 tokens: 33.8 against
29.5; batches that fill the GPU by themselves (256 x 832, 64 x 4,096) keep fixed partitions and their times.

The bf16 Triton kernel (triton_attention.py) keeps partitions fixed from static shapes: with this split it ran
1-10% slower at 128 and 256 sequences for the same partitions (faster at 8 x 2,048: 33 against 49 us).
"""
from __future__ import annotations

import triton
import triton.language as tl


def plan(num_seqs: int, num_kv_heads: int, max_ctx: int, cfg: dict[str, int], sms: int) -> tuple[int, int]:
    """(num_parts, log2 of target) for a launch: the grid's partitions a (sequence, KV head), and the partitions a
    context is cut into, a power of two (a shift in the kernel, not a division). cfg: max_partition, min_partition
    (powers of two), programs_per_sm (the programs a multiprocessor should get), max_splits (the largest target:
    one program merges a context's partitions; a context longer than max_splits * max_partition still gets
    partitions of max_partition, more of them). Target 1 (log2 0): a batch that fills the GPU by itself, whose
    partitions are all max_partition long, as a kernel can know at compile time."""
    pairs = max(num_seqs * num_kv_heads, 1)
    wanted = triton.next_power_of_2(triton.cdiv(cfg["programs_per_sm"] * sms, pairs))
    cap = min(triton.cdiv(max_ctx, cfg["min_partition"]), cfg["max_splits"])
    target = min(wanted, 1 << max(cap.bit_length() - 1, 0))  # the largest power of two within the cap
    return max(target, triton.cdiv(max_ctx, cfg["max_partition"]), 1), target.bit_length() - 1


@triton.jit
def partition_len(ctx, target_log2, MIN_PARTITION: tl.constexpr, MAX_PARTITION: tl.constexpr):
    """Tokens a partition of this context: ctx / 2^target_log2 rounded up to a multiple of MIN_PARTITION (itself a
    multiple of the kernel's loop step), at most MAX_PARTITION (a multiple of MIN_PARTITION); MIN_PARTITION for an
    empty context. With ctx at most num_parts * MAX_PARTITION, cdiv(ctx, partition_len) <= num_parts programs have
    tokens. Written so the compiler knows a partition starts at a multiple of MIN_PARTITION and sees no lower
    clamp: in the bf16 Triton kernel, where it was tried, a clamp from below took its loop from 80 registers a
    thread to 128 (sm_90)."""
    steps = tl.cdiv((tl.maximum(ctx, 1) + (1 << target_log2) - 1) >> target_log2, MIN_PARTITION)
    return tl.minimum(steps, MAX_PARTITION // MIN_PARTITION) * MIN_PARTITION
