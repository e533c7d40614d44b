#!/usr/bin/env bash
# GPU check on a CUDA machine: kernel, quantization and engine tests, then kernel and engine benchmarks (Llama-3-8B
# shape with random weights: bf16, INT8, INT4; transformers' generate in the same run). One section per step, a
# summary last. SECTIONS picks what runs, in that order (default: tests profile bench): tests (GPU tests), profile
# (where a decode step's time goes, verify-step cost, what each part of an INT4 layer costs in place), bench (kernel,
# quantization and engine benchmarks), tp (2 GPUs: TP=2 against TP=1, batch-1 speed at TP=1 and 2), fp8 (FP8 weights:
# their tests, kernel timings, batch 1, a batch-256 step and the offline workload against bf16 weights in the same
# run). SKIP lists step names to leave out ("quant tests,kernel bench"). A step stops after STEP_TIMEOUT s.
# Installs nothing but the wheels found in .whl/ (the GPU machine has no registry access).
#   OUT_DIR=bench_results scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-bench_results}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
mkdir -p "$OUT_DIR"
STEPS=()
FAILED=0

SECTIONS=${SECTIONS:-tests profile bench}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}

step() {  # step NAME CMD...: run one step, record its status and duration
    local name=$1 start=$SECONDS rc
    shift
    if [[ ",${SKIP:-}," == *",$name,"* ]]; then
        STEPS+=("$(printf '%-16s %-8s' "$name" skipped)")
        return
    fi
    echo "=== $name ==="
    timeout -s ABRT "$STEP_TIMEOUT" "$@"  # with PYTHONFAULTHANDLER set, a hung step prints where it hangs
    rc=$?
    [ "$rc" -eq 0 ] || FAILED=1
    STEPS+=("$(printf '%-16s %-8s %5ss' "$name" "$([ "$rc" -eq 0 ] && echo ok || echo "FAIL $rc")" $((SECONDS - start)))")
}

if compgen -G ".whl/*.whl" >/dev/null; then
    step "wheels" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step "env" "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
