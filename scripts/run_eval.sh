#!/usr/bin/env bash
# Reproduces docs/results.md on a CPU box (the numbers there come from these commands).
#   scripts/run_eval.sh [calibration|headline|ablation|prefill|knorm_prior|paired|sweep|kvpress|docs|all]
#   (default: all)
# Each run resumes from its records.jsonl if interrupted. 1 torch thread per run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1
OUT=${NEXUS_VLLM_RUNS:-runs}
run() {  # name, extra args...
  local name=$1; shift
  "$PY" -m nexus_vllm.cli eval --config "configs/eval/$name.yaml" --out "$OUT/$name" "$@"
}
what=${1:-all}
want() { [ "$what" = all ] || [ "$what" = "$1" ]; }
case "$what" in
  calibration|headline|ablation|prefill|knorm_prior|paired|sweep|kvpress|docs|all) ;;
  *) echo "unknown target $what" >&2; exit 2 ;;
esac
want calibration && run calibration
want headline && run headline
want ablation && run ablation
want prefill && run prefill
want knorm_prior && run knorm_prior
want paired && run paired
want kvpress && run kvpress --peer kvpress
if want sweep; then
  # Reuse the headline's question-last runs of the plain methods (identical keys, so the
  # 0.2 budget is not recomputed); skipped once the sweep has records of its own.
  if [ -e "$OUT/headline/records.jsonl" ]; then
    "$PY" -m nexus_vllm.cli records "$OUT/headline/records.jsonl" --if-missing \
      --where protocol=question-last --exclude-method-prefix nexus: \
      --out "$OUT/sweep/records.jsonl"
  fi
  run sweep
fi
if want docs; then
  # Ours and kvpress's presses side by side: headline records + the peer's records.
  if [ -e "$OUT/headline/records.jsonl" ] && [ -e "$OUT/kvpress/kvpress_records.jsonl" ]; then
    "$PY" -m nexus_vllm.cli records "$OUT/headline/records.jsonl" \
      "$OUT/kvpress/kvpress_records.jsonl" --out "$OUT/peer_compare/records.jsonl"
    "$PY" -m nexus_vllm.cli eval --config configs/eval/headline.yaml --out "$OUT/peer_compare" \
      --report-only --publish docs/figures/peer_compare
  fi
  # Rebuild each run's reports from its records and copy them into docs/figures.
  for name in calibration headline ablation prefill knorm_prior paired kvpress sweep; do
    [ -d "$OUT/$name" ] || continue
    "$PY" -m nexus_vllm.cli eval --config "configs/eval/$name.yaml" --out "$OUT/$name" \
      --report-only --publish "docs/figures/$name"
  done
fi
