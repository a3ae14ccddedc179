#!/bin/bash
# Two commits' GPU speed in one run on one GPU: LLaDA-8B exact/dual at batch 1/8/32
# (gpu_bench.py) and SDAR-4B at batch 1/32/128 (gpu_bench_block.py), old then new.
#
#   benchmarks/compare_commits.sh prepare OLD NEW   # here: snapshots in build/snap_{old,new}
#   benchmarks/compare_commits.sh run               # on the GPU host (carry build/), OUT=dir
#                                                   # (ORDER="new old" runs the new one first)
set -u
case "${1:-}" in
prepare)
  for pair in "old:$2" "new:$3"; do
    name=${pair%%:*}; rev=${pair#*:}
    rm -rf "build/snap_$name" && mkdir -p "build/snap_$name"
    git archive "$rev" dlm_engine dlm_protocol benchmarks dlm_lab | tar -x -C "build/snap_$name"
    rm -rf "build/snap_$name/benchmarks/results"
    git rev-parse "$rev" > "build/snap_$name/COMMIT"
  done ;;
run)
  OUT=${OUT:-out}; mkdir -p "$OUT"
  if ! python -c "import llguidance" 2>/dev/null && ls gpu_wheels/llguidance-*.whl >/dev/null 2>&1; then
    pip install -q --no-deps --target /tmp/pyx gpu_wheels/llguidance-*.whl
  fi
  for s in ${ORDER:-old new}; do
    (cd "build/snap_$s" && PYTHONPATH=.:/tmp/pyx timeout 200 python benchmarks/gpu_bench.py \
      --models llada-8b --modes exact,dual --batches 1,8,32 --steps 64 \
      --out "$OUT/$s-gpu_bench" > "$OUT/$s-gpu_bench.log" 2>&1)
    echo "$s $(cat "build/snap_$s/COMMIT")"; tail -8 "$OUT/$s-gpu_bench.log"
  done
  for s in ${ORDER:-old new}; do
    (cd "build/snap_$s" && PYTHONPATH=.:/tmp/pyx timeout 120 python benchmarks/gpu_bench_block.py \
      --models sdar-4b --batches 1,32,128 --out "$OUT/$s-block" > "$OUT/$s-block.log" 2>&1)
    echo "$s"; tail -5 "$OUT/$s-block.log"
  done ;;
*) echo "usage: $0 prepare OLD NEW | run" >&2; exit 2 ;;
esac
