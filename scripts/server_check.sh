#!/usr/bin/env bash
# A real model served with eviction, checked the way a user meets it: it starts, evicts,
# holds its bound, answers what dense answers, refuses bad values and frees every block:
#
#   scripts/server_check.sh [MODEL] [BUDGET] [CONTEXT] [SAMPLES]
#   scripts/server_check.sh gemma3-270m 512 2560 20      # the defaults
#
# 1. `nexus-vllm serve MODEL --kv-budget BUDGET` (Nexus, the server's defaults);
# 2. completion-shaped pass keys of CONTEXT tokens through /v1/completions, dense
#    (`kv_eviction: none` per request) and evicting, paired (`nexus-vllm server-eval
#    --protocol question-last`): the answers kept at BUDGET/CONTEXT of the prompt;
# 3. a bad per-request value (HTTP 400, the server keeps serving) and the server's own
#    metrics: no request over its bound, every block back, KV usage 0;
# 4. a short soak on a fresh server of the same settings with 30% of the streams
#    cancelled (scripts/soak.py): nothing leaked, no fault.
# Writes runs/server_check_MODEL/ (records.jsonl, table.md, metrics.json, soak.json).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
model=${1:-gemma3-270m}
budget=${2:-512}
context=${3:-2560}
samples=${4:-20}
out=runs/server_check_$model
port=${NEXUS_VLLM_PORT:-8131}
mkdir -p "$out"
py=.venv/bin/python
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
path=$("$py" -m nexus_vllm.models --model "$model" 2>/dev/null || echo "$model")
args=(--kv-eviction nexus --kv-budget "$budget" --port "$port" --max-model-len 8192)

"$py" -m nexus_vllm.integration.frontend.serve "$model" "${args[@]}" >"$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { tail -40 "$out/server.log"; exit 1; }
  sleep 1
done
base=http://127.0.0.1:$port

"$py" -m nexus_vllm.cli server-eval --base-url "$base" --model "$path" --budget "$budget" \
  --protocol question-last --tasks passkey --methods dense,nexus --context "$context" \
  --samples "$samples" --data-seed 1 --out "$out"
# What the evicting requests keep of dense's answers (the samples dense answers).
"$py" - "$out/records.jsonl" <<'EOF' | tee "$out/kept.txt"
import pathlib
import sys
from nexus_vllm.eval.records import read_records
by = {}
for r in read_records(pathlib.Path(sys.argv[1])):
    by.setdefault(r.index, {})[r.method] = r.score
solved = [i for i, m in by.items() if m.get("dense", 0) >= 1.0 and "nexus" in m]
kept = sum(by[i]["nexus"] >= 1.0 for i in solved)
print(f"nexus keeps {kept} of the {len(solved)} answers dense gives "
      f"({kept / max(1, len(solved)):.0%}; {len(by)} samples)")
EOF

code=$(curl -s -o "$out/bad_value.json" -w '%{http_code}' "$base/v1/completions" \
  -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model\", \"prompt\": \"hello\", \"max_tokens\": 4, \"vllm_xargs\": {\"kv_budget\": -5}}")
echo "bad kv_budget: HTTP $code"
[ "$code" = 400 ]
curl -sf "$base/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model\", \"prompt\": \"hello\", \"max_tokens\": 4}" >/dev/null
# One long request in this server's lifetime (server-eval may have resumed from records).
long=$("$py" -c "print('The grass is green. The sky is blue. ' * ($context // 10))")
curl -sf "$base/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model\", \"prompt\": \"$long\", \"max_tokens\": 16}" >/dev/null
"$py" - "$base" "$out/metrics.json" <<'EOF'
import json, sys
import requests
from nexus_vllm.eval.metrics_text import parse_metrics
m = parse_metrics(requests.get(sys.argv[1] + "/metrics", timeout=30).text)
keep = {k: m.get(k, 0.0) for k in (
    "vllm:nexus_evicted_blocks_total", "vllm:nexus_eviction_events_total",
    "vllm:nexus_live_blocks_over_budget", "vllm:nexus_live_blocks_peak",
    "vllm:nexus_free_blocks", "vllm:nexus_total_blocks", "vllm:kv_cache_usage_perc",
    "vllm:nexus_faults_total")}
json.dump(keep, open(sys.argv[2], "w"), indent=1)
print(json.dumps(keep, indent=1))
assert keep["vllm:nexus_live_blocks_over_budget"] <= 0, "a request went over its bound"
assert keep["vllm:nexus_evicted_blocks_total"] > 0, "nothing was evicted"
assert keep["vllm:kv_cache_usage_perc"] == 0.0, "blocks still held after every request"
EOF
kill $server
wait $server 2>/dev/null || true
trap - EXIT

"$py" scripts/soak.py --model "$path" --requests 24 --concurrency 8 \
  --prompt-tokens 200,3000 --max-tokens 16,48 --cancel-fraction 0.3 --seed 3 \
  --kv-cache-gib 2 --server-args="--kv-eviction nexus --kv-budget $budget --max-model-len 8192" \
  --methods nexus --budgets "$budget" --endpoints completions --output "$out/soak.json" \
  --log-dir "$out"
