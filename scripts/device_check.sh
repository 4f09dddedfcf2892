#!/usr/bin/env bash
# One short GPU check for nexus_vllm.kernels (< 5 minutes on one GPU):
#   1. the GPU-marked kernel tests (`pytest -m gpu tests/kernels`),
#   2. the block-scoring / compaction benchmark (benchmarks/kernels/bench_block_scoring.py).
# Results (logs, junit XML, bench JSON, nvidia-smi line) go to $OUT (the device tool's
# output folder) or $NEXUS_VLLM_CHECK_OUT or /tmp/nexus_vllm_device_check.
#
# Environment: uses the first Python that already has CUDA torch + triton + pytest
# ($PYTHON, .venv/bin/python, python3: e.g. a vllm/vllm-openai image); only when none has
# them does it try `pip install -e '.[test,triton]'` (needs a package index; skipped when
# NEXUS_VLLM_CHECK_NO_INSTALL=1).
#
# Usage: bash scripts/device_check.sh [extra benchmark args, e.g. --contexts 32768,131072]
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out="${OUT:-${NEXUS_VLLM_CHECK_OUT:-/tmp/nexus_vllm_device_check}}"
mkdir -p "$out"
start=$(date +%s)

ready() {
  "$1" - <<'EOF' 2>/dev/null
import sys
import pytest, torch, triton  # noqa: F401
sys.exit(0 if torch.cuda.is_available() else 1)
EOF
}

py=""
for cand in "${PYTHON:-}" "$repo/.venv/bin/python" python3 python; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && ready "$cand" && { py="$cand"; break; }
done
if [ -z "$py" ]; then
  echo "[device_check] no Python with CUDA torch + triton + pytest; trying pip install"
  py="${PYTHON:-python3}"
  if [ "${NEXUS_VLLM_CHECK_NO_INSTALL:-0}" != 1 ]; then
    "$py" -m pip install -q -e "$repo[test,triton]" || true
  fi
  if ! ready "$py"; then
    echo "[device_check] FAILED: no usable CUDA torch + triton (no GPU, or offline install failed)"
    exit 2
  fi
fi

export HF_HUB_OFFLINE=1 PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
"$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"device", torch.cuda.get_device_name())' | tee "$out/versions.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,driver_version --format=csv \
  >"$out/nvidia-smi.csv" 2>&1 || true

echo "[device_check] pytest -m gpu tests/kernels"
timeout 170 "$py" -m pytest -m gpu tests/kernels -q -p no:cacheprovider \
  --junitxml "$out/pytest-gpu.xml" 2>&1 | tee "$out/pytest-gpu.log"
test_rc=${PIPESTATUS[0]}

echo "[device_check] benchmark"
timeout 110 "$py" benchmarks/kernels/bench_block_scoring.py --json "$out/bench.json" "$@" 2>&1 \
  | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "[device_check] tests rc=$test_rc bench rc=$bench_rc in $(( $(date +%s) - start )) s;" \
  "results in $out"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
