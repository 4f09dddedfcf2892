#!/usr/bin/env bash
# vLLM 0.34 compat job: build (or reuse) the test-only vLLM 0.34 CPU build at
# .venv-vllm034/ (scripts/setup_vllm034.sh) and run, with its interpreter, the canaries
# and the 0.34 end-to-end subset (tests/compat/). Extra arguments go to pytest.
#   bash scripts/test_vllm034.sh            # canaries, unit tests, the 0.34 e2e subset and
#                                           # head-paged attention on 0.34's CPU ops (about
#                                           # 9 minutes on 2 cores, build cached)
#   bash scripts/test_vllm034.sh --ci       # the same with its core e2e module only (one
#                                           # server; what scripts/test.sh runs, ~4 min)
#   bash scripts/test_vllm034.sh --quick    # canaries and unit tests only (no server)
# The unit tests' own end-to-end cases (tests marked e2e outside tests/compat) run on 0.32
# only; the 0.34 e2e subset is tests/compat.
# Needs .venv/ (bash scripts/setup_env.sh, run by scripts/test.sh). What breaks here is a
# vLLM 0.34 incompatibility or a build problem; the build prints which.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
tier=all
case "${1:-}" in
  --quick) tier=quick; shift ;;
  --ci) tier=ci; shift ;;
esac
bash scripts/setup_env.sh
bash scripts/setup_vllm034.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_TARGET_DEVICE=cpu
py=.venv-vllm034/bin/python
"$py" -c 'import vllm, importlib.metadata as m; print("[test-vllm034] vllm", m.version("vllm"))'
unit=(tests/integration/test_vllm_hooks.py tests/integration/test_patch_safety.py
      tests/integration/test_runners.py tests/integration/test_manager.py
      tests/integration/test_worker_state.py tests/integration/test_startup_checks.py
      tests/integration/test_bad_input.py tests/integration/test_scheduler_vllm.py)
case "$tier" in
  quick) e2e=() ;;
  ci) e2e=(tests/compat/test_vllm034_e2e.py) ;;
  *) e2e=(tests/compat tests/integration/test_head_attention.py) ;;
esac
exec "$py" -m pytest -m "not gpu and (not e2e or compat)" -p no:cacheprovider "${unit[@]}" \
  ${e2e[@]+"${e2e[@]}"} "$@"