DUMMY=(--load-format dummy --model-preset llama-3-8b)
tests() {
    # the GEMV tests compile ~100 kernel variants, the INT4 mma tests ~50: pytest-xdist spreads the compiles over
    # the CPUs (the GEMV tests alone: 4 min -> 50 s; the mma tests took 31 s with 14 workers)
    local xdist=()
    "$PY" -c "import xdist" 2>/dev/null && xdist=(-n "$(( $(nproc) < 12 ? $(nproc) : 12 ))" -p no:cacheprovider)
    step "kernel tests" "$PY" -m pytest tests/kernels -x -q --ignore tests/kernels/test_triton_gemv.py \
        --ignore tests/kernels/test_triton_int4_mma.py
    step "gemv tests" "$PY" -m pytest tests/kernels/test_triton_gemv.py tests/kernels/test_triton_int4_mma.py -x -q \
        "${xdist[@]}"
    step "quant tests" "$PY" -m pytest tests/quant/test_triton_quant.py -x -q
    step "runner tests" "$PY" -m pytest tests/runner -x -q  # sampling and pending tokens never wait for the GPU
    step "engine tests" "$PY" -m pytest tests/engine/test_gpu_engine.py -x -v --durations=0
}
profile() {
    step "profile bf16" "$PY" -m tokenmill.cli bench profile "${DUMMY[@]}" --batch-sizes 1 64 256 \
        --out "$OUT_DIR/profile_bf16.json"
    step "profile async" "$PY" -m tokenmill.cli bench profile "${DUMMY[@]}" --batch-sizes 1 64 256 \
        --async-scheduling --verify-query-lens --out "$OUT_DIR/profile_async.json"
    for q in int8 int4; do
        step "profile $q" "$PY" -m tokenmill.cli bench profile "${DUMMY[@]}" --quantization $q --batch-sizes 1 \
            --max-num-seqs 8 --verify-query-lens --out "$OUT_DIR/profile_$q.json"
    done
    step "parts int4" "$PY" -m tokenmill.cli bench parts "${DUMMY[@]}" --quantization int4 --quantize-lm-head \
        --async-scheduling --max-num-seqs 8 --rounds 1 --out "$OUT_DIR/parts_int4.json"
}
tp() {  # a hang becomes an error with a traceback; tokenmill's ranks exit with their parent, torchrun's are killed
    export TOKENMILL_DIST_TIMEOUT_S=${TOKENMILL_DIST_TIMEOUT_S:-90} TOKENMILL_DIST_JOIN_TIMEOUT_S=${TOKENMILL_DIST_JOIN_TIMEOUT_S:-90} NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    step "nccl smoke" "$PY" -m torch.distributed.run --nproc-per-node 2 scripts/nccl_smoke.py
    pkill -9 -f nccl_smoke.py
    step "tp tests" "$PY" -m pytest tests/engine/test_tensor_parallel.py -x -v -k gpus --durations=0
    step "latency tp" "$PY" -m tokenmill.cli bench latency "${DUMMY[@]}" --num-iters 3 --max-num-seqs 8 \
        --sweep tensor_parallel_size=1,2 async_scheduling=false,true --out "$OUT_DIR/latency_tp.json"
    step "profile tp" "$PY" -m tokenmill.cli bench profile "${DUMMY[@]}" --tensor-parallel-size 2 --batch-sizes 1 64 \
        --max-num-seqs 64 --verify-query-lens --out "$OUT_DIR/profile_tp.json"
}
bench() {
    step "kernel bench" "$PY" -m tokenmill.kernels.bench_kernels --out "$OUT_DIR/kernels.json"
    step "gemv bench" "$PY" -m tokenmill.kernels.bench_gemv --out "$OUT_DIR/gemv.json"  # --tune: ~4 min
    step "quant bench" "$PY" -m tokenmill.quant.bench --m 2 16 64 2048 --tune --out "$OUT_DIR/quant_kernels.json"
    for q in none int8 int4 fp8; do
        step "latency $q" "$PY" -m tokenmill.cli bench latency "${DUMMY[@]}" --num-iters 3 --max-num-seqs 8 \
            $([ $q = none ] || echo --quantization $q) --sweep async_scheduling=false,true \
            $([ $q = none ] || echo quantize_lm_head=false,true) --out "$OUT_DIR/latency_$q.json"
    done
    step "latency no PDL" env TOKENMILL_PDL=0 "$PY" -m tokenmill.cli bench latency "${DUMMY[@]}" --num-iters 3 \
        --max-num-seqs 8 --async-scheduling --out "$OUT_DIR/latency_nopdl.json"  # the baseline of PDL's gain
    step "prefill 8191" "$PY" -m tokenmill.cli bench latency "${DUMMY[@]}" --prefill-len 8191 --output-len 2 \
        --max-num-batched-tokens 8192 --max-num-seqs 8 --out "$OUT_DIR/prefill_8191.json"
    step "compare-hf" "$PY" -m tokenmill.cli bench compare-hf "${DUMMY[@]}" --max-tokens 128 --repeats 3 \
        --max-num-seqs 8 --out "$OUT_DIR/compare_hf.json"
    # async scheduling is the engine's fast path (sync was measured against it until the e4m3 decode kernel); the
    # e4m3 cache halves decode attention's bytes
    step "throughput" "$PY" -m tokenmill.cli bench throughput "${DUMMY[@]}" --temperatures 0.6 --breakdown \
        --sweep max_num_batched_tokens=8192 async_scheduling=true kv_cache_dtype=auto,fp8 \
        --out "$OUT_DIR/throughput.json"
}
fp8() {
    step "fp8 tests" "$PY" -m pytest tests/kernels/test_triton_fp8_linear.py tests/kernels/test_triton_fp8_skinny.py \
        tests/quant/test_triton_quant.py -q -k "fp8 or matmul or skinny" -rf
    step "fp8 engine tests" "$PY" -m pytest tests/engine/test_gpu_engine.py -x -q -k "graph" -rf
    step "fp8 gemv bench" "$PY" -m tokenmill.kernels.bench_gemv --matrices qkv o gate_up down --tune fp8 \
        --out "$OUT_DIR/gemv_fp8.json"
    step "fp8 quant bench" "$PY" -m tokenmill.quant.bench --m 1 2 16 64 256 2048 8192 --out "$OUT_DIR/quant_fp8.json"
    step "fp8 gemm bench" "$PY" -m tokenmill.quant.bench --fp8-gemm $([ -n "${FP8_TUNE:-}" ] && echo --tune) \
        --fp8-rows 16 17 32 64 128 160 192 256 1024 --out "$OUT_DIR/quant_fp8_gemm.json"  # e4m3 kernels against cuBLAS; FP8_TUNE=1: ~2 min
    step "latency fp8" "$PY" -m tokenmill.cli bench latency "${DUMMY[@]}" --num-iters 3 --max-num-seqs 8 \
        --async-scheduling --quantization fp8 --sweep quantize_lm_head=false,true --out "$OUT_DIR/latency_fp8.json"
    for q in none fp8; do  # TOKENMILL_PDL=0: a kernel's time does not include its wait for the one before
        step "profile $q w" env TOKENMILL_PDL=0 "$PY" -m tokenmill.cli bench profile "${DUMMY[@]}" \
            $([ $q = none ] || echo --quantization $q) --kv-cache-dtype fp8 --async-scheduling \
            --max-num-batched-tokens 32768 --input-len 800 --batch-sizes 64 128 160 256 --prefill-tokens 8192 \
            --out "$OUT_DIR/profile_w$q.json"
    done
    # --hf-requests: transformers' continuous batching (bf16) on the workload's first 64 requests, tokenmill too
    # (six engines and transformers: ~8 min, past the default STEP_TIMEOUT; run the section with STEP_TIMEOUT=560)
    step "throughput fp8" "$PY" -m tokenmill.cli bench throughput "${DUMMY[@]}" --temperatures 0.6 --breakdown \
        --sweep max_num_batched_tokens=16384,32768,65536 async_scheduling=true kv_cache_dtype=fp8 quantization=none,fp8 \
        --hf-requests 64 --out "$OUT_DIR/throughput_fp8.json"
}
for section in $SECTIONS; do
    case $section in
        tests|profile|tp|bench|fp8) "$section" ;;
        *) echo "unknown section '$section' (tests profile tp bench fp8)"; exit 2 ;;
    esac
done

echo "=== summary ==="
printf '%s\n' "${STEPS[@]}"
exit "$FAILED"
