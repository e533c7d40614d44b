#!/usr/bin/env bash
# A/B of a change on one machine: the working tree against a base tree, interleaved, ROUNDS runs each, with the
# same benchmark arguments, so the baseline shares the machine and the minutes (fresh GPU machines differ by a
# few percent). Export the base first: git archive REV tokenmill | tar -x -C ab_base   (ab_base/tokenmill/...)
#   scripts/ab_bench.sh ab_base 2 latency --load-format dummy --model-preset llama-3-8b --async-scheduling
# Prints each run's table row; JSON goes to $OUT_DIR/ab_{head,base}_N.json.
set -uo pipefail
base=$(cd "$1" && pwd) rounds=$2
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${OUT_DIR:-bench_results}" && cd "${OUT_DIR:-bench_results}" && pwd)
for i in $(seq "$rounds"); do
    for side in head base; do
        dir=$root
        [ "$side" = base ] && dir=$base
        echo "=== $side $i"
        (cd "$dir" && python3 -m tokenmill.cli bench "$@" --out "$out/ab_${side}_$i.json" | grep -E '^ *[0-9]')
    done
done
