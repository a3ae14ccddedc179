#!/usr/bin/env bash
# Run a command while two busy loops keep both cores loaded: the proof that no test depends on
# the machine's speed. The loops are stopped by PID on every exit path.
#   tests/run_busy.sh make test
set -uo pipefail
pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; }
trap stop EXIT
trap 'exit 130' INT TERM
for _ in 1 2; do
    python3 -c "while 1: pass" &
    pids+=($!)
done
echo "busy loops: ${pids[*]}" >&2
"$@"
