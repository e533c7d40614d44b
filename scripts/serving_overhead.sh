#!/usr/bin/env bash
# Serving overhead (issue 4): the same 32-request load offline (`tokenmill bench throughput`, LLM.generate's engine
# loop) and through HTTP (`tokenmill serve` + `tokenmill bench serve`, all requests at once), output tokens/s of
# each, then `bench serve` at a few request rates. Engine options after the script name go to both, e.g.
#   scripts/serving_overhead.sh --dtype bfloat16 --quantization gguf
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PORT=${PORT:-8765}
OUT=${OUT:-/tmp/tokenmill-serving-overhead}
mkdir -p "$OUT"
REQS=32 IN=40 NEW=128

"$PY" -m tokenmill.cli bench throughput --num-requests $REQS --min-input-len $IN --max-input-len $IN \
    --min-output-len $NEW --max-output-len $NEW --temperatures 0 --out "$OUT/offline.json" "$@" | tail -4

"$PY" -m tokenmill.cli serve --port "$PORT" "$@" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done

serve_bench() {  # $1: request rate, $2: prompts, $3: result file
    "$PY" -m tokenmill.cli bench serve --port "$PORT" --num-prompts "$2" --random-input-len $IN \
        --random-output-len $NEW --ignore-eos --temperature 0 --request-rate "$1" --disable-tqdm \
        --save-result --result-dir "$OUT" --result-filename "$3" > "$OUT/$3.txt"
}
serve_bench 2 8 warmup.json
serve_bench inf $REQS http.json
for rate in 1 2 4; do serve_bench $rate 64 "rate$rate.json"; done

"$PY" - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
offline = json.load(open(f"{out}/offline.json"))
offline_tps = offline["results"][0]["output_tokens_per_s"]
http = json.load(open(f"{out}/http.json"))
print(f"\n32 requests x 40 prompt + 128 new tokens: offline {offline_tps:.1f} output tok/s, "
      f"HTTP {http['output_throughput']:.1f} output tok/s = {http['output_throughput'] / offline_tps:.1%} of offline")
print(f"{'rate':>6} {'req/s':>7} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'E2E p50 s':>10}")
for name in ("http", "rate1", "rate2", "rate4"):
    r = json.load(open(f"{out}/{name}.json"))
    print(f"{r['request_rate']:>6} {r['request_throughput']:>7.2f} {r['output_throughput']:>10.1f} "
          f"{r['median_ttft_ms']:>12.1f} {r['median_tpot_ms']:>12.1f} {r['median_e2el_ms'] / 1e3:>10.2f}")
EOF
