#!/usr/bin/env bash
# Reproduces docs/results.md on a CPU box (the numbers there come from these commands).
#   scripts/run_eval.sh [calibration|headline|ablation|prefill|knorm_prior|paired|dialogues|dialogues_pps|scoring_cost|scoring_cost_report|sweep|kvpress|prompt_end_tuning|prompt_modes|prompt_modes_capped|prompt_modes_multiturn|prompt_modes_longgen|chat_tuning|chat_report|completion_tuning|completion_report|stream_tuning|stream_report|stream_tuning_multiturn|stream_tuning_longdoc|stream_multiturn|stream_longdoc|stream_longgen|stream_chat|stream_sweep|stream_sweep_longdoc|stream_sweep_chat|stream_sweep_multiturn|stream_sweep_longgen|stream_end|stream_end_chat|stream_end_multiturn|gemma3_report|stream_head_longdoc|stream_head_profile_longdoc|stream_head_reconstruction|stream_head_learned_longdoc|stream_head_learned_chat|stream_head_learned_multiturn|stream_head_learned_longgen|head_learned_chat_report|docs|all]
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
merge_report() {  # name, parts...: one records.jsonl from the runs ${name}_<part>, one report
  local name=$1; shift
  local parts=()
  for part in "$@"; do parts+=("$OUT/${name}_$part/records.jsonl"); done
  "$PY" -m nexus_vllm.cli records "${parts[@]}" --out "$OUT/$name/records.jsonl"
  run "$name" --report-only
}
seed_family() {  # name, family, methods...: a run seeded with stream_<family>'s published
  # records of those methods (identical keys, not rerun), unless it holds records already.
  # The seeds sit beside the run directory, so --publish does not copy them.
  local name=$1 fam=$2; shift 2
  [ -e "$OUT/$name/records.jsonl" ] && return 0
  mkdir -p "$OUT/$name"
  for m in "$@"; do
    "$PY" -m nexus_vllm.cli records "docs/figures/stream_$fam/records.jsonl" \
      --where "method=$m" --out "$OUT/$name.seed_${m%%:*}.jsonl"
  done
  "$PY" -m nexus_vllm.cli records "$OUT/$name".seed_*.jsonl --out "$OUT/$name/records.jsonl"
}
what=${1:-all}
# An earlier default of the prompt-end event (four recent blocks, the rows' mean), as the
# reports label its committed records; docs/algorithm.md ("the chat shape") says which
# default each label was and which commit reproduces the ones no longer a mode.
BEFORE_ROUND_2="nexus:recent_blocks=4,prefill_direct=mean"
seed_defaults() {  # report, out: the earlier default's records from the committed report
  local report=$1 out=$2
  [ -e "$out" ] && return 0  # it may hold a resumed run
  "$PY" -m nexus_vllm.cli records "docs/figures/$report/records.jsonl" \
    --where "method=$BEFORE_ROUND_2" --out "$out"
}
want() { [ "$what" = all ] || [ "$what" = "$1" ]; }
case "$what" in
  calibration|headline|ablation|prefill|knorm_prior|paired|dialogues|dialogues_pps|scoring_cost|scoring_cost_report|sweep|kvpress|prompt_end_tuning|prompt_modes|prompt_modes_capped|prompt_modes_multiturn|prompt_modes_longgen|chat_tuning|chat_report|completion_tuning|completion_report|stream_tuning|stream_report|stream_tuning_multiturn|stream_tuning_longdoc|stream_multiturn|stream_longdoc|stream_longgen|stream_chat|stream_sweep|stream_sweep_longdoc|stream_sweep_chat|stream_sweep_multiturn|stream_sweep_longgen|stream_end|stream_end_chat|stream_end_multiturn|gemma3_report|stream_head_longdoc|stream_head_profile_longdoc|stream_head_reconstruction|stream_head_learned_longdoc|stream_head_learned_chat|stream_head_learned_multiturn|stream_head_learned_longgen|head_learned_chat_report|docs|all) ;;
  *) echo "unknown target $what" >&2; exit 2 ;;
esac
want calibration && run calibration
want headline && run headline
want ablation && run ablation
want prefill && run prefill
want knorm_prior && run knorm_prior
want paired && run paired
want kvpress && run kvpress --peer kvpress
if want dialogues; then
  # One process per task (one core each), then one report over both.
  for task in multiturn longgen; do
    run dialogues --tasks "$task" --out "$OUT/dialogues_$task" &
  done
  wait
  merge_report dialogues multiturn longgen
