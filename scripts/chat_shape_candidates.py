"""The candidates for the prompt-end event on chat-shaped prompts, side by side on the
transformers path (:mod:`nexus_vllm.eval.candidates` defines and runs them).

    python scripts/chat_shape_candidates.py                     # 8 samples x 5 tasks
    python scripts/chat_shape_candidates.py --samples 2 --tasks facts --out /tmp/c
    python scripts/chat_shape_candidates.py --set second --samples 6 --threads 1 \
        --tasks niah_single_prose,niah_multikey,niah_multivalue --out runs/cand2_a &
    python scripts/chat_shape_candidates.py --set second --samples 6 --threads 1 \
        --tasks facts,chat_multiturn --out runs/cand2_b; wait
    python scripts/chat_shape_candidates.py --set second \
        --merge runs/cand2_{a,b}/candidates.json --out runs/cand2   # one table
    python scripts/chat_shape_candidates.py --set fourth --samples 6 --threads 1 \
        --tasks niah_multivalue,niah_multiquery,facts --out runs/cand4_a &
    python scripts/chat_shape_candidates.py --set fourth --samples 6 --threads 1 \
        --tasks niah_single_prose,niah_multikey,chat_multiturn --out runs/cand4_b; wait
    python scripts/chat_shape_candidates.py --set fourth --merge runs/cand4_{a,b}/candidates.json \
        --tasks niah_single_prose,niah_multikey,niah_multivalue,niah_multiquery,facts,chat_multiturn \
        --out runs/cand4
    python scripts/chat_shape_candidates.py --set oracle --data-seed 1 --samples 6 --threads 1 \
        --tasks niah_single_prose,niah_multikey,chat_multiturn --out runs/oracle_a &
    python scripts/chat_shape_candidates.py --set oracle --data-seed 1 --samples 6 --threads 1 \
        --tasks niah_multivalue,niah_multiquery --out runs/oracle_b; wait
    python scripts/chat_shape_candidates.py --set oracle --merge runs/oracle_{a,b}/candidates.json \
        --tasks niah_single_prose,niah_multikey,niah_multivalue,niah_multiquery,chat_multiturn \
        --out runs/oracle
    python scripts/chat_shape_candidates.py --set fifth --samples 6 --threads 1 \
        --tasks chat_multiturn --out runs/cand5_a &
    python scripts/chat_shape_candidates.py --set fifth --samples 6 --threads 1 \
        --tasks niah_single_prose,niah_multikey,niah_multivalue,niah_multiquery,facts \
        --out runs/cand5_b; wait
    python scripts/chat_shape_candidates.py --set fifth --merge runs/cand5_{b,a}/candidates.json \
        --tasks niah_single_prose,niah_multikey,niah_multivalue,niah_multiquery,facts,chat_multiturn \
        --out runs/cand5

Each prompt is prefilled once, uncompressed; every candidate of the set evicts a copy of
that state down to a 20% budget and decodes greedily with the shipped decode events
(:func:`nexus_vllm.eval.candidates.run_candidate`). The sets
(:data:`nexus_vllm.eval.candidates.SETS`):

* ``first``: which query rows score (the prompt's last 32, the question's own rows, the
  newest row only), how heads and layers combine (mean, maximum, each head nominating
  blocks in turn), carry 1, deferring the event into the first 8 to 16 answer tokens,
  graded events (twice the budget at the prompt's end, then the deferred event), key
  norms; 4 recent blocks forced;
* ``second``: each block's best row instead of the rows' mean, and 2 or 1 recent blocks;
* ``normalized``: the best row over the rows as softmax gives them, or renormalised after
  the maximum over heads and layers;
* ``fourth``: around the best share (2 recent blocks, carry 1): the rows it reads, no
  carry, a block's two best shares, the best share plus the rows' mean;
* ``oracle``: an upper bound, not a candidate: the blocks of every reference answer's
  sentence kept first, then the best share (run on the report set, ``--data-seed 1``);
* ``fifth``: weight carried back to the block before a found one, beside the oracle.

Prints a table (score per task, pooled, and the paired comparison of each candidate
against the set's reference) and writes it to ``--out`` as ``candidates.md`` and
``candidates.json`` (with ``ranks.jsonl`` for a set with an oracle: where the first
candidate ranks the answers' blocks). docs/algorithm.md ("The chat shape") quotes it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import torch

from nexus_vllm.eval.candidates import (
    SETS,
    answer_ranks,
    chat_prompts,
    dense_states,
    greedy,
    run_candidate,
)

DEFAULT_TASKS = "niah_single_prose,niah_multikey,niah_multivalue,facts,chat_multiturn"


def _table(scores: dict[str, dict[str, list[float]]], tasks: list[str], ref: str,
           header: str) -> str:
    """Per-task means, the pooled score with its bootstrap CI, and each candidate paired
    with ``ref`` sample by sample."""
    from nexus_vllm.eval.stats import bootstrap_ci, sign_test

    lines = [header, "", "| candidate | " + " | ".join(tasks) + " | pooled [95% CI] |",
             "|---|" + "---|" * (len(tasks) + 1)]
    pooled: dict[str, list[float]] = {}
    for name, by_task in scores.items():
        pooled[name] = [x for t in tasks for x in by_task.get(t, [])]
        mean, lo, hi = bootstrap_ci(pooled[name])
        cells = " | ".join(f"{sum(v) / len(v):.2f}" for v in (by_task[t] for t in tasks))
        lines.append(f"| {name} | {cells} | {mean:.2f} [{lo:.2f}, {hi:.2f}] |")
    lines += ["", f"Paired against `{ref}` (per sample; wins/losses/ties, sign test):", ""]
    for name, vals in pooled.items():
        if name == ref:
            continue
        diffs = [a - b for a, b in zip(pooled[ref], vals)]
        wins = sum(d > 0 for d in diffs)
        losses = sum(d < 0 for d in diffs)
        lines.append(f"- vs {name}: {wins} wins, {losses} losses, "
                     f"{len(diffs) - wins - losses} ties (p = {sign_test(wins, losses):.3f})")
    return "\n".join(lines)


def _set_name(data_seed: int) -> str:
    return {0: "tuning set", 1: "report set"}.get(data_seed, "sample set")


def _merge(paths: list[pathlib.Path]) -> tuple[dict[str, dict[str, list[float]]], dict[str, Any]]:
    """The scores of runs split by task (one process per core), as one run's."""
    scores: dict[str, dict[str, list[float]]] = {}
    first: dict[str, Any] = {}
    for path in paths:
        data = json.loads(path.read_text())
        first = first or data["args"]
        for name, by_task in data["scores"].items():
            scores.setdefault(name, {}).update(by_task)
    return scores, first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--tasks", default=DEFAULT_TASKS)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--data-seed", type=int, default=0, help="0: the tuning set")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", choices=sorted(SETS), default="first",
                    help="which set of candidates (docs/algorithm.md quotes each)")
    ap.add_argument("--merge", type=pathlib.Path, nargs="+", metavar="JSON",
                    help="run nothing: one table from the candidates.json of runs split by "
                         "task (--tasks gives the columns' order)")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/chat_candidates"))
    args = ap.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.merge:
        scores, run_args = _merge(args.merge)
        requests = [json.loads(line) for path in args.merge
                    if (path.parent / "ranks.jsonl").exists()
                    for line in (path.parent / "ranks.jsonl").read_text().splitlines()]
        tasks = [t for t in tasks if t in scores["dense"]]
        header = (f"Chat-shaped {_set_name(int(run_args['data_seed']))} (data_seed "
                  f"{run_args['data_seed']}, "
                  f"{run_args['samples']} samples per task, {run_args['context']}-token "
                  f"prompts, 20% budget), SmolLM2-135M, transformers path; runs "
                  f"{', '.join(str(p) for p in args.merge)} merged.")
        report = _table(scores, tasks, SETS[run_args.get("set", "first")].reference, header)
    else:
        scores, seconds, requests = _run(args, tasks)
        header = (f"Chat-shaped {_set_name(args.data_seed)} (data_seed {args.data_seed}, "
                  f"{args.samples} "
                  f"samples per task, {args.context}-token prompts, 20% budget), "
                  f"SmolLM2-135M, transformers path; {seconds:.0f} s.")
        report = _table(scores, tasks, SETS[args.set].reference, header)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "candidates.md").write_text(report + "\n")
    (args.out / "candidates.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "scores": scores}, indent=1))
    if requests:  # one line per request: where the answers' blocks ranked, the scores
        (args.out / "ranks.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in requests))
    return 0


def _run(args: argparse.Namespace, tasks: list[str]
         ) -> tuple[dict[str, dict[str, list[float]]], float, list[dict[str, Any]]]:
    """Every candidate of ``args.set`` on every sample: scores by candidate and task, and
    for a set with an oracle, per request where the first candidate ranks the answers'
    blocks (:func:`~nexus_vllm.eval.candidates.answer_ranks`) beside every candidate's score."""
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    from nexus_vllm.hf.generate import eos_ids
    from nexus_vllm.models import load_causal_lm

    _, tokenizer, model = load_causal_lm(None)
    eos = eos_ids(model, tokenizer)
    candidates = SETS[args.set].candidates
    scores: dict[str, dict[str, list[float]]] = {c.name: {} for c in candidates}
    scores["dense"] = {}
    defers = {0} | {c.defer for c in candidates}
    with_ranks = any(c.oracle for c in candidates)
    requests: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for task, index in tqdm([(t, i) for t in tasks for i in range(args.samples)],
                                desc="candidates"):
            # A conversation's turns count as one sample: the mean of its turns.
            per: dict[str, list[float]] = {}
            for turn, p in enumerate(chat_prompts(task, index, args.data_seed, tokenizer,
                                                   args.context)):
                dense_states(model, p, defers, eos)
                base, logits, _ = p.dense_states[0]
                dense = greedy(base.clone(), logits, p.max_new_tokens, eos, False)
                per.setdefault("dense", []).append(
                    p.score(str(tokenizer.decode(dense, skip_special_tokens=True))))
                for c in candidates:
                    text = run_candidate(c, tokenizer, p, eos)
                    per.setdefault(c.name, []).append(p.score(text))
                if with_ranks:
                    requests.append({"task": task, "index": index, "turn": turn,
                                     **answer_ranks(candidates[0], p),
                                     "scores": {k: v[-1] for k, v in per.items()}})
            for name, vals in per.items():
                scores[name].setdefault(task, []).append(sum(vals) / len(vals))
    return scores, time.perf_counter() - t0, requests


if __name__ == "__main__":
    sys.exit(main())
