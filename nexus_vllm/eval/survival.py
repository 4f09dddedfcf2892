"""``nexus-vllm survival``: how individual blocks survive eviction events on a real model,
top-K against pps against A-Res on the same Nexus weights.

    nexus-vllm survival --out runs/survival [--samples 3] [--chunk 64] [--publish DIR]

The real-attention version of the simulation's figure (``docs/simulation.md``): each
sample is streamed through the transformers path (``hf.generate_ids``, the plugin's event
rule) in small prefill chunks, so a block is a candidate at many events. At every event
the weights the policy read give each candidate its pps inclusion probability ``pi``;
whether it survived that event is read from the cache. Under ``pps`` the survival rate at
a given ``pi`` is ``pi`` (the diagonal); under ``topk`` it is a step at the cutoff, so a
block scored just below it dies at once; ``ares`` sits in between. Writes
``survival.json`` (per sampler: the (pi, survived) pairs pooled into bins, and per event
which blocks were alive) and ``survival.png`` (calibration curves and, for the first
sample, one raster of block lifetimes per sampler).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nexus_vllm.core import EvictionConfig, inclusion_probabilities
from nexus_vllm.core.policies import Evidence, forced_blocks

if TYPE_CHECKING:
    from nexus_vllm.hf.events import EvictionEvent

SAMPLERS = ("topk", "pps", "ares")
# The paper's streaming setting (an event after every prompt chunk) and its evidence (the
# mean over heads and layers, no carry): the regime this figure is about, and the one it
# was published in, not the served defaults.
STREAMING = {"prompt_mode": "stream", "attention_reduce": "mean", "carry": 0}
# Bins of the inclusion probability for the calibration curve.
BIN_EDGES = np.linspace(0.0, 1.0, 11)


@dataclass
class SamplerTrace:
    """What one sampler did: candidate (pi, survived) pairs, and per-sample lifetimes."""

    sampler: str
    pi: list[float] = field(default_factory=list)
    survived: list[bool] = field(default_factory=list)
    event: list[int] = field(default_factory=list)  # which pooled event each pair is from
    scored_events: int = 0  # events with a choice to make, pooled over samples
    # One raster per sample: rows = logical blocks, columns = events; 1 alive after the
    # event, 0 evicted at it, -1 not (or no longer) a candidate.
    rasters: list[np.ndarray] = field(default_factory=list)

    def add_events(self, events: list[Any], cfg: EvictionConfig) -> None:
        """Pool one streamed sample's recorded events (``EvictionEvent`` with evidence)."""
        b = cfg.block_size
        n_blocks_total = 1 + max(int(ev.live_blocks.max()) for ev in events)
        raster = np.full((n_blocks_total, len(events)), -1, dtype=np.int8)
        # Without the prompt's length (keep mode's prompt sinks): the weights read no sinks.
        policies = cfg.event_policies()
        for e, ev in enumerate(events):
            live = ev.live_blocks.tolist()
            n = len(live)
            policy = policies.at(prefill=ev.prefill, prompt_end=ev.prompt_end)
            evidence = Evidence.from_gathered(ev.gathered, attention_reduce=cfg.attention_reduce,
                                              num_blocks=n)
            weights = policy.keep_weights(evidence, None)
            forced = set(forced_blocks(n, cfg.sink_blocks, cfg.recent_blocks).tolist())
            cand = [i for i in range(n) if i not in forced]
            k = ev.budget_blocks - len(forced)
            kept = set((ev.kept_positions // b).tolist())
            if k <= 0 or not cand:
                # The budget holds only the forced set: every candidate goes, no choice
                # made (in the raster, not in the calibration).
                for i in cand:
                    raster[live[i], e] = 1 if live[i] in kept else 0
                continue
            pi = inclusion_probabilities(weights[cand], k).tolist()
            for i, p in zip(cand, pi, strict=True):
                alive = live[i] in kept
                self.pi.append(float(p))
                self.survived.append(alive)
                self.event.append(self.scored_events)
                raster[live[i], e] = 1 if alive else 0
            self.scored_events += 1
        self.rasters.append(raster)

    def calibration(self) -> list[dict[str, float]]:
        """Survival rate per bin of ``pi``: the curve the figure plots."""
        pi, alive = np.asarray(self.pi), np.asarray(self.survived, dtype=np.float64)
        rows = []
        for lo, hi in zip(BIN_EDGES[:-1], BIN_EDGES[1:], strict=True):
            sel = (pi >= lo) & ((pi < hi) if hi < 1.0 else (pi <= hi))
            if sel.any():
                rows.append({"pi_lo": float(lo), "pi_hi": float(hi),
                             "pi_mean": float(pi[sel].mean()),
                             "survival": float(alive[sel].mean()), "n": int(sel.sum())})
        return rows


def trace_sample(model: torch.nn.Module, prompt_ids: list[int], cfg: EvictionConfig, *,
                 max_new_tokens: int, request_seed: int) -> list[EvictionEvent]:
    """Stream one prompt (and its greedy continuation) and return the recorded events."""
    from nexus_vllm.hf.generate import generate_ids

    _, session = generate_ids(model, prompt_ids, cfg, max_new_tokens=max_new_tokens,
                              request_seed=request_seed)
    return [ev for ev in session.events if ev.gathered]


def plot_survival(traces: list[SamplerTrace], path: pathlib.Path) -> None:
    """Calibration curves (left) and the first sample's lifetime raster per sampler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    fig, axes = plt.subplots(1, 1 + len(traces), figsize=(4.2 * (1 + len(traces)), 4.0),
                             gridspec_kw={"width_ratios": [1.2] + [1.0] * len(traces)})
    ax = axes[0]
    ax.plot([0, 1], [0, 1], color="0.7", lw=1, ls="--", label="survival = pi")
    for t in traces:
        rows = t.calibration()
        ax.plot([r["pi_mean"] for r in rows], [r["survival"] for r in rows], marker="o",
                label=t.sampler)
    ax.set(xlabel="pps inclusion probability pi from the weights at the event",
           ylabel="fraction of such candidates that survived", xlim=(0, 1), ylim=(-0.02, 1.02),
           title="Survival per event vs weight")
    ax.legend(loc="upper left")
    cmap = ListedColormap(["white", "#d62728", "#1f77b4"])  # not a candidate / evicted / kept
    for ax, t in zip(axes[1:], traces, strict=True):
        raster = t.rasters[0]
        ax.imshow(raster + 1, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=2)
        ax.set(title=f"{t.sampler}: block lifetimes (sample 0)", xlabel="eviction event",
               ylabel="logical block")
    fig.suptitle("Blue: candidate kept at the event; red: evicted there; white: forced, "
                 "gone or not yet seen", fontsize=9, y=0.02)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nexus-vllm survival",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, required=True, help="output directory")
    p.add_argument("--model", default=None, help="HF model dir (default: the embedded SmolLM2)")
    p.add_argument("--task", default="niah_single_prose")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--context", type=int, default=2048, help="prompt tokens")
    p.add_argument("--budget", type=float, default=0.2, help="kept fraction of tokens seen")
    p.add_argument("--chunk", type=int, default=64,
                   help="prefill chunk in tokens (small: many events per block)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--data-seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--publish", type=pathlib.Path, default=None,
                   help="also copy survival.json and survival.png here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.samples < 1 or args.chunk < 1 or not 0.0 < args.budget <= 1.0:
        build_parser().error("--samples and --chunk must be >= 1, --budget in (0, 1]")
    from tqdm import tqdm

    from nexus_vllm.eval.tasks import make_sample
    from nexus_vllm.hf.generate import encode_prompt
    from nexus_vllm.models import load_causal_lm

    torch.set_num_threads(args.threads)
    _, tokenizer, model = load_causal_lm(args.model)
    traces = [SamplerTrace(s) for s in SAMPLERS]
    bar = tqdm(total=args.samples * len(SAMPLERS), desc="survival", dynamic_ncols=True)
    for index in range(args.samples):
        sample = make_sample(args.task, seed=args.data_seed, index=index,
                             target_tokens=args.context, tokenizer=tokenizer,
                             protocol="question-last")
        ids = encode_prompt(tokenizer, sample.context, sample.question,
                            preamble=sample.preamble).ids.tolist()
        for t in traces:
            cfg = EvictionConfig.from_budget("nexus", args.budget, chunk_size=args.chunk,
                                             sampler=t.sampler, **STREAMING)
            with torch.no_grad():
                events = trace_sample(model, ids, cfg, max_new_tokens=args.max_new_tokens,
                                      request_seed=index)
            t.add_events(events, cfg)
            bar.update(1)
    bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"task": args.task, "samples": args.samples, "context": args.context,
               "budget": args.budget, "chunk": args.chunk, "data_seed": args.data_seed,
               "samplers": {t.sampler: {"candidates": len(t.pi), "calibration": t.calibration(),
                                        "raster_sample0": t.rasters[0].tolist()}
                            for t in traces}}
    (args.out / "survival.json").write_text(json.dumps(summary) + "\n")
    plot_survival(traces, args.out / "survival.png")
    for t in traces:
        cells = ", ".join(f"[{r['pi_lo']:.1f},{r['pi_hi']:.1f}): {r['survival']:.2f} "
                          f"(n={r['n']})" for r in t.calibration())
        print(f"{t.sampler}: survival by pi bin: {cells}")
    if args.publish is not None:
        args.publish.mkdir(parents=True, exist_ok=True)
        for name in ("survival.json", "survival.png"):
            shutil.copy2(args.out / name, args.publish / name)
    print(f"nexus-vllm survival: wrote {args.out}/survival.json, survival.png", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
