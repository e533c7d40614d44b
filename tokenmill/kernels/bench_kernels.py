"""GPU timings of the Triton kernels at Llama-3-8B shapes, against their torch twins (or dense SDPA).

Timed calls are captured in a CUDA graph and replayed, so launch overhead is left out, as it is in the
engine's decode; the twins that sync with the host are timed eagerly. Memory-bound kernels report
achieved bandwidth over the bytes they must move, attention prefill reports causal TFLOP/s.

    python -m tokenmill.kernels.bench_kernels --out bench_results/kernels.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.kernels import torch_ref, triton_ops

HBM_BYTES_PER_S = 4.27e12  # device-to-device copy measured on the H200 here; decode targets 80 % of it
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 8, 128, 4096, 14336
DTYPE = torch.bfloat16


def median_ms(fn: Callable[[], object], iters: int = 20, reps: int = 10, graph: bool = True) -> float:
    """Per-call time: median over `iters` of CUDA-event timings of `reps` back-to-back calls. With graph=True
    the calls are captured once and replayed, so host launch overhead stays out of short kernels' times."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()

    def run() -> None:
        for _ in range(reps):
            fn()

    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def _paged_kv(num_seqs: int, ctx: int, block_size: int,
              kv_dtype: torch.dtype = DTYPE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches holding num_seqs contexts of ctx tokens in randomly placed blocks, and their block tables."""
    blocks = num_seqs * ctx // block_size
    k_cache = torch.randn(blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda").to(kv_dtype)
    v_cache = torch.randn(k_cache.shape, dtype=DTYPE, device="cuda").to(kv_dtype)
    tables = torch.randperm(blocks, device="cuda").to(torch.int32).view(num_seqs, -1)
    return k_cache, v_cache, tables


def bench_decode(num_seqs: int = 64, ctx: int = 4096, block_size: int = 16, kv_dtype: torch.dtype = DTYPE) -> dict:
    k_cache, v_cache, tables = _paged_kv(num_seqs, ctx, block_size, kv_dtype)
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    args = (q, k_cache, v_cache, starts, seq_lens, tables, HEAD_DIM ** -0.5, 1)
    ms = median_ms(lambda: triton_ops.paged_attention(*args))
    ref_ms = median_ms(lambda: torch_ref.paged_attention(*args), iters=5, graph=False)
    kv_bytes = 2 * num_seqs * ctx * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    cache = "" if kv_dtype == DTYPE else ", e4m3 KV" if kv_dtype == torch.float8_e4m3fn else f", {kv_dtype} KV"
    return _row(f"paged_attention decode (block {block_size}{cache})", f"{num_seqs} seqs x {ctx} ctx", ms, ref_ms,
                bytes_moved=kv_bytes)


def bench_decode_step(num_seqs: int, ctx: int, table_ctx: int = 0, block_size: int = 16) -> dict:
    """A decode step's attention as the engine runs it (triton_ops.decode_attention: rotary on q and the new key,
    its cache write and attention, one launch over a bf16 cache) against the twins' rope_and_cache and
    paged_attention. table_ctx: block tables as wide as a CUDA-graph runner's (sized for max_model_len)."""
    width = max(ctx, table_ctx)
    k_cache, v_cache, tables = _paged_kv(num_seqs, width, block_size)
    qkv = torch.randn(num_seqs, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=DTYPE, device="cuda")
    q, k, v = (t.view(num_seqs, -1, HEAD_DIM) for t in qkv.split(
        [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1))
    positions = torch.full((num_seqs,), ctx - 1, dtype=torch.int64, device="cuda")
    slots = tables[:, (ctx - 1) // block_size].long() * block_size + (ctx - 1) % block_size
    cos_sin = torch.randn(width, HEAD_DIM, device="cuda")
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    args = (positions, q, k, v, cos_sin, k_cache, v_cache, slots, starts, seq_lens, tables, HEAD_DIM ** -0.5)
    ms = median_ms(lambda: triton_ops.decode_attention(*args))
    ref_ms = median_ms(lambda: torch_ref.decode_attention(*args), iters=5, graph=False)
    kv_bytes = 2 * num_seqs * ctx * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    table = f", {width}-token tables" if table_ctx else ""
    return _row(f"decode_attention (rotary, cache write{table})", f"{num_seqs} seqs x {ctx} ctx", ms, ref_ms,
                bytes_moved=kv_bytes)


def bench_prefill(seq_len: int = 8192, block_size: int = 16, num_seqs: int = 1,
                  kv_dtype: torch.dtype = DTYPE) -> dict:
    """num_seqs prompts of seq_len tokens in one varlen launch (the offline workload's prefill steps: ~11 prompts
    of ~800 in 8,192 tokens), against torch's flash SDPA on the same keys and values laid out densely in bf16."""
    k_cache, v_cache, tables = _paged_kv(num_seqs, seq_len, block_size, kv_dtype)
    q = torch.randn(num_seqs * seq_len, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda") * seq_len
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    ms = median_ms(lambda: triton_ops.paged_attention(q, k_cache, v_cache, starts, seq_lens, tables,
                                                      HEAD_DIM ** -0.5, seq_len))
    group = NUM_HEADS // NUM_KV_HEADS

    def dense(cache: torch.Tensor) -> torch.Tensor:  # [seqs, heads, seq_len, d], kv heads repeated
        return cache[tables.long()].to(DTYPE).flatten(1, 2).transpose(1, 2).repeat_interleave(group, 1)

    k, v = dense(k_cache), dense(v_cache)
    qd = q.view(num_seqs, seq_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    ref_ms = median_ms(lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True))
    flops = num_seqs * 4 * NUM_HEADS * HEAD_DIM * seq_len * (seq_len + 1) // 2
    cache = ", e4m3 KV" if kv_dtype == torch.float8_e4m3fn else ""
    return _row(f"paged_attention prefill (block {block_size}{cache})", f"{num_seqs} x {seq_len} prompt", ms,
                ref_ms, flops=flops, ref_name="dense flash SDPA")


def bench_elementwise(num_tokens: int) -> list[dict]:
    """Norms, rope+cache and SiLU at num_tokens tokens: bandwidth-bound, bytes are inputs plus outputs."""
    rows = []
    x = torch.randn(num_tokens, HIDDEN, dtype=DTYPE, device="cuda")
    w = torch.ones(HIDDEN, dtype=DTYPE, device="cuda")
    nbytes = x.numel() * x.element_size()
    for name, op, args, moved in (("rms_norm", "rms_norm", (x, w, 1e-5), 2 * nbytes),
                                  ("rms_norm, folded weight", "rms_norm", (x, None, 1e-5), 2 * nbytes)):
        rows.append(_row(name, f"{num_tokens} x {HIDDEN}", median_ms(lambda: getattr(triton_ops, op)(*args)),
                         median_ms(lambda: getattr(torch_ref, op)(*args)), bytes_moved=moved))

    gate_up = torch.randn(num_tokens, 2 * INTERMEDIATE, dtype=DTYPE, device="cuda")
    moved = 3 * num_tokens * INTERMEDIATE * gate_up.element_size()
    rows.append(_row("silu_and_mul", f"{num_tokens} x 2*{INTERMEDIATE}",
                     median_ms(lambda: triton_ops.silu_and_mul(gate_up)),
                     median_ms(lambda: torch_ref.silu_and_mul(gate_up)), bytes_moved=moved))

    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=DTYPE, device="cuda")
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = (q.view(-1, NUM_HEADS, HEAD_DIM), k.view(-1, NUM_KV_HEADS, HEAD_DIM), v.view(-1, NUM_KV_HEADS, HEAD_DIM))
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    cos_sin = torch.randn(8192, HEAD_DIM, device="cuda")
    k_cache = torch.empty(num_tokens // 16 + 1, 16, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * 16, device="cuda")[:num_tokens]
    args = (positions, q, k, v, cos_sin, k_cache, v_cache, slots)
    moved = 2 * qkv.numel() * qkv.element_size()  # q, k, v read; q out, k and v into the cache
    rows.append(_row("rope_and_cache", f"{num_tokens} tokens, {NUM_HEADS}/{NUM_KV_HEADS} heads",
                     median_ms(lambda: triton_ops.rope_and_cache(*args)),
                     median_ms(lambda: torch_ref.rope_and_cache(*args), graph=False), bytes_moved=moved))
    return rows


def _row(kernel: str, shape: str, ms: float, ref_ms: float, bytes_moved: int = 0, flops: int = 0,
         ref_name: str = "torch twin") -> dict:
    row = {"kernel": kernel, "shape": shape, "us": ms * 1e3, "ref": ref_name, "ref_us": ref_ms * 1e3,
           "speedup": ref_ms / ms}
    if bytes_moved:
        row["GB/s"] = bytes_moved / ms / 1e6
        row["pct_of_hbm"] = 100 * bytes_moved / (ms * 1e-3) / HBM_BYTES_PER_S
    if flops:
        row["TFLOP/s"] = flops / ms / 1e9
        row["ref_TFLOP/s"] = flops / ref_ms / 1e9
    return row


def _print_table(rows: list[dict]) -> None:
    print(f"{'kernel':<44} {'shape':<30} {'us':>9} {'GB/s':>8} {'%HBM':>6} {'TFLOP/s':>8} {'ref us':>9} {'x ref':>6}")
    for r in rows:
        gbs = f"{r['GB/s']:.0f}" if "GB/s" in r else "-"
        pct = f"{r['pct_of_hbm']:.0f}" if "pct_of_hbm" in r else "-"
        tf = f"{r['TFLOP/s']:.0f}" if "TFLOP/s" in r else "-"
        print(f"{r['kernel']:<44} {r['shape']:<30} {r['us']:>9.1f} {gbs:>8} {pct:>6} {tf:>8} "
              f"{r['ref_us']:>9.1f} {r['speedup']:>6.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["decode", "prefill", "elementwise"], help="time one group of kernels")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    torch.manual_seed(0)
    fp8 = torch.float8_e4m3fn
    groups = {
        "decode": lambda: [bench_decode(), bench_decode(block_size=32), bench_decode(kv_dtype=fp8),
                           bench_decode(256, 1024), bench_decode(256, 1024, kv_dtype=fp8),
                           bench_decode_step(1, 150, table_ctx=8192), bench_decode_step(1, 4000, table_ctx=8192),
                           bench_decode_step(64, 4096), bench_decode_step(256, 1024)],
        "prefill": lambda: [bench_prefill(), bench_prefill(num_seqs=11, seq_len=800),
                            bench_prefill(num_seqs=11, seq_len=800, kv_dtype=fp8)],
        "elementwise": lambda: bench_elementwise(8192) + bench_elementwise(64),
    }
    rows = [row for name, rows_of in groups.items() if args.only in (None, name) for row in rows_of()]
    _print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
