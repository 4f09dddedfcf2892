#!/usr/bin/env bash
# The end-to-end reliability module (tests/integration/test_e2e_reliability.py: the short
# soak, the cancellation storm, preemption and replay) several times in a row while busy
# loops load the CPU, to show its checks hold on a loaded machine (not in CI: about 2
# minutes a run on a quiet 2-core box, about 18 with one busy loop beside it, because
# vLLM's CPU engine spins its OpenMP threads against the loop).
#   bash scripts/reliability_under_load.sh [RUNS (5)] [BUSY_LOOPS (1)]
# Prints one line per run; exit status 0 when every run passed.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
runs=${1:-5}
loops=${2:-1}
bash scripts/setup_env.sh >/dev/null
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
out=$(mktemp -d)
busy=()
for _ in $(seq "$loops"); do
  python3 -c "while True: pass" &
  busy+=($!)
done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT
failed=0
for i in $(seq "$runs"); do
  t0=$(date +%s)
  .venv/bin/python -m pytest -q -p no:cacheprovider tests/integration/test_e2e_reliability.py \
    >"$out/run_$i.log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || failed=1
  echo "run $i/$runs: rc=$rc, $(( $(date +%s) - t0 )) s, load $(cut -d' ' -f1 /proc/loadavg):" \
    "$(tail -1 "$out/run_$i.log")"
done
echo "logs in $out"
exit "$failed"
