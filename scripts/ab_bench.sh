#!/usr/bin/env bash
# A/B of a change on one machine: the working tree against a base tree, interleaved, ROUNDS runs each, with the
# same benchmark arguments, so the baseline shares the machine and the minutes (fresh GPU machines differ by a
# few percent). Export the base first: git archive REV tokenmill | tar -x -C ab_base   (ab_base/tokenmill/...)
#   scripts/ab_bench.sh ab_base 2 latency --load-format dummy --model-preset llama-3-8b --async-scheduling
# Prints each run's table row; JSON goes to $OUT_DIR/ab_{head,base}_N.json.
set -uo pipefail
PY=${PYTHON:-python3}
[ -d "${1:-}/tokenmill" ] || { echo "usage: $0 BASE_DIR ROUNDS BENCH_ARGS... (BASE_DIR/tokenmill: the base tree)"; exit 2; }
base=$(cd "$1" && pwd) rounds=$2
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${OUT_DIR:-bench_results}" && cd "${OUT_DIR:-bench_results}" && pwd)
for i in $(seq "$rounds"); do
    for side in head base; do
        dir=$root
        [ "$side" = base ] && dir=$base
        echo "=== $side $i"
        (cd "$dir" && "$PY" -m tokenmill.cli bench "$@" --out "$out/ab_${side}_$i.json" | grep -E '^ *[0-9]') \
            || echo "$side $i failed (rc ${PIPESTATUS[0]})"
    done
done