fi
if want dialogues_pps; then
  # Reuse the 20 streams of `dialogues` for the methods compared here.
  if [ -e "$OUT/dialogues/records.jsonl" ]; then
    for m in dense nexus nexus:sampler=topk; do
      "$PY" -m nexus_vllm.cli records "$OUT/dialogues/records.jsonl" --where task=multiturn \
        --where method="$m" --out "$OUT/dialogues_pps/seed_$m.jsonl"
    done
    "$PY" -m nexus_vllm.cli records "$OUT"/dialogues_pps/seed_*.jsonl --if-missing \
      --out "$OUT/dialogues_pps/records.jsonl"
    rm -f "$OUT"/dialogues_pps/seed_*.jsonl
  fi
  run dialogues_pps
fi
if want scoring_cost; then
  # Two processes (one core each) split by method, then one report over both.
  run scoring_cost --out "$OUT/scoring_cost_a" --methods \
    'dense;nexus:prefill_window=32,layer_stride=1;nexus:prefill_window=32,layer_stride=2' &
  run scoring_cost --out "$OUT/scoring_cost_b" --methods \
    'nexus:prefill_window=16,layer_stride=1;nexus:prefill_window=16,layer_stride=2' &
  wait
  merge_report scoring_cost a b
fi
if want scoring_cost_report; then
  # The defaults' records (paired and dialogues runs, method `nexus`) are reused under their
  # knobs' spelled-out name; only the cheaper scorings run. One process per config.
  OLD='nexus:prefill_window=32,layer_stride=1'
  seed_from() {  # config, source run
    mkdir -p "$OUT/$1"
    [ -e "$OUT/$2/records.jsonl" ] && "$PY" -m nexus_vllm.cli records \
      "$OUT/$2/records.jsonl" --where protocol=question-last --exclude-method-prefix nexus: \
      --exclude-method-prefix knorm --exclude-method-prefix tova \
      --rename-method nexus "$OLD" --if-missing --out "$OUT/$1/records.jsonl"
    return 0
  }
  seed_from scoring_cost_report paired
  seed_from scoring_cost_dialogues dialogues
  run scoring_cost_report &
  run scoring_cost_dialogues &
  wait
fi
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
want prompt_end_tuning && run prompt_end_tuning
# One process per task (one core each; more than two share the cores), seeded with the
# records of the runs they share methods with (`stream` mode: identical keys, not rerun),
# then one report over all tasks.
per_task() {  # config, seed run, tasks...
  local name=$1 seed=$2; shift 2
  for task in "$@"; do
    mkdir -p "$OUT/${name}_$task"
    if [ -e "$OUT/$seed/records.jsonl" ]; then
      "$PY" -m nexus_vllm.cli records "$OUT/$seed/records.jsonl" --where task="$task" \
        --where protocol=question-last --exclude-method-prefix nexus: --if-missing \
        --out "$OUT/${name}_$task/records.jsonl"
    fi
    run "$name" --tasks "$task" --out "$OUT/${name}_$task" &
  done
  wait
  merge_report "$name" "$@"
}
want prompt_modes && per_task prompt_modes paired niah_single_noise niah_single_prose niah_multikey
want prompt_modes_capped && per_task prompt_modes_capped none niah_single_noise niah_single_prose niah_multikey
want prompt_modes_multiturn && per_task prompt_modes_multiturn dialogues multiturn
want prompt_modes_longgen && per_task prompt_modes_longgen dialogues longgen
want chat_tuning && run chat_tuning
want completion_tuning && run completion_tuning
if want chat_report; then
  # Two processes (one core each) split by task, then one report over all tasks. The
  # earlier default runs no more: its records are the committed run's.
  for part in a b; do
    mkdir -p "$OUT/chat_report_$part"
    seed_defaults chat_report "$OUT/chat_report_$part/records.jsonl"
  done
  run chat_report --tasks niah_single_prose,niah_multikey,niah_multivalue,facts \
    --out "$OUT/chat_report_a" &
  run chat_report --tasks niah_multiquery,summary,chat_multiturn --out "$OUT/chat_report_b" &
  wait
  merge_report chat_report a b
