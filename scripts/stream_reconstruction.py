"""Reconstruction evidence read in ``stream`` (KVzip's score, chunk by chunk), measured on
the transformers path against the streaming tuning set's long documents.

    .venv/bin/python scripts/stream_reconstruction.py
        [--reduce max:max,max:mean,mean:mean,vote:sum] [--whole max:max]
        [--out runs/stream_tuning_reconstruction]
    .venv/bin/python scripts/stream_reconstruction.py --saturation
    .venv/bin/python scripts/stream_reconstruction.py --head [--tasks TASK] [--out DIR]
        [other `nexus-vllm eval` flags, e.g. --methods, --samples]

About 25 minutes per reduction on one core (36 evaluations of ~2k-token documents, each
with its reconstruction pass). ``--head`` reads the score per (layer, KV head, token) at
head granularity instead (``configs/eval/stream_head_reconstruction.yaml``, the report
set's long documents; about 40 minutes per task on one core).

KVzip (kvpress's ``KVzipPress``) scores each cached pair by the attention the model pays
it while reconstructing the context: "Repeat the previous context exactly." and the chat
template's assistant turn, then the context again, chunk by chunk; each reconstruction
query's softmax runs over the first 4 tokens, the chunk and the reconstruction so far, and
a pair's score is its largest weight. On the report set's 40 long documents KVzip keeps
every answer dense keeps, with the whole prompt in memory (docs/results.md). This script
asks whether the same score, read the way ``stream`` can read it, does as well: at each
prompt event the tokens fed since the last one (all still cached) are reconstructed after
the cache, their scores kept per token and layer, and the reconstruction's cache entries
dropped again. A token's score per KV head is its largest weight over the head's query
group and the reconstruction's rows; a block's is its tokens' largest, combined over heads
and then layers by ``--reduce HEADS:LAYERS`` (``max`` or ``mean`` each: KVzip keeps pairs
per head, a block is kept for every head at once), or ``vote:sum``: a block counts its
(layer, head, token) scores above one threshold over all of them, KVzip's rule for which
pairs stay. It costs a second forward over every prompt token.

The score stands in for the ``expected_attention`` evidence (``StreamingSession.gather`` is
patched in this process only), so in ``configs/eval/stream_tuning_reconstruction.yaml``
``expected`` is top-K on it and ``nexus:expected=1,knorm_prior=...`` the walk and pps on
it, with and without the key-norm prior. Dense, KNorm and the shipped default are the
published records of ``stream_tuning_longdoc`` (the same keys, not recomputed). A last run
(``--whole``) reads the score once over the whole context, in one 2048-token chunk
(``configs/eval/stream_tuning_reconstruction_whole.yaml``), with KNorm at the same event:
KVzip's protocol at the granularity of paged blocks. Prints each
method's mean score, answer log-likelihood change and KL, and its paired wins and losses
against the shipped default (``OUT/summary.txt``); the records, relabelled, go to
``OUT/records.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nexus_vllm import cli
from nexus_vllm.eval.records import Record, record_key
from nexus_vllm.hf import streaming

CONFIG = "configs/eval/stream_tuning_reconstruction.yaml"
HEAD_CONFIG = "configs/eval/stream_head_reconstruction.yaml"
HEAD_SEED_RECORDS = "docs/figures/stream_longdoc/records.jsonl"
HEAD_SEEDED = ("dense", "oracle", "knorm", "nexus:expected=0.5,knorm_prior=4")
WHOLE_CONFIG = "configs/eval/stream_tuning_reconstruction_whole.yaml"
SEED_RECORDS = "docs/figures/stream_tuning_longdoc/records.jsonl"
SEEDED = ("dense", "knorm", "nexus:expected=0.5,knorm_prior=4")
SHIPPED = "nexus:expected=0.5,knorm_prior=4"
SINK_TOKENS = 4  # kvpress's n_sink
VOTE_QUANTILE = 0.8  # KVzip keeps a fifth of the pairs at the budget measured here
REPEAT = "\n\nRepeat the previous context exactly."
LABELS = {"expected": "reconstruction, top-K",
          "nexus:expected=1,knorm_prior=0": "reconstruction, walk + pps",
          "nexus:expected=1,knorm_prior=4": "reconstruction x key-norm prior, walk + pps"}

_head_reduce, _layer_reduce = "max", "max"
_repeat_ids: dict[str, torch.Tensor] = {}


def repeat_ids(model: Any) -> torch.Tensor:
    """The reconstruction prompt's ids: the instruction, then the chat template's end of the
    user turn and start of the assistant's (kvpress's construction)."""
    from transformers import AutoTokenizer

    name = model.config.name_or_path
    if name not in _repeat_ids:
        tok = AutoTokenizer.from_pretrained(name)
        dummy = "dummy context"
        sep = "\n" + "#" * len(dummy)
        text = tok.apply_chat_template([{"role": "user", "content": dummy + sep}],
                                       add_generation_prompt=True, tokenize=False)
        suffix = text.split(sep)[1]
        ids = (tok.encode(REPEAT, add_special_tokens=False)
               + tok.encode(suffix, add_special_tokens=False))
        _repeat_ids[name] = torch.tensor(ids, dtype=torch.long)
    return _repeat_ids[name]


@torch.no_grad()
def reconstruct(session: Any) -> None:
    """Score the cached tokens fed since the last call (the cache's tail) by the attention
    their reconstruction pays them; the reconstruction leaves nothing in the cache."""
    tail = (session.positions >= session._recon_scored_to).nonzero().view(-1)
    if tail.numel() == 0:
        return
    first, total = int(tail[0]), session.cache_len
    chunk = session._recon_ids[session.positions[first:]]
    rep = torch.cat([repeat_ids(session.model), chunk])
    r = int(rep.numel())
    # Head granularity scores every full-attention layer, and the reconstruction attends
    # only to what each head still holds.
    heads = session.head_live is not None
    layers = session.full_attention_layers if heads else session._scored_layers()
    queries: dict[int, torch.Tensor] = {}

    def capture(layer: int, query: torch.Tensor) -> torch.Tensor | None:
        if layer in layers:
            queries[layer] = query[0].detach()  # [Hq, R, D], post-RoPE
        return session._heads.live_of(layer) if heads else None

    pos = torch.arange(session.seen, session.seen + r).unsqueeze(0)
    session.model(input_ids=rep.view(1, -1), position_ids=pos,
                  past_key_values=session.cache, use_cache=True, logits_to_keep=1,
                  nexus_capture=capture)
    sink = min(SINK_TOKENS, first)
    causal = torch.full((r, r), float("-inf")).triu(1)
    scores = dict(session._recon_scores)  # a clone shares the dict: copy on write
    need = int(session.positions[total - 1]) + 1
    for li in layers:
        q = queries[li]
        keys = session.cache.layers[li].keys[0]  # [Hkv, total + R, D]
        hkv = int(keys.shape[0])
        k = torch.cat([keys[:, :sink], keys[:, first:total], keys[:, total:]], dim=1)
        attn = session.model.model.layers[li].self_attn
        scale = getattr(attn, "scaling", q.shape[-1] ** -0.5)
        logits = torch.einsum("hgrd,hkd->hgrk", q.view(hkv, -1, r, q.shape[-1]).float(),
                              k.float()) * scale
        logits[..., -r:] += causal
        probs = torch.softmax(logits, dim=-1)  # the chunk's tokens are live in every head
        per_head = probs[..., sink:sink + total - first].amax(dim=(1, 2))  # [Hkv, tokens]
        store = _grown(scores.get(li, torch.zeros(hkv, 0)), need).clone()
        store[:, session.positions[first:total]] = per_head
        scores[li] = store
    session._recon_scores = scores
    session.cache.crop(-r)  # the reconstruction's r entries
    session._recon_scored_to = need


def _grown(store: torch.Tensor, need: int) -> torch.Tensor:
    """``store`` ``[Hkv, positions]`` padded with NaN (not scored) to ``need`` positions."""
    if store.shape[1] >= need:
        return store
    return torch.cat([store, store.new_full((store.shape[0], need - store.shape[1]),
                                            float("nan"))], dim=1)


def _by_block(tok: torch.Tensor, b: int) -> torch.Tensor:
    """``[..., T]`` -> ``[..., ceil(T / b), b]``, zero-padded."""
    n = -(-tok.shape[-1] // b)
    pad = tok.new_zeros((*tok.shape[:-1], n * b - tok.shape[-1]))
    return torch.cat([tok, pad], dim=-1).view(*tok.shape[:-1], n, b)


def block_scores(session: Any) -> torch.Tensor:
    """Each cached block's score (a distribution over the blocks); a token never scored
    (fed at decode) counts as 1, the largest a weight can be. ``vote``: the block's count
    of (layer, head, token) scores in the top ``1 - VOTE_QUANTILE`` of all the live blocks'
    (KVzip's one threshold over every head and layer), ties broken by the mean score."""
    b = session.config.block_size
    need = int(session.positions[-1]) + 1
    toks = []
    for store in session._recon_scores.values():
        tok = _grown(store, need)[:, session.positions]  # [Hkv, T]
        toks.append(torch.where(torch.isnan(tok), torch.ones_like(tok), tok))
    if _head_reduce == "vote":
        every = torch.stack(toks)  # [L, Hkv, T]
        threshold = torch.quantile(every.flatten(), VOTE_QUANTILE)
        votes = _by_block((every >= threshold).float(), b).sum(dim=(0, 1, 3))
        out = votes + 1e-3 * _by_block(every, b).mean(dim=(0, 1, 3)) / every.max()
    else:
        per_layer = [_by_block(t.amax(dim=0) if _head_reduce == "max" else t.mean(dim=0), b)
                     .amax(dim=-1) for t in toks]
        stacked = torch.stack(per_layer)
        out = stacked.amax(dim=0) if _layer_reduce == "max" else stacked.mean(dim=0)
    return (out / out.sum()).double()


def head_scores(session: Any) -> torch.Tensor:
    """Every live (full layer, KV head, token) entry's reconstruction score ``[L, Hkv, T]``
    (head granularity); a token never scored (fed at decode) counts as 1."""
    need = int(session.positions[-1]) + 1
    toks = [_grown(session._recon_scores[li], need)[:, session.positions]
            for li in session.full_attention_layers]
    every = torch.stack(toks)
    return torch.where(torch.isnan(every), torch.ones_like(every), every)


def install() -> Callable[[], None]:
    """Patch this process's StreamingSession: remember every fed id, and replace the
    expected_attention evidence with the reconstruction score (reconstructing the new
    tokens first at a prompt event). Returns the function that undoes the patch."""
    session_cls = streaming.StreamingSession
    forward, gather, event = session_cls.forward, session_cls.gather, session_cls._event
    head_evidence = session_cls.head_evidence

    def patched_forward(self: Any, input_ids: torch.Tensor, *, logits_to_keep: int = 1
                        ) -> torch.Tensor:
        if not hasattr(self, "_recon_ids"):
            self._recon_ids = torch.empty(0, dtype=torch.long)
            self._recon_scored_to = 0
            self._recon_scores = {}
        self._recon_ids = torch.cat([self._recon_ids, input_ids.reshape(-1).cpu()])
        return forward(self, input_ids, logits_to_keep=logits_to_keep)

    def patched_gather(self: Any, kinds: frozenset[str], window: int
                       ) -> dict[str, torch.Tensor]:
        out = gather(self, kinds, window)
        if "expected_attention" in out:
            if self._recon_prefill:
                reconstruct(self)
            out["expected_attention"] = block_scores(self).to(out["expected_attention"].dtype)
        return out

    def patched_head_evidence(self: Any, kinds: frozenset[str], window: int
                              ) -> streaming.HeadEvidence:
        out = head_evidence(self, kinds, window)
        if "expected_attention" not in kinds:
            return out
        if self._recon_prefill:
            reconstruct(self)
        return streaming.HeadEvidence(
            live=out.live, kinds={**out.kinds, "expected_attention": head_scores(self)})

    def patched_event(self: Any, *, prefill: bool, n_blocks: int, budget_blocks: int) -> bool:
        self._recon_prefill = prefill
        return bool(event(self, prefill=prefill, n_blocks=n_blocks,
                          budget_blocks=budget_blocks))

    session_cls.forward = patched_forward
    session_cls.gather = patched_gather
    session_cls._event = patched_event
    session_cls.head_evidence = patched_head_evidence

    def uninstall() -> None:
        session_cls.forward, session_cls.gather, session_cls._event = forward, gather, event
        session_cls.head_evidence = head_evidence

    return uninstall


def summarize(records: list[dict[str, Any]]) -> str:
    """Each method's means and its paired wins, losses and log-likelihood change against the
    shipped default, as a text table."""
    by: dict[str, dict[tuple[str, int], dict[str, Any]]] = defaultdict(dict)
    for rec in records:
        by[rec["method"]][(rec["task"], rec["index"])] = rec
    shipped = by[SHIPPED]
    lines = [f"{'method':72s} {'n':>3s} {'score':>6s} {'d loglik':>9s} {'KL':>6s}  "
             "vs shipped (wins/losses, d loglik)"]
    for method, recs in by.items():
        keys = sorted(set(recs) & set(shipped))
        rows = [recs[k] for k in keys]
        wins = sum(recs[k]["score"] > shipped[k]["score"] for k in keys)
        losses = sum(recs[k]["score"] < shipped[k]["score"] for k in keys)
        dl = statistics.fmean(recs[k]["delta_loglik"] - shipped[k]["delta_loglik"] for k in keys)
        lines.append(f"{method:72s} {len(rows):3d} "
                     f"{statistics.fmean(r['score'] for r in rows):6.2f} "
                     f"{statistics.fmean(r['delta_loglik'] for r in rows):9.2f} "
                     f"{statistics.fmean(r['kl'] for r in rows):6.3f}  {wins}/{losses}, {dl:+.2f}")
    return "\n".join(lines) + "\n"


def _run(config: str, out: Path, heads: str, layers: str, seed: bool) -> list[dict[str, Any]]:
    """One ``nexus-vllm eval`` of ``config`` into ``out`` with the block score reduced by
    ``heads`` and ``layers`` (the baselines' published records first when ``seed``)."""
    global _head_reduce, _layer_reduce
    _head_reduce, _layer_reduce = heads, layers
    out.mkdir(parents=True, exist_ok=True)
    if seed and not (out / "records.jsonl").exists():
        parts = []  # one --where each, then merged
        for i, method in enumerate(SEEDED):
            part = out / f"seed_{i}.jsonl"
            cli.main(["records", SEED_RECORDS, "--where", f"method={method}",
                      "--out", str(part)])
            parts.append(str(part))
        cli.main(["records", *parts, "--out", str(out / "records.jsonl")])
        for part in parts:
            os.remove(part)
    cli.main(["eval", "--config", config, "--out", str(out)])
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def _reduction(text: str, flag: str) -> tuple[str, str]:
    heads, _, layers = text.partition(":")
    if (heads, layers) != ("vote", "sum") and (heads not in ("max", "mean")
                                              or layers not in ("max", "mean")):
        raise SystemExit(f"{flag}: {text!r} is not HEADS:LAYERS (each max or mean) or vote:sum")
    return heads, layers


def saturation(tasks: list[str]) -> None:
    """Why the blocks' scores are flat: for the first tuning document of each task, read
    in two 512-token chunks, the share of tokens some head of some layer gives a weight
    above 0.9, and every block's score (heads max, layers max) over the largest."""
    from nexus_vllm.core import EvictionConfig
    from nexus_vllm.eval.tasks import make_sample
    from nexus_vllm.hf.streaming import StreamingSession
    from nexus_vllm.models import load_causal_lm

    global _head_reduce, _layer_reduce
    _head_reduce, _layer_reduce = "max", "max"
    uninstall = install()
    _, tok, model = load_causal_lm("default")
    for task in tasks:
        sample = make_sample(task, seed=0, index=0, target_tokens=2048, tokenizer=tok,
                             protocol="question-last")
        ids = torch.tensor(tok(sample.preamble + sample.context)["input_ids"])[:1024]
        session = StreamingSession(model, EvictionConfig(method="nexus", block_size=32),
                                   prompt_tokens=1 << 30)
        for start in (0, 512):
            session.forward(ids[start:start + 512])
            reconstruct(session)
        per_token = torch.stack([s.amax(dim=0) for s in session._recon_scores.values()])
        blocks = block_scores(session)
        share = float((per_token.amax(dim=0) > 0.9).float().mean())
        print(f"{task}: {share:.0%} of tokens get a weight above 0.9 from some head of some "
              f"layer; block scores / the largest: min {float(blocks.min() / blocks.max()):.3f}")
    uninstall()


def run_head(out: Path, tasks: str | None, eval_args: list[str]) -> None:
    """Head granularity on the report set's long documents (``HEAD_CONFIG``), the
    reconstruction score standing in for expected attention, into ``out`` (seeded with
    the published baselines of those samples)."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "records.jsonl").exists():
        parts = []
        for i, method in enumerate(HEAD_SEEDED):
            part = out / f"seed_{i}.jsonl"
            where = ["--where", f"method={method}"]
            if tasks:
                where += ["--where", f"task={tasks}"]
            cli.main(["records", HEAD_SEED_RECORDS, *where, "--out", str(part)])
            parts.append(str(part))
        cli.main(["records", *parts, "--out", str(out / "records.jsonl")])
        for part in parts:
            os.remove(part)
    install()
    cli.main(["eval", "--config", HEAD_CONFIG, "--out", str(out),
              *(["--tasks", tasks] if tasks else []), *eval_args])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reduce", default="max:max,max:mean,mean:mean,vote:sum",
                    help="comma-separated HEADS:LAYERS reductions of the block score, each "
                         "max or mean, or vote:sum")
    ap.add_argument("--whole", default="max:max",
                    help="the reduction of a run over the whole context at one event "
                         f"({WHOLE_CONFIG}: KVzip's own protocol, blocks kept for every "
                         "head and layer at once); empty: none")
    ap.add_argument("--out", default="runs/stream_tuning_reconstruction")
    ap.add_argument("--saturation", action="store_true",
                    help="only print how flat the blocks' scores are (two tasks, ~1 min)")
    ap.add_argument("--head", action="store_true",
                    help=f"head granularity on the report set ({HEAD_CONFIG}) into "
                         "--out (default runs/stream_head_reconstruction)")
    ap.add_argument("--tasks", default=None, help="with --head: one task of it")
    args, eval_args = ap.parse_known_args(argv)
    if eval_args and not args.head:
        ap.error(f"unrecognized arguments: {' '.join(eval_args)}")
    if args.head:
        out = args.out if args.out != ap.get_default("out") \
            else "runs/stream_head_reconstruction"
        run_head(Path(out), args.tasks, eval_args)
        return
    if args.saturation:
        saturation(["niah_single_prose", "niah_multikey"])
        return
    runs = [(CONFIG, _reduction(r, "--reduce"), False) for r in args.reduce.split(",") if r]
    if args.whole:
        runs.append((WHOLE_CONFIG, _reduction(args.whole, "--whole"), True))
    install()
    labelled: list[dict[str, Any]] = []
    for i, (config, (heads, layers), whole) in enumerate(runs):
        name = f"{'whole_' if whole else ''}heads_{heads}_layers_{layers}"
        for rec in _run(config, Path(args.out) / name, heads, layers, seed=not whole):
            method = rec["method"]
            if method in LABELS:
                rec["method"] = f"{LABELS[method]} (heads {heads}, layers {layers})"
            elif i > 0 and not (whole and method != "dense"):
                continue  # the baselines once
            if whole and method != "dense":
                rec["method"] += ", whole context at one event"
            labelled.append(rec)
    path = Path(args.out) / "records.jsonl"
    # The keys follow the new labels, as `nexus-vllm records --rename-method` rebuilds them.
    for rec in labelled:
        record = Record.from_dict(rec)
        rec["key"] = record_key(record.sample, record.method, record.budget, record.seed)
    path.write_text("".join(json.dumps(r) + "\n" for r in labelled))
    table = summarize(labelled)
    (Path(args.out) / "summary.txt").write_text(table)
    print(f"\n{table}\nrecords: {path}, summary: {Path(args.out) / 'summary.txt'}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
