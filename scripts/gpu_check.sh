#!/usr/bin/env bash
# GPU check on a CUDA machine: kernel, quantization and engine tests, then kernel and engine benchmarks (Llama-3-8B
# shape with random weights: bf16, INT8, INT4; transformers' generate in the same run). One section per step, a
# summary last. QUICK=1 stops after the tests.
# Installs nothing but the wheels found in .whl/ (the GPU machine has no registry access).
#   OUT_DIR=bench_results scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-bench_results}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
STEPS=()
FAILED=0

step() {  # step NAME CMD...: run one section, record its status and duration
    local name=$1 start=$SECONDS rc
    shift
    echo "=== $name ==="
    "$@"
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
step "kernel tests" "$PY" -m pytest tests/kernels -x -q
step "quant tests" "$PY" -m pytest tests/quant/test_triton_quant.py -x -q
step "engine tests" "$PY" -m pytest tests/engine/test_gpu_engine.py -x -q
if [ "${QUICK:-0}" != 1 ]; then
    DUMMY=(--load-format dummy --model-preset llama-3-8b)
    step "kernel bench" "$PY" -m tokenmill.kernels.bench_kernels --out "$OUT_DIR/kernels.json"
    step "quant bench" "$PY" -m tokenmill.quant.bench --out "$OUT_DIR/quant_kernels.json"
    for q in none int8 int4; do
        step "latency $q" "$PY" -m tokenmill.cli bench latency "${DUMMY[@]}" --input-len 32 --output-len 128 \
            --num-iters 3 $([ $q = none ] || echo --quantization $q) --out "$OUT_DIR/latency_$q.json"
    done
    step "compare-hf" "$PY" -m tokenmill.cli bench compare-hf "${DUMMY[@]}" --max-tokens 128 --repeats 3 \
        --out "$OUT_DIR/compare_hf.json"
    step "throughput" "$PY" -m tokenmill.cli bench throughput --load-format dummy --model-preset qwen3-0.6b \
        --temperatures 0.6 --out "$OUT_DIR/throughput.json"
fi

echo "=== summary ==="
printf '%s\n' "${STEPS[@]}"
exit "$FAILED"