fi
if want completion_report; then
  # The former defaults' records are prompt_modes' (identical samples), relabelled with
  # their knobs spelled out; only the new default runs. One process per half of the tasks.
  # The chat shape's earlier default is this report's committed run's.
  src="$OUT/prompt_modes/records.jsonl"
  [ -e "$src" ] || src=docs/figures/prompt_modes/records.jsonl
  seed_defaults completion_report "$OUT/completion_report_before.jsonl"
  for part in a b; do
    mkdir -p "$OUT/completion_report_$part"
    "$PY" -m nexus_vllm.cli records "$src" "$OUT/completion_report_before.jsonl" \
      --exclude-method-prefix "nexus:prompt_mode=end," \
      --exclude-method-prefix snapkv --exclude-method-prefix tova \
      --exclude-method-prefix knorm \
      --rename-method nexus "nexus:prompt_mode=stream,head_reduce=mean,carry=0,recent_blocks=4" \
      --rename-method "nexus:prompt_mode=end" "nexus:head_reduce=mean,carry=0,recent_blocks=4,prefill_direct=mean" \
      --if-missing --out "$OUT/completion_report_$part/records.jsonl"
  done
  run completion_report --tasks niah_single_noise,niah_single_prose \
    --out "$OUT/completion_report_a" &
  run completion_report --tasks niah_multikey --out "$OUT/completion_report_b" &
  wait
  merge_report completion_report a b
fi
# The streaming regime: the tuning sets (one process each), then the report
# sets (one process per family; about an hour on 2 cores).
for name in stream_tuning_multiturn stream_tuning_longdoc; do
  if want stream_tuning || want "$name"; then run "$name" & fi
done
wait
# kvpress's query-agnostic presses beside them, in its own protocol (the context
# compressed once before the question; DecodingPress for long generation).
peer_presses() {  # name: the presses that apply to that family
  case "$1" in
    stream_longdoc) echo "--peer kvpress --peer-presses expected_attention,kvzip" ;;
    stream_longgen) echo "--peer kvpress --peer-presses decoding_expected_attention" ;;
  esac
}
for name in stream_multiturn stream_longdoc stream_longgen; do
  # shellcheck disable=SC2046  # the flags split on purpose
  if want stream_report || want "$name"; then run "$name" $(peer_presses "$name") & fi
done
wait
# The chat report set read in `stream`, seeded with chat_report's dense records and its
# Nexus before the stream defaults (`nexus:prompt_mode=stream` there); the long documents'
# budget sweep, seeded with stream_longdoc's records. One process each.
if want stream_report || want stream_chat; then
  if [ ! -e "$OUT/stream_chat/records.jsonl" ]; then
    mkdir -p "$OUT/stream_chat"
    "$PY" -m nexus_vllm.cli records docs/figures/chat_report/records.jsonl \
      --where method=dense --out "$OUT/stream_chat/seed_dense.jsonl"
    "$PY" -m nexus_vllm.cli records docs/figures/chat_report/records.jsonl \
      --where method=nexus:prompt_mode=stream \
      --rename-method nexus:prompt_mode=stream nexus:expected=0,knorm_prior=0 \
      --out "$OUT/stream_chat/seed_before.jsonl"
    "$PY" -m nexus_vllm.cli records "$OUT/stream_chat/seed_dense.jsonl" \
      "$OUT/stream_chat/seed_before.jsonl" --out "$OUT/stream_chat/records.jsonl"
  fi
  run stream_chat &
fi
if want stream_report || want stream_sweep || want stream_sweep_longdoc; then
  "$PY" -m nexus_vllm.cli records docs/figures/stream_longdoc/records.jsonl --if-missing \
    --exclude-method-prefix nexus:expected=0, --exclude-method-prefix expected \
    --exclude-method-prefix nexus:expected=0.5,knorm_prior=4,sampler \
    --exclude-method-prefix nexus:knorm_prior --exclude-method-prefix oracle \
    --out "$OUT/stream_sweep_longdoc/records.jsonl"
  run stream_sweep_longdoc &
fi
wait
# The budget sweeps of the other stream families, each seeded with its published report
# set's dense, KNorm and shipped-default records (the report budget: identical keys, not
# rerun); then every family's curve side by side and the smallest budget keeping 90% of
# dense (`nexus-vllm sweep`). One process per family.
STREAM_SHIPPED="nexus:expected=0.5,knorm_prior=4"
for fam in chat multiturn longgen; do
  name=stream_sweep_$fam
  want stream_sweep || want "$name" || continue
  seed_family "$name" "$fam" dense knorm "$STREAM_SHIPPED"
  run "$name" &
done
wait
if want stream_sweep; then
  mkdir -p docs/figures/stream_sweeps
  # The report sets' records add the oracle at the report budget, and kvpress's KVzip.
  "$PY" -m nexus_vllm.cli sweep \
    "chat=$OUT/stream_sweep_chat/records.jsonl,docs/figures/stream_chat/records.jsonl" \
    "multi-turn=$OUT/stream_sweep_multiturn/records.jsonl,docs/figures/stream_multiturn/records.jsonl" \
    "long generation=$OUT/stream_sweep_longgen/records.jsonl,docs/figures/stream_longgen/records.jsonl" \
    "long documents=$OUT/stream_sweep_longdoc/records.jsonl,docs/figures/stream_longdoc/records.jsonl,docs/figures/stream_longdoc/kvpress_records.jsonl" \
    --method knorm --method "$STREAM_SHIPPED" --method oracle --method kvpress:kvzip \
    --plot docs/figures/stream_sweeps/plot_score.png --json docs/figures/stream_sweeps/sweeps.json \
    > docs/figures/stream_sweeps/table.md
