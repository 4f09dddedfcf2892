"""What makes the prompt-end event work on chat-shaped prompts: every candidate of issue 27
side by side, on the tuning set, on the transformers path.

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

A chat-shaped prompt (``eval.tasks``, protocol ``chat``: instruction, document and
question in one user message, the chat template up to the assistant's header, no answer
prefix) is prefilled once, uncompressed; every candidate then runs its eviction on a
copy of that state, down to a 20% budget (of the tokens seen when it fires), and decodes
greedily with the shipped decode events. Candidates (block scores are top-K'd over the
blocks outside the forced set, as the prompt-end event does):

* ``window rows``: which query rows score: the prompt's last 32 (shipped), the question's
  own rows (without the template's markup), or the newest row only (TOVA);
* ``heads``: the rows' mass averaged over heads and layers (shipped), its maximum (the
  shipped ``head_reduce: max``), or each head nominating its best blocks in turn (the
  ``union`` of TensorRT-LLM's KV-cache compression);
* ``carry``: each block's weight raised to its predecessor's (the shipped ``carry: 1``);
* ``defer d``: the event waits for the model's first ``d`` answer tokens and scores their
  rows (the prompt is held ``d`` decode steps longer); ``graded``: the prompt-end event
  keeps twice the budget (scored as the candidate scores), then the deferred one brings it
  down to the budget;
* ``knorm``: key norms, which need no query at all.

``--set second`` (the second round): each block's best row instead of the rows' mean,
and fewer forced recent blocks; ``--set normalized``: that best row over the rows as
softmax gives them (the third round's event, shipped), or renormalised after the maximum
over heads and layers (the second round's); ``--set fourth``: around the third round's
event, the rows it reads, carry, and two ways between the best row and the mean;
``--set oracle``: the ceiling, an oracle that keeps every reference answer's sentence
first (run on the report set, ``--data-seed 1``: an upper bound, not a candidate);
``--set fifth``: weight carried back to the block before a found one, beside the oracle.

Prints a table (score per task, pooled, and the paired comparison of each candidate
against the first one that wins) and writes it to ``--out`` as ``candidates.md`` and
``candidates.json``. docs/algorithm.md ("The chat shape") quotes it.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nexus_vllm.core import EvictionConfig

DEFAULT_TASKS = "niah_single_prose,niah_multikey,niah_multivalue,facts,chat_multiturn"


@dataclass(frozen=True)
class Candidate:
    """One way of running the decisive event."""

    name: str
    rows: str = "last"  # "last" (the newest `window`), "question", "answer"
    window: int = 32
    heads: str = "mean"  # "mean", "max", "union"
    carry: int = 0
    defer: int = 0  # answer tokens decoded before the event
    graded: float = 0.0  # > 0: a prompt-end event to graded x budget first
    knorm: bool = False
    rows_reduce: str = "mean"  # "mean" (of each row's normalized mass), "max", or
    # "max of normalized" (each row renormalised after the maximum over heads and layers),
    # "top 2" (the sum of a block's two best shares), "max + mean" (the best share's and
    # the rows' mean's scores, each normalised to sum to 1, added)
    recent: int = 4  # forced recent blocks (4 until the second round)
    # An upper bound, not a policy: the blocks holding each reference answer's sentence
    # (the answer and the ORACLE_LEAD tokens before it, where its key is) are kept first,
    # then the candidate's weights fill the budget.
    oracle: bool = False
    # > 0: each block also raised to this share of the next block's weight (the sentence
    # that a found block ends may begin in the block before it)
    carry_back: float = 0.0


CANDIDATES = [
    Candidate("shipped end (last 32 rows, mean)"),
    Candidate("question rows, mean", rows="question"),
    Candidate("newest row (TOVA), mean", window=1),
    Candidate("union of heads, question rows", rows="question", heads="union"),
    Candidate("max over heads", heads="max"),
    Candidate("carry 1, mean", carry=1),
    Candidate("max over heads + carry 1", heads="max", carry=1),
    Candidate("max + carry 1, question rows", rows="question", heads="max", carry=1),
    Candidate("max + carry 1, newest row", window=1, heads="max", carry=1),
    Candidate("max + carry 1, 64 rows", window=64, heads="max", carry=1),
    Candidate("defer 8, answer rows, mean", rows="answer", defer=8),
    Candidate("defer 8, answer rows, max + carry 1", rows="answer", defer=8, heads="max",
              carry=1),
    Candidate("defer 16, answer rows, mean", rows="answer", defer=16),
    Candidate("graded 2x, defer 8, mean", rows="answer", defer=8, graded=2.0),
    Candidate("defer 12, answer rows, max + carry 1", rows="answer", defer=12, heads="max",
              carry=1),
    Candidate("graded 2x, defer 16 (the first decode event), max + carry 1", rows="answer",
              defer=16, graded=2.0, heads="max", carry=1),
    Candidate("key norms (knorm)", knorm=True),
]
# The second round: where the needle's block ranks under the shipped evidence showed two
# things: the forced recent blocks take most of a 20% budget of a short prompt (5 of 6
# blocks at a chat's first turn), and a block that one row attends to strongly is
# diluted by the mean over the window's rows.
SECOND_ROUND = [
    Candidate("max over heads + carry 1", heads="max", carry=1),
    Candidate("max over heads and rows + carry 1", heads="max", rows_reduce="max", carry=1),
    Candidate("max + carry 1, 2 recent blocks", heads="max", carry=1, recent=2),
    Candidate("max + carry 1, 1 recent block", heads="max", carry=1, recent=1),
    Candidate("max over heads and rows + carry 1, 2 recent blocks", heads="max",
              rows_reduce="max", carry=1, recent=2),
    Candidate("max over heads and rows + carry 1, 1 recent block", heads="max",
              rows_reduce="max", carry=1, recent=1),
    Candidate("max over heads and rows + carry 1, question rows", rows="question",
              heads="max", rows_reduce="max", carry=1),
]
# The shipped event renormalises each row after the maximum over heads and layers (as
# head_reduce max does) before taking each block's best row; the script's "max over rows"
# takes it over the rows as softmax gives them.
NORMALIZED = [
    Candidate("max over heads and rows + carry 1, 2 recent blocks", heads="max",
              rows_reduce="max", carry=1, recent=2),
    Candidate("max over heads, rows renormalised, max over rows + carry 1, 2 recent blocks",
              heads="max", rows_reduce="max of normalized", carry=1, recent=2),
]
# The fourth round, around the third round's event (each block's best share as softmax
# gave it): what the best share still loses on several values and queries asked at once.
_BEST = {"heads": "max", "rows_reduce": "max", "carry": 1, "recent": 2}
FOURTH_ROUND = [
    Candidate("best share (shipped)", **_BEST),
    Candidate("best share, the question's rows", rows="question", **_BEST),
    Candidate("best share, 16 rows", window=16, **_BEST),
    Candidate("best share, 64 rows", window=64, **_BEST),
    Candidate("best share, no carry", **{**_BEST, "carry": 0}),
    Candidate("two best shares", **{**_BEST, "rows_reduce": "top 2"}),
    Candidate("best share + rows' mean", **{**_BEST, "rows_reduce": "max + mean"}),
]
# The ceiling: how much of dense's score any choice of blocks keeps at a 20% budget where
# the choice knew where the answers are (needle tasks, whose references are in the prompt).
ORACLE = [
    Candidate("best share (shipped)", **_BEST),
    Candidate("oracle: the answers' sentences first, then the best share", oracle=True,
              **_BEST),
]
# The fifth round: on the report set's six-turn chats the oracle above kept 0.69 where
# the shipped event kept 0.50; in six of the nine turns it lost, the block the question
# found made the budget and its neighbour, the rest of the fact's sentence, did not (in
# four of them the block before it, which carry forward never raises).
FIFTH_ROUND = [
    Candidate("best share (shipped)", **_BEST),
    Candidate("best share, carry back 1", carry_back=1.0, **_BEST),
    Candidate("best share, carry back at half weight", carry_back=0.5, **_BEST),
    Candidate("oracle: the answers' sentences first, then the best share", oracle=True,
              **_BEST),
]
ORACLE_LEAD = 24
_BLOCK = EvictionConfig.block_size  # the default, which every candidate's config keeps
SETS = {"first": CANDIDATES, "second": SECOND_ROUND, "normalized": NORMALIZED,
        "fourth": FOURTH_ROUND, "oracle": ORACLE, "fifth": FIFTH_ROUND}
# The candidate the others of a set are paired against: what the round shipped (for
# "normalized", the second round's winner as the script measured it).
REFERENCE = {"first": "max over heads + carry 1",
           "second": "max over heads and rows + carry 1, 2 recent blocks",
           "normalized": "max over heads and rows + carry 1, 2 recent blocks",
           "fourth": "best share (shipped)", "oracle": "best share (shipped)",
           "fifth": "best share (shipped)"}
RATIO = 0.2
# Captured query rows: the widest window, or the question plus the deferred answer.
_CAPTURE_ROWS = 160


@dataclass
class _Prompt:
    ids: torch.Tensor
    question: tuple[int, int]  # token range of the question's own words
    score: Callable[[str], float]
    max_new_tokens: int
    answer_blocks: tuple[int, ...] = ()  # blocks holding a reference answer's sentence
    dense_states: dict[int, tuple[Any, torch.Tensor, list[int]]] = field(default_factory=dict)


def _prompts(task: str, index: int, seed: int, tokenizer: Any, context: int) -> list[_Prompt]:
    """The chat-shaped requests of a sample: one, or one per turn of a conversation."""
    from nexus_vllm.eval.dialogues import DIALOGUE_TASKS, make_dialogue
    from nexus_vllm.eval.tasks import make_sample

    if task in DIALOGUE_TASKS:
        d = make_dialogue(task, seed=seed, index=index, target_tokens=context,
                          tokenizer=tokenizer)
        return [_prompt_of(tokenizer.decode(list(d.ids[:t.probe.prompt_end])),
                           tokenizer, functools.partial(d.score, i), t.probe.max_new_tokens,
                           t.answers)
                for i, t in enumerate(d.turns)]
    s = make_sample(task, seed=seed, index=index, target_tokens=context, tokenizer=tokenizer,
                    protocol="chat")
    return [_prompt_of(s.preamble + s.context + s.question, tokenizer, s.score,
                       s.max_new_tokens, s.answers)]


def _prompt_of(text: str, tokenizer: Any, score: Callable[[str], float],
               max_new_tokens: int, answers: tuple[str, ...] = ()) -> _Prompt:
    enc = tokenizer(text, return_offsets_mapping=True)
    q_start_char = text.rindex("Question: ") + len("Question: ")
    q_end_char = text.rindex("?") + 1
    starts = [a for a, _ in enc["offset_mapping"]]
    q0 = sum(1 for a in starts if a < q_start_char)
    q1 = sum(1 for a in starts if a < q_end_char)
    # Every mention of an answer before the question (a needle, or an earlier turn's reply).
    blocks: set[int] = set()
    for answer in answers:
        for m in re.finditer(re.escape(answer), text[:q_start_char]):
            t0 = sum(1 for a in starts if a < m.start())
            t1 = sum(1 for a in starts if a < m.end())
            blocks.update(range(max(0, t0 - ORACLE_LEAD) // _BLOCK, (t1 - 1) // _BLOCK + 1))
    return _Prompt(torch.tensor(enc["input_ids"]), (q0, q1), score, max_new_tokens,
                   tuple(sorted(blocks)))


def _per_head_mass(session: Any, rows: list[int]) -> torch.Tensor:
    """``[layers x heads, len(rows), N]``: each scored layer's and query head's block mass
    of the given absolute query positions."""
    from nexus_vllm.core import num_blocks_for

    bs = session.config.block_size if session.config is not None else 32
    out = []
    rel = torch.tensor([r - session.seen for r in rows])
    qpos = torch.tensor(rows)
    for li in range(2, session.num_layers):
        q = session._queries[li][:, rel]  # [Hq, W, D]
        k = session.cache.layers[li].keys[0]  # [Hkv, T, D]
        hq, _, d = q.shape
        kk = k.repeat_interleave(hq // k.shape[0], 0).float()
        logits = torch.matmul(q.float(), kk.transpose(1, 2)) / math.sqrt(d)
        future = session.positions[None, :] > qpos[:, None]
        probs = torch.softmax(logits.masked_fill(future[None], float("-inf")), -1)
        t = probs.shape[-1]
        n = num_blocks_for(t, bs)
        probs = torch.nn.functional.pad(probs, (0, n * bs - t))
        out.append(probs.view(hq, len(rows), n, bs).sum(-1))
    return torch.cat(out)


def _weights(c: Candidate, session: Any, p: _Prompt) -> torch.Tensor:
    from nexus_vllm.core import carry_forward, normalize_rows

    if c.knorm:
        return -session.key_norms()
    seen = session.seen
    if c.rows == "question":
        rows = list(range(*p.question))
    elif c.rows == "answer":
        rows = list(range(len(p.ids), seen))
    else:
        rows = list(range(seen - c.window, seen))
    mass = _per_head_mass(session, rows)  # [H, W, N]
    if c.heads == "union":
        per = mass.mean(1)  # [H, N]: each head's view of the blocks
        rank = torch.argsort(torch.argsort(-per, dim=1), dim=1).float()
        w = -rank.min(0).values + 1e-3 * per.mean(0) / per.mean(0).max()
    elif c.heads == "max" and c.rows_reduce == "max":
        w = mass.amax(0).amax(0)
    elif c.heads == "max" and c.rows_reduce == "top 2":
        w = mass.amax(0).topk(min(2, mass.shape[1]), dim=0).values.sum(0)
    elif c.heads == "max" and c.rows_reduce == "max + mean":
        best = mass.amax(0).amax(0)
        mean = normalize_rows(mass.amax(0)).mean(0)
        w = best / best.sum().clamp_min(1e-12) + mean / mean.sum().clamp_min(1e-12)
    elif c.heads == "max" and c.rows_reduce == "max of normalized":
        w = normalize_rows(mass.amax(0)).amax(0)
    elif c.heads == "max":
        w = normalize_rows(mass.amax(0)).mean(0)
    else:
        w = mass.mean(0).mean(0)
    w = w.double()
    back = torch.cat([w[1:], w[-1:]]) * c.carry_back
    w = torch.maximum(carry_forward(w, c.carry), back)
    if c.oracle and p.answer_blocks:
        bonus = torch.zeros_like(w)
        bonus[[b for b in p.answer_blocks if b < w.numel()]] = 1.0
        w = w / w.sum().clamp_min(1e-12) + bonus  # the answers' blocks outrank every other
    return w


def _evict_to(session: Any, weights: torch.Tensor, budget: int) -> None:
    """Keep the forced set and the top-``budget`` blocks by ``weights`` (as a top-K
    policy's select does), dropping the rest from every layer."""
    from nexus_vllm.core.policies import forced_blocks
    from nexus_vllm.core.sampling import top_k_indices

    cfg = session.config
    n = weights.numel()
    if n <= budget:
        return
    forced = forced_blocks(n, cfg.sink_blocks, cfg.recent_blocks)
    candidate = torch.ones(n, dtype=torch.bool)
    candidate[forced] = False
    idx = torch.nonzero(candidate).flatten()
    keep = torch.sort(torch.cat([forced, idx[top_k_indices(weights[idx],
                                                            budget - forced.numel())]])).values
    b = cfg.block_size
    tok = (keep.view(-1, 1) * b + torch.arange(b)).view(-1)
    tok = tok[tok < session.cache_len]
    for layer in session.cache.layers:
        layer.keys = layer.keys.index_select(-2, tok)
        layer.values = layer.values.index_select(-2, tok)
    session.positions = session.positions[tok]


def _greedy(session: Any, logits: torch.Tensor, n: int, eos: set[int],
            decode_events: bool) -> list[int]:
    out: list[int] = []
    for i in range(n):
        t = int(torch.argmax(logits))
        out.append(t)
        if t in eos or i == n - 1:
            break
        logits = session.forward(torch.tensor([t]))[-1]
        if decode_events:
            session.decode_step_done()
    return out


def _dense_states(model: Any, p: _Prompt, defers: set[int], eos: set[int]) -> None:
    """The uncompressed state after the prompt and after each deferred answer length."""
    from nexus_vllm.hf.streaming import StreamingSession

    session = StreamingSession(model, None, prompt_tokens=len(p.ids),
                               capture_rows=_CAPTURE_ROWS)
    logits = None
    for start in range(0, len(p.ids), 512):
        logits = session.forward(p.ids[start:start + 512])
    assert logits is not None
    last, generated = logits[-1], []
    for d in range(max(defers) + 1):
        if d in defers:
            p.dense_states[d] = (session.clone(), last, list(generated))
        tok = int(torch.argmax(last))
        generated.append(tok)
        if tok in eos:
            break
        last = session.forward(torch.tensor([tok]))[-1]


def _config(c: Candidate) -> EvictionConfig:
    """The config a candidate evicts under: a 20% budget, prompt mode end."""
    return EvictionConfig(method="nexus", keep_ratio=RATIO, prompt_mode="end",
                          recent_blocks=c.recent)


def run_candidate(c: Candidate, model: Any, tokenizer: Any, p: _Prompt,
                  eos: set[int]) -> str:
    from nexus_vllm.core import EvictionTrigger, cdiv

    cfg = _config(c)
    if c.defer not in p.dense_states:  # the answer ended before d tokens: nothing to defer
        return str(tokenizer.decode(p.dense_states[0][2] or [], skip_special_tokens=True))
    base, logits, generated = p.dense_states[0 if c.graded else c.defer]
    session = base.clone()
    session.config = cfg
    if c.graded:
        budget = math.ceil(c.graded * RATIO * cdiv(session.seen, cfg.block_size))
        first = Candidate("graded", heads=c.heads, carry=c.carry)  # the prompt's last rows
        _evict_to(session, _weights(first, session, p), budget)
        generated = _greedy(session, logits, c.defer + 1, eos, decode_events=False)
        if len(generated) <= c.defer:  # ended before the deferred event
            return str(tokenizer.decode(generated, skip_special_tokens=True))
        generated, following = generated[:c.defer], generated[c.defer]
        logits = torch.zeros_like(logits)
        logits[following] = 1.0  # the token it just predicted, fed next as usual
    _evict_to(session, _weights(c, session, p), cfg.budget_blocks(session.seen))
    session.trigger = EvictionTrigger(cfg, len(p.ids))
    session.generator = cfg.generator(0)
    rest = _greedy(session, logits, p.max_new_tokens - len(generated), eos,
                   decode_events=True)
    return str(tokenizer.decode(generated + rest, skip_special_tokens=True))


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
                    help="which round of candidates (docs/algorithm.md quotes both)")
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
        report = _table(scores, tasks, REFERENCE[run_args.get("set", "first")], header)
    else:
        scores, seconds, requests = _run(args, tasks)
        header = (f"Chat-shaped {_set_name(args.data_seed)} (data_seed {args.data_seed}, "
                  f"{args.samples} "
                  f"samples per task, {args.context}-token prompts, 20% budget), "
                  f"SmolLM2-135M, transformers path; {seconds:.0f} s.")
        report = _table(scores, tasks, REFERENCE[args.set], header)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "candidates.md").write_text(report + "\n")
    (args.out / "candidates.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "scores": scores}, indent=1))
    if requests:  # one line per request: where the answers' blocks ranked, the scores
        (args.out / "ranks.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in requests))
    return 0


def _answer_ranks(c: Candidate, p: _Prompt) -> dict[str, Any]:
    """Where ``c`` ranks the oracle's blocks at the prompt-end event: each answer block's
    0-based rank among the blocks outside the forced set (None: forced), and how many of
    those the budget keeps (``free``)."""
    from nexus_vllm.core.policies import forced_blocks

    session = p.dense_states[0][0].clone()
    session.config = cfg = _config(c)
    w = _weights(c, session, p)
    forced = set(forced_blocks(w.numel(), cfg.sink_blocks, cfg.recent_blocks).tolist())
    order = [b for b in torch.argsort(-w, stable=True).tolist() if b not in forced]
    budget = cfg.budget_blocks(session.seen)
    return {"blocks": w.numel(), "budget": budget, "free": max(0, budget - len(forced)),
            "answer_blocks": list(p.answer_blocks),
            "ranks": [None if b in forced else order.index(b) for b in p.answer_blocks]}


def _run(args: argparse.Namespace, tasks: list[str]
         ) -> tuple[dict[str, dict[str, list[float]]], float, list[dict[str, Any]]]:
    """Every candidate of ``args.set`` on every sample: scores by candidate and task, and
    for a set with an oracle, per request where the first candidate ranks the answers'
    blocks (:func:`_answer_ranks`) beside every candidate's score."""
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    from nexus_vllm.hf.generate import eos_ids
    from nexus_vllm.models import load_causal_lm

    _, tokenizer, model = load_causal_lm(None)
    eos = eos_ids(model, tokenizer)
    candidates = SETS[args.set]
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
            for turn, p in enumerate(_prompts(task, index, args.data_seed, tokenizer,
                                              args.context)):
                _dense_states(model, p, defers, eos)
                base, logits, _ = p.dense_states[0]
                dense = _greedy(base.clone(), logits, p.max_new_tokens, eos, False)
                per.setdefault("dense", []).append(
                    p.score(str(tokenizer.decode(dense, skip_special_tokens=True))))
                for c in candidates:
                    text = run_candidate(c, model, tokenizer, p, eos)
                    per.setdefault(c.name, []).append(p.score(text))
                if with_ranks:
                    requests.append({"task": task, "index": index, "turn": turn,
                                     **_answer_ranks(candidates[0], p),
                                     "scores": {k: v[-1] for k, v in per.items()}})
            for name, vals in per.items():
                scores[name].setdefault(task, []).append(sum(vals) / len(vals))
    return scores, time.perf_counter() - t0, requests


if __name__ == "__main__":
    sys.exit(main())
