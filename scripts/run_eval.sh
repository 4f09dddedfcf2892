#!/usr/bin/env bash
# Reproduces docs/results.md on a CPU box (the numbers there come from these commands).
#   scripts/run_eval.sh [calibration|headline|ablation|sweep|kvpress|docs|all]   (default: all)
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
  calibration|headline|ablation|sweep|kvpress|docs|all) ;;
  *) echo "unknown target $what" >&2; exit 2 ;;
esac
want calibration && run calibration
want headline && run headline
want ablation && run ablation
want kvpress && run kvpress --peer kvpress
if want sweep; then
  # Reuse the headline's 0.2 runs (identical keys) instead of recomputing them.
  mkdir -p "$OUT/sweep"
  if [ ! -e "$OUT/sweep/records.jsonl" ] && [ -e "$OUT/headline/records.jsonl" ]; then
    grep '"question-last"' "$OUT/headline/records.jsonl" | grep -v '"method": "nexus:' \
      > "$OUT/sweep/records.jsonl" || true
  fi
  run sweep
fi
if want docs; then
  # Ours and kvpress's presses side by side: headline records + the peer's records.
  if [ -e "$OUT/headline/records.jsonl" ] && [ -e "$OUT/kvpress/kvpress_records.jsonl" ]; then
    mkdir -p "$OUT/peer_compare"
    cat "$OUT/headline/records.jsonl" "$OUT/kvpress/kvpress_records.jsonl" \
      > "$OUT/peer_compare/records.jsonl"
    "$PY" -m nexus_vllm.cli eval --config configs/eval/headline.yaml --out "$OUT/peer_compare" \
      --report-only
  fi
  for name in calibration headline ablation kvpress sweep; do
    [ -d "$OUT/$name" ] && "$PY" -m nexus_vllm.cli eval --config "configs/eval/$name.yaml" \
      --out "$OUT/$name" --report-only
  done
  for name in calibration headline ablation kvpress sweep peer_compare; do
    [ -d "$OUT/$name" ] || continue
    mkdir -p "docs/figures/$name"
    for f in "$OUT/$name"/*.md "$OUT/$name"/*.json "$OUT/$name"/*.jsonl "$OUT/$name"/*.png \
             "$OUT/$name"/config.yaml; do
      if [ -e "$f" ]; then cp "$f" "docs/figures/$name/"; fi
    done
  done
fi