fi
# The stream prompt-end event (stream_end_*): each family's published dense, KNorm and
# shipped default from before the event read the question (relabelled with the prefill knobs
# that still give it), then today's `nexus` on the same samples. One process each.
# Only the families whose requests end with their question: the single-question tasks feed
# it after the last event, and long generation's prompts are shorter than the budget.
STREAM_BEFORE="nexus:expected=0.5,knorm_prior=4,prefill_direct=mean,prefill_indirect=walk,prefill_sampler=pps"
for fam in multiturn chat; do
  name=stream_end_$fam
  want stream_end || want "$name" || continue
  where=()
  [ "$fam" = chat ] && where=(--where task=chat_multiturn)
  "$PY" -m nexus_vllm.cli records "docs/figures/stream_$fam/records.jsonl" --if-missing \
    "${where[@]}" \
    --exclude-method-prefix nexus:expected=0, --exclude-method-prefix expected \
    --exclude-method-prefix nexus:expected=0.5,knorm_prior=4, \
    --exclude-method-prefix nexus:knorm_prior --exclude-method-prefix oracle \
    --rename-method nexus:expected=0.5,knorm_prior=4 "$STREAM_BEFORE" \
    --out "$OUT/$name/records.jsonl"
  run "$name" &
done
wait
# The second real model: Gemma 3 270M, hybrid sliding-window layers.
want gemma3_report && run gemma3_report
# Head granularity on the long documents' report set, one process per task, each seeded
# with the published dense, KNorm, shipped-default and oracle records of its samples:
# the forward's own evidence per head, then KVzip's reconstruction score per head (its
# own script: the score stands in for expected attention in that process).
HEAD_SEEDS=(--exclude-method-prefix expected --exclude-method-prefix nexus:expected=0,
            --exclude-method-prefix nexus:expected=0.5,knorm_prior=4,sampler
            --exclude-method-prefix nexus:knorm_prior)
for name in stream_head_longdoc stream_head_profile_longdoc stream_head_learned_longdoc; do
  want "$name" || continue
  for task in niah_single_prose niah_multikey; do
    "$PY" -m nexus_vllm.cli records docs/figures/stream_longdoc/records.jsonl --if-missing \
      --where "task=$task" "${HEAD_SEEDS[@]}" --out "$OUT/${name}_$task/records.jsonl"
    run "$name" --tasks "$task" --out "$OUT/${name}_$task" &
  done
  wait
  merge_report "$name" niah_single_prose niah_multikey
done
for task in niah_single_prose niah_multikey; do
  want stream_head_reconstruction || continue
  "$PY" scripts/stream_reconstruction.py --head --tasks "$task" \
    --out "$OUT/stream_head_reconstruction_$task" &
done
wait
# Merged with the reconstruction's methods relabelled: there `expected` reads KVzip's score
# (its own script's process), not expected attention.
RECON="reconstruction, one threshold over (layer, head, token)"
RECON_PROFILE="reconstruction, head profile"
if want stream_head_reconstruction; then
  "$PY" -m nexus_vllm.cli records "$OUT"/stream_head_reconstruction_niah_single_prose/records.jsonl \
    "$OUT"/stream_head_reconstruction_niah_multikey/records.jsonl \
    --rename-method "expected:granularity=head" "$RECON" \
    --rename-method "expected:granularity=head,head_profile=smollm2-135m-instruct" "$RECON_PROFILE" \
    --rename-method "expected:granularity=head,head_group=16" \
    "reconstruction, one threshold over 16-token units" \
    --rename-method "nexus:granularity=head,expected=1,knorm_prior=0" \
    "reconstruction, pps over (layer, head, token)" \
    --out "$OUT/stream_head_reconstruction/records.jsonl"
  run stream_head_reconstruction --report-only
fi
# The paired comparisons the docs quote (compare.json beside each table).
HEAD_PROFILE=head_profile=smollm2-135m-instruct
if want stream_head_longdoc && [ -d docs/figures/stream_head_longdoc ]; then
  "$PY" -m nexus_vllm.cli compare "$OUT/stream_head_longdoc/records.jsonl" \
    --a "nexus:granularity=head,expected=0.5,knorm_prior=4" \
    --b "nexus:expected=0.5,knorm_prior=4" --b knorm \
    --json docs/figures/stream_head_longdoc/compare.json
