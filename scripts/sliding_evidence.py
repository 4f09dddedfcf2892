"""Does a hybrid model's sliding-window attention add anything to eviction's evidence?
(issue 36: "score from the full-attention layers; state whether the sliding layers'
attention adds anything, measured").

    .venv/bin/python scripts/sliding_evidence.py [--model gemma3-270m] \\
        [--tasks niah_single_prose,niah_multikey] [--samples 20] [--data-seed 1] \\
        [--modes end,stream] [--out runs/gemma3_sliding] [--publish docs/figures/gemma3_sliding]

Nexus on the transformers path scores from the full-attention layers only (the server's
rule). This diagnostic runs it twice on the same samples, paired: as shipped, and with
the window's attention mass also gathered from the sliding-window layers the config
scores (``skip_layers`` on), combined with the full layers' mass by ``attention_reduce``
as layers are combined today. A sliding layer's row at position ``p`` sees only keys at
``p - sliding_window < k <= p``, so it can add mass only to the blocks inside the window;
its mass on tokens the full layers have already evicted is dropped (those blocks are not
candidates). The switch is this script's: no config knob, and the server cannot do it.

Writes ``records.jsonl`` (one record per sample and variant, as ``nexus-vllm eval``
writes them: labels ``nexus`` / ``nexus+sliding`` for ``end``, and
``nexus:prompt_mode=stream`` / ``nexus:prompt_mode=stream+sliding``), ``decisions.jsonl``
(per sample: blocks kept when decoding starts under each variant, and how many differ),
``compare.json`` and ``table.md`` (``nexus-vllm compare``'s paired bootstrap and sign
test); ``--publish DIR`` copies them into DIR. Resumes from ``records.jsonl``;
``--report-only`` runs nothing (a partial run's report).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from nexus_vllm.core import EvictionConfig
from nexus_vllm.hf import capture as hf_capture
from nexus_vllm.hf import make_config
from nexus_vllm.hf import streaming as hf_streaming
from nexus_vllm.hf.streaming import StreamingSession

# The module (``nexus_vllm.hf.generate`` the attribute is the function of that name).
hf_generate = importlib.import_module("nexus_vllm.hf.generate")

MODES = ("end", "stream")
BLOCK = 32  # Nexus's block_size (the runs' default)
# The name the transformers path builds its sessions by (in nexus_vllm.hf.generate).
_SESSION = "StreamingSession"
SLIDING = "+sliding"


def label(mode: str, sliding: bool) -> str:
    """The record label of a variant (``nexus`` is today's method, as gemma3_report)."""
    base = "nexus" if mode == "end" else "nexus:prompt_mode=stream"
    return base + (SLIDING if sliding else "")


class SlidingEvidenceSession(StreamingSession):
    """A :class:`StreamingSession` that also keeps the sliding-window layers' query rows
    and the keys they attended to, and (``include_sliding``) adds those layers' window
    mass to the ``mass`` evidence. Records its events (kept blocks) always."""

    include_sliding = False  # the class default; :func:`sliding_sessions` sets it

    def __init__(self, model: Any, config: Any, **kwargs: Any) -> None:
        kwargs["record_events"] = True
        super().__init__(model, config, **kwargs)
        self.include_sliding = type(self).include_sliding
        text = model.config.get_text_config(decoder=True)
        self.sliding_window = int(getattr(text, "sliding_window", 0) or 0)
        # Per sliding layer: (logical position of the first key, keys [L, Hkv, D]).
        self._window_keys: dict[int, tuple[int, torch.Tensor]] = {}

    def _record_queries(self, layer_idx: int, query: torch.Tensor) -> None:
        super()._record_queries(layer_idx, query)
        if self._query_keep == 0 or not self._sliding[layer_idx]:
            return
        q = query[0, :, -self._query_keep:, :].detach()
        prev = self._queries[layer_idx]
        if prev is not None and q.shape[1] < self._query_keep:
            q = torch.cat([prev, q], dim=1)[:, -self._query_keep:]
        self._queries[layer_idx] = q

    def record_keys(self, layer_idx: int, key: torch.Tensor, n_new: int) -> None:
        """A sliding layer's keys as its attention read them (``[1, Hkv, L, D]``, the
        newest ``n_new`` this forward's): the ones a window row can still see are kept."""
        if not self._sliding[layer_idx]:
            return
        keys = key[0].detach().transpose(0, 1)  # [L, Hkv, D]
        start = self.seen + n_new - keys.shape[0]
        old = self._window_keys.get(layer_idx)
        if old is not None and old[0] < start:
            keys = torch.cat([old[1][: start - old[0]], keys])
            start = old[0]
        keep = self.sliding_window - 1 + self._query_keep
        drop = max(0, keys.shape[0] - keep)
        self._window_keys[layer_idx] = (start + drop, keys[drop:])

    def sliding_mass(self, layer_idx: int, window: int) -> torch.Tensor:
        """``[W, N]``: the mass a sliding layer's newest ``window`` rows put on the
        full-attention cache's blocks (heads reduced by ``attention_reduce``; mass on
        evicted tokens dropped, rows renormalised under ``mean``)."""
        cfg = self.config
        assert cfg is not None
        q = self._queries[layer_idx]
        if q is None or layer_idx not in self._window_keys:
            raise RuntimeError(f"no queries or keys recorded for sliding layer {layer_idx}")
        q = q[:, -window:].float()  # [Hq, W, D]
        start, keys = self._window_keys[layer_idx]
        hq, w, d = q.shape
        group = hq // keys.shape[1]
        k = keys.float().repeat_interleave(group, dim=1).permute(1, 2, 0)  # [Hq, D, L]
        logits = torch.matmul(q, k) / math.sqrt(d)  # as block_attention_mass scales
        qpos = torch.arange(self.seen - w, self.seen)
        kpos = torch.arange(start, start + keys.shape[0])
        seen = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None]
                                                   - self.sliding_window)
        probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)  # [Hq, W, L]
        # Each key's physical slot in the full-attention cache (absent when evicted).
        slot = torch.searchsorted(self.positions, kpos).clamp_max(len(self.positions) - 1)
        live = self.positions[slot] == kpos
        n = hf_streaming.num_blocks_for(self.cache_len, cfg.block_size)
        out = torch.zeros(hq, w, n)
        out.index_add_(2, slot[live] // cfg.block_size, probs[:, :, live])
        if cfg.attention_reduce == "mean":
            out = out.mean(dim=0)
            return out / out.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        return out.amax(dim=0)

    def gather(self, kinds: frozenset[str], window: int) -> dict[str, torch.Tensor]:
        out = super().gather(kinds, window)
        if self.include_sliding and "mass" in out:
            assert self.config is not None
            layers = [i for i in self.config.scored_layers(self.num_layers)
                      if self._sliding[i]]
            masses = [self.sliding_mass(i, int(out["mass"].shape[0])) for i in layers]
            if masses:
                full = len(self._scored_layers())
                if self.config.attention_reduce == "mean":  # a mean over every layer
                    total = out["mass"] * full + torch.stack(masses).sum(dim=0)
                    out["mass"] = total / (full + len(masses))
                else:
                    out["mass"] = torch.stack([out["mass"], *masses]).amax(dim=0)
        return out

    def clone(self) -> SlidingEvidenceSession:
        other = super().clone()
        assert isinstance(other, SlidingEvidenceSession)
        other._window_keys = dict(self._window_keys)
        return other


def _capture_with_keys(original: Any) -> Any:
    def attend(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, **kwargs: Any) -> Any:
        session = getattr(kwargs.get("nexus_capture"), "__self__", None)
        if isinstance(session, SlidingEvidenceSession):
            session.record_keys(int(module.layer_idx), key, int(query.shape[-2]))
        return original(module, query, key, value, attention_mask, **kwargs)
    return attend


@contextlib.contextmanager
def sliding_sessions(include_sliding: bool) -> Iterator[None]:
    """Within: every session the transformers path builds is a
    :class:`SlidingEvidenceSession` (``include_sliding`` by default), and the capturing
    attention hands it the sliding layers' keys too."""
    from transformers import AttentionInterface

    hf_capture._register()
    mapping = AttentionInterface._global_mapping
    original = mapping[hf_streaming.CAPTURE_ATTENTION]
    saved = getattr(hf_generate, _SESSION), SlidingEvidenceSession.include_sliding
    AttentionInterface.register(hf_streaming.CAPTURE_ATTENTION, _capture_with_keys(original))
    setattr(hf_generate, _SESSION, SlidingEvidenceSession)
    SlidingEvidenceSession.include_sliding = include_sliding
    try:
        yield
    finally:
        AttentionInterface.register(hf_streaming.CAPTURE_ATTENTION, original)
        setattr(hf_generate, _SESSION, saved[0])
        SlidingEvidenceSession.include_sliding = saved[1]


def kept_blocks(session: StreamingSession, block_size: int) -> set[int]:
    """Logical blocks held when decoding started (the last event at or before the
    prompt's end; every block when none fired)."""
    events = [e for e in session.events if e.seen <= session.prompt_tokens]
    positions = events[-1].kept_positions if events else session.positions
    return {int(p) // block_size for p in positions}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--tasks", default="niah_single_prose,niah_multikey")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--data-seed", type=int, default=1)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--modes", default="end,stream")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/gemma3_sliding"))
    p.add_argument("--publish", type=pathlib.Path, default=None, metavar="DIR")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild compare.json and table.md from the records")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        p.error(f"--modes: choose from {MODES}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)

    from nexus_vllm.eval.records import Record, read_records, record_writer
    from nexus_vllm.eval.runner import (
        DENSE,
        RunConfig,
        _job,
        _SampleJob,
        iter_samples,
        kl_to_dense,
    )
    from nexus_vllm.models import load_causal_lm

    cfg = RunConfig(model=args.model, tasks=tuple(args.tasks.split(",")),
                    methods=("dense", "nexus", "nexus:prompt_mode=stream"), budgets=(0.2,),
                    contexts=(args.context,), protocols=("question-last",),
                    samples=args.samples, seeds=1, data_seed=args.data_seed)
    args.out.mkdir(parents=True, exist_ok=True)
    records_path, decisions_path = args.out / "records.jsonl", args.out / "decisions.jsonl"
    done = {(r.task, r.index, r.method) for r in read_records(records_path)}
    _, tokenizer, model = load_causal_lm(cfg.model)
    print(f"sliding_evidence: {cfg.model}, out {args.out}", file=sys.stderr)
    with record_writer(records_path) as write, decisions_path.open("a") as decisions:
        for sid in () if args.report_only else iter_samples(cfg):
            todo = [m for m in modes if any((sid.task, sid.index, label(m, s)) not in done
                                            for s in (False, True))]
            if not todo:
                continue
            job = _job(cfg, model, tokenizer, sid)
            assert isinstance(job, _SampleJob)
            with sliding_sessions(False):  # the dense prompt state keeps sliding rows
                dense, dense_rec = job.run(DENSE, None, 0)
            if (sid.task, sid.index, "dense") not in done:
                write(dense_rec)
            for mode in todo:
                t0 = time.perf_counter()
                kept = {}
                for sliding in (False, True):
                    t1 = time.perf_counter()
                    res, kept[sliding] = _one(mode, job, tokenizer, sliding)
                    kl_all, kl_ans = kl_to_dense(dense, res)
                    write(Record.build(
                        sid, label(mode, sliding), 0.2, 0, score=job.sample.score(res.text),
                        prediction=res.text, answers=job.sample.answers,
                        answer_loglik=res.answer_loglik,
                        dense_answer_loglik=dense.answer_loglik, answer_tokens=res.n_answer,
                        kl=kl_all, kl_answer=kl_ans, prompt_tokens=job.sample.num_tokens,
                        cache_tokens=res.cache_tokens, events=res.events,
                        seconds=time.perf_counter() - t1))
                differ = len(kept[False] - kept[True])
                decisions.write(json.dumps({
                    "task": sid.task, "index": sid.index, "mode": mode,
                    "kept": len(kept[False]), "kept_sliding": len(kept[True]),
                    "differ": differ, "differ_blocks": sorted(kept[False] ^ kept[True])}) + "\n")
                decisions.flush()
                print(f"  {mode} {sid.task}#{sid.index}: {differ} of {len(kept[False])} kept "
                      f"blocks differ ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    text = model.config.get_text_config(decoder=True)
    summarize(args.out, modes,
              reach=int(text.sliding_window) + EvictionConfig().prompt_window - 1)
    if args.publish is not None:
        from nexus_vllm.eval.cli import _publish

        _publish(args.out, args.publish)
    return 0


def _one(mode: str, job: Any, tokenizer: Any, sliding: bool) -> tuple[Any, set[int]]:
    """One variant of ``mode`` on one sample: (SampleResult, blocks kept at decode start)."""
    knobs = {} if mode == "end" else {"prompt_mode": "stream"}
    config = make_config("nexus", 0.2, chunk_size=job.cfg.chunk_size, seed=0, **knobs)
    assert config is not None
    with sliding_sessions(sliding):
        state = job._prompt(config, 0)
        session = state.session
        session.include_sliding = sliding  # an ``end`` run forks the dense prompt state
        res = hf_generate.finish_sample(state, tokenizer, max_new_tokens=job.sample.max_new_tokens)
    return res, kept_blocks(session, config.block_size)


def summarize(out: pathlib.Path, modes: list[str], *, reach: int) -> None:
    """``compare.json`` and ``table.md``: per mode, the paired comparison of the two
    variants (score, delta_loglik, kl) and the blocks kept that differ, and how many of
    those hold a token some sliding row sees (the prompt's last ``reach`` tokens: the
    sliding window plus the window rows, less one)."""
    from nexus_vllm.eval.records import read_records
    from nexus_vllm.eval.stats import paired_comparison

    records = read_records(out / "records.jsonl")
    rows = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    found, lines = [], ["| prompt mode | metric | with sliding - full only (95% CI) | "
                        "wins/losses/ties | verdict |", "|---|---|---|---|---|"]
    for mode in modes:
        for metric in ("score", "delta_loglik", "kl"):
            try:
                c = paired_comparison(records, label(mode, True), label(mode, False),
                                      metric=metric)
            except ValueError:
                continue
            found.append(dataclasses.asdict(c))
            lines.append(f"| {mode} | {metric} | {c.mean_diff:+.3f} [{c.low:+.3f}, "
                         f"{c.high:+.3f}] | {c.wins}/{c.losses}/{c.n - c.wins - c.losses} | "
                         f"{c.verdict} (sign p {c.p_sign:.2f}) |")
    prompt = {(r.task, r.index): r.prompt_tokens for r in records}
    lines += ["", "Blocks kept when decoding starts: how many one variant keeps and the other "
              "does not (per sample), and where the blocks either keeps alone lie.", "",
              "| prompt mode | samples | blocks kept | differing (mean) | samples with any | "
              "of those blocks, in the sliding rows' reach |", "|---|---|---|---|---|---|"]
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        if mine:
            kept = sum(r["kept"] for r in mine) / len(mine)
            diff = sum(r["differ"] for r in mine) / len(mine)
            anyd = sum(1 for r in mine if r["differ"])
            both = [(b + 1) * BLOCK > prompt[(r["task"], r["index"])] - reach
                    for r in mine for b in r["differ_blocks"]]
            lines.append(f"| {mode} | {len(mine)} | {kept:.1f} | {diff:.2f} | {anyd} | "
                         f"{sum(both)} of {len(both)} |")
    (out / "compare.json").write_text(json.dumps(found, indent=1) + "\n")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
