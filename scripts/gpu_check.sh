#!/usr/bin/env bash
# GPU check on a CUDA machine: kernel tests, then kernel benchmarks. One section per step, a summary last.
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
step "kernel bench" "$PY" -m tokenmill.kernels.bench_kernels --out "$OUT_DIR/kernels.json"

echo "=== summary ==="
printf '%s\n' "${STEPS[@]}"
exit "$FAILED"