fi
if want stream_head_profile_longdoc && [ -d docs/figures/stream_head_profile_longdoc ]; then
  "$PY" -m nexus_vllm.cli compare "$OUT/stream_head_profile_longdoc/records.jsonl" \
    "$OUT/stream_head_longdoc/records.jsonl" \
    --a "snapkv:granularity=head,prompt_window=512,$HEAD_PROFILE" \
    --b "snapkv:granularity=head,prompt_window=512" --b knorm \
    --b "nexus:expected=0.5,knorm_prior=4" \
    --json docs/figures/stream_head_profile_longdoc/compare.json
fi
if want stream_head_reconstruction && [ -d docs/figures/stream_head_reconstruction ]; then
  "$PY" -m nexus_vllm.cli compare "$OUT/stream_head_reconstruction/records.jsonl" \
    --a "$RECON" --b knorm --b "nexus:expected=0.5,knorm_prior=4" \
    --b "$RECON_PROFILE" --b "reconstruction, pps over (layer, head, token)" \
    --b "reconstruction, one threshold over 16-token units" \
    --json docs/figures/stream_head_reconstruction/compare.json
fi
# The stand-in on the other stream families, each seeded with its published report set's
# dense, oracle, KNorm and shipped-default records (identical keys, not rerun).
for fam in chat multiturn longgen; do
  name=stream_head_learned_$fam
  want "$name" || continue
  seed_family "$name" "$fam" dense oracle knorm "$STREAM_SHIPPED"
  run "$name" &
done
wait
for fam in chat multiturn longgen; do
  name=stream_head_learned_$fam
  if want "$name" && [ -d "docs/figures/$name" ]; then
    "$PY" -m nexus_vllm.cli compare "$OUT/$name/records.jsonl" \
      --a "reconstruction:granularity=head" --b "$STREAM_SHIPPED" --b knorm --b oracle \
      --json "docs/figures/$name/compare.json"
  fi
done
# The same in prompt_mode end, on the chat-shaped report set.
if want head_learned_chat_report; then
  "$PY" -m nexus_vllm.cli records docs/figures/chat_report/records.jsonl --if-missing \
    --where method=dense --out "$OUT/head_learned_chat_report.seed_dense.jsonl"
  "$PY" -m nexus_vllm.cli records docs/figures/chat_report/records.jsonl --if-missing \
    --where method=nexus --out "$OUT/head_learned_chat_report.seed_nexus.jsonl"
  [ -e "$OUT/head_learned_chat_report/records.jsonl" ] || "$PY" -m nexus_vllm.cli records \
    "$OUT"/head_learned_chat_report.seed_*.jsonl --out "$OUT/head_learned_chat_report/records.jsonl"
  run head_learned_chat_report
  if [ -d docs/figures/head_learned_chat_report ]; then
    "$PY" -m nexus_vllm.cli compare "$OUT/head_learned_chat_report/records.jsonl" \
      --a "reconstruction:granularity=head" --b nexus \
      --json docs/figures/head_learned_chat_report/compare.json
  fi
fi
if want stream_head_learned_longdoc && [ -d docs/figures/stream_head_learned_longdoc ]; then
  "$PY" -m nexus_vllm.cli compare "$OUT/stream_head_learned_longdoc/records.jsonl" \
    docs/figures/stream_head_reconstruction/records.jsonl \
    --a "reconstruction:granularity=head" --b "nexus:expected=0.5,knorm_prior=4" \
    --b knorm --b "$RECON" --b "reconstruction:granularity=head,head_group=16" \
    --json docs/figures/stream_head_learned_longdoc/compare.json
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
  for name in calibration headline ablation prefill knorm_prior paired dialogues dialogues_pps scoring_cost scoring_cost_report scoring_cost_dialogues kvpress sweep prompt_end_tuning prompt_modes prompt_modes_capped prompt_modes_multiturn prompt_modes_longgen chat_tuning completion_tuning chat_report completion_report stream_tuning_multiturn stream_tuning_longdoc stream_multiturn stream_longdoc stream_longgen stream_chat stream_sweep_longdoc stream_sweep_chat stream_sweep_multiturn stream_sweep_longgen stream_end_chat stream_end_multiturn gemma3_report stream_head_longdoc stream_head_profile_longdoc stream_head_reconstruction; do
    [ -d "$OUT/$name" ] || continue
    "$PY" -m nexus_vllm.cli eval --config "configs/eval/$name.yaml" --out "$OUT/$name" \
      --report-only --publish "docs/figures/$name"
  done
fi
