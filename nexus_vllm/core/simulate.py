"""Streaming eviction on synthetic block weights: who survives under each policy.

A stream of blocks arrives a few per event into a cache with a fixed block budget. Each
block has a latent importance and a class:

``background``
    importance drawn log-normally; attention fluctuates around it.
``intermittent``
    important, but in a random half of the events its attention dips to just below the
    typical cutoff (a fact the text refers to now and then).
``bridge``
    moderately attended by every window query, strongly by none.
``spike``
    attended sharply by a single window query per event, barely by the others.

Every policy sees the same mass matrices (``[W, N]`` per event) and keeps the same
budget. Survival per class at the end of the stream shows the theory: under top-K a
block dies at its first dip below the cutoff (survival is a min over events); under
sampling it survives with the product of its inclusion probabilities. The plot is the
paper's Figure 3: survival against time-averaged weight, a step for top-K and a smooth
curve for sampling.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ._validate import check_int
from .policies import EvictionPolicy, get_policy

__all__ = ["BLOCK_CLASSES", "SimulationConfig", "SimulationResult", "main", "simulate"]

BLOCK_CLASSES = ("background", "intermittent", "bridge", "spike")

# name -> (policy, knobs): the baselines plus Nexus with each sampler.
DEFAULT_POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "nexus": ("nexus", {}),
    "nexus-ares": ("nexus", {"sampler": "ares"}),
    "nexus-topk": ("nexus", {"sampler": "topk"}),
    "h2o": ("h2o", {}),
    "snapkv": ("snapkv", {}),
    "tova": ("tova", {}),
    "streaming": ("streaming", {}),
    "random": ("random", {}),
    "knorm": ("knorm", {}),
}


@dataclass(frozen=True)
class SimulationConfig:
    """Shape of the synthetic stream.

    Parameters
    ----------
    events : int
        Eviction events in the stream.
    budget_blocks : int
        Blocks kept after every event.
    blocks_per_event : int
        New blocks arriving before each event.
    window : int
        W, window queries per event.
    class_probs : dict
        Probability that a new block is of each class.
    seeds : int
        Independent streams averaged.
    """

    events: int = 24
    budget_blocks: int = 32
    blocks_per_event: int = 2
    window: int = 16
    sink_blocks: int = 1
    recent_blocks: int = 2
    class_probs: dict[str, float] = field(
        default_factory=lambda: {
            "background": 0.7,
            "intermittent": 0.1,
            "bridge": 0.1,
            "spike": 0.1,
        }
    )
    seeds: int = 40

    def __post_init__(self) -> None:
        check_int("events", self.events, low=1)
        check_int("blocks_per_event", self.blocks_per_event, low=1)
        check_int("window", self.window, low=1)
        check_int("seeds", self.seeds, low=1)
        check_int(
            "budget_blocks", self.budget_blocks, low=self.sink_blocks + self.recent_blocks + 1
        )
        unknown = set(self.class_probs) - set(BLOCK_CLASSES)
        if unknown:
            raise ValueError(
                f"class_probs has unknown classes {sorted(unknown)}; allowed: {BLOCK_CLASSES}"
            )
        if any(p < 0 for p in self.class_probs.values()) or sum(self.class_probs.values()) <= 0:
            raise ValueError("class_probs must be non-negative with a positive sum")


@dataclass
class SimulationResult:
    """Per policy: survival fraction per class, and per-block (time-averaged weight, survived)."""

    config: SimulationConfig
    survival: dict[str, dict[str, float]]
    curves: dict[str, list[tuple[float, bool]]]

    def table(self) -> str:
        header = "| policy | " + " | ".join(BLOCK_CLASSES) + " |"
        rule = "|---" * (len(BLOCK_CLASSES) + 1) + "|"
        rows = [
            f"| {name} | " + " | ".join(f"{per[c]:.3f}" for c in BLOCK_CLASSES) + " |"
            for name, per in self.survival.items()
        ]
        return "\n".join([header, rule, *rows])


class _Stream:
    """One synthetic stream: block classes, latent importances and per-event masses."""

    def __init__(self, cfg: SimulationConfig, seed: int) -> None:
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed(seed)
        total = cfg.budget_blocks + cfg.events * cfg.blocks_per_event
        names = list(cfg.class_probs)
        probs = torch.tensor([cfg.class_probs[n] for n in names], dtype=torch.float64)
        picks = torch.multinomial(probs, total, replacement=True, generator=self.gen)
        self.classes = [names[i] for i in picks.tolist()]
        # Background importance ~ lognormal(0, 0.6); the other classes sit where the
        # cutoff of a 24-of-26 budget usually falls, so fluctuations decide their fate.
        base = torch.exp(0.6 * torch.randn(total, generator=self.gen, dtype=torch.float64))
        self.importance = base
        for j, c in enumerate(self.classes):
            if c == "intermittent":
                self.importance[j] = 6.0
            elif c == "bridge":
                self.importance[j] = 1.6
            elif c == "spike":
                self.importance[j] = 1.0
        self.key_norms = (
            1.0
            / self.importance
            * torch.exp(0.3 * torch.randn(total, generator=self.gen, dtype=torch.float64))
        )
        self.dips = torch.rand(cfg.events, total, generator=self.gen) < 0.5
        # Each event's mass is drawn once so every policy sees identical evidence.
        self.noise = torch.exp(
            0.4
            * torch.randn(cfg.events, cfg.window, total, generator=self.gen, dtype=torch.float64)
        )
        self.spike_rows = torch.randint(0, cfg.window, (cfg.events, total), generator=self.gen)

    def mass(self, event: int, live: list[int]) -> torch.Tensor:
        ids = torch.tensor(live)
        w = self.cfg.window
        mass = self.importance[ids][None, :] * self.noise[event][:, ids]
        for col, j in enumerate(live):
            kind = self.classes[j]
            if kind == "intermittent" and bool(self.dips[event, j]):
                mass[:, col] *= 0.15
            elif kind == "bridge":
                mass[:, col] = self.importance[j]  # flat: moderate support from every row
            elif kind == "spike":
                mass[:, col] = 0.05
                mass[int(self.spike_rows[event, j]), col] = 6.0 * w
        return (mass / mass.sum(dim=1, keepdim=True)).float()


def _run_one(
    policy: EvictionPolicy, stream: _Stream, cfg: SimulationConfig, seed: int
) -> list[int]:
    live = list(range(cfg.budget_blocks))
    nxt = cfg.budget_blocks
    gen = torch.Generator().manual_seed(10_000 + seed)
    state: dict[str, Any] = {}
    for event in range(cfg.events):
        live += list(range(nxt, nxt + cfg.blocks_per_event))
        nxt += cfg.blocks_per_event
        keep = policy.select(
            stream.mass(event, live),
            cfg.budget_blocks,
            generator=gen,
            state=state,
            key_norms=stream.key_norms[torch.tensor(live)],
        )
        live = [live[i] for i in keep.tolist()]
    return live


def simulate(
    cfg: SimulationConfig | None = None,
    policies: dict[str, tuple[str, dict[str, Any]]] | None = None,
    *,
    progress: bool = False,
) -> SimulationResult:
    """Run every policy over ``cfg.seeds`` synthetic streams.

    Survival counts blocks born in the first quarter of the stream (old enough to have
    faced many events) that are still cached after the last event.
    """
    cfg = cfg or SimulationConfig()
    policies = policies or DEFAULT_POLICIES
    built = {
        name: get_policy(
            kind, sink_blocks=cfg.sink_blocks, recent_blocks=cfg.recent_blocks, **knobs
        )
        for name, (kind, knobs) in policies.items()
    }
    alive_counts = {name: dict.fromkeys(BLOCK_CLASSES, 0) for name in built}
    class_counts = dict.fromkeys(BLOCK_CLASSES, 0)
    curves: dict[str, list[tuple[float, bool]]] = {name: [] for name in built}
    horizon = cfg.budget_blocks + (cfg.events * cfg.blocks_per_event) // 4
    seeds = range(cfg.seeds)
    if progress:
        from tqdm import tqdm

        seeds = tqdm(seeds, desc="simulate", unit="stream")
    for seed in seeds:
        stream = _Stream(cfg, seed)
        tracked = range(cfg.sink_blocks, horizon)
        for j in tracked:
            class_counts[stream.classes[j]] += 1
        # Time-averaged weight: a block's mean direct share over the whole stream, the
        # same for every policy (computed with all tracked blocks live).
        avg_weight = torch.stack(
            [stream.mass(e, list(tracked)).double().mean(dim=0) for e in range(cfg.events)]
        ).mean(dim=0)
        for name, policy in built.items():
            survivors = set(_run_one(policy, stream, cfg, seed))
            for pos, j in enumerate(tracked):
                alive = j in survivors
                alive_counts[name][stream.classes[j]] += int(alive)
                curves[name].append((float(avg_weight[pos]), alive))
    survival = {
        name: {
            c: per[c] / class_counts[c] if class_counts[c] else float("nan") for c in BLOCK_CLASSES
        }
        for name, per in alive_counts.items()
    }
    return SimulationResult(cfg, survival, curves)


def plot_survival(
    result: SimulationResult, path: str | Path, names: list[str] | None = None
) -> Path:
    """Figure-3-style plot: survival probability against time-averaged weight (binned)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = names or [
        n for n in ("nexus", "nexus-ares", "nexus-topk", "snapkv") if n in result.curves
    ]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in names:
        pts = torch.tensor(result.curves[name], dtype=torch.float64)
        order = torch.argsort(pts[:, 0])
        x, alive = pts[order, 0], pts[order, 1]
        bins = torch.tensor_split(torch.arange(x.numel()), 24)
        xs = [float(x[b].mean()) for b in bins if b.numel()]
        ys = [float(alive[b].mean()) for b in bins if b.numel()]
        ax.plot(xs, ys, marker="o", ms=3, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time-averaged attention weight of the block")
    ax.set_ylabel("survival probability to the end of the stream")
    ax.set_title("Survival under a fixed budget: top-K is a step, sampling is smooth")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nexus-vllm simulate", description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=SimulationConfig.events)
    parser.add_argument("--budget-blocks", type=int, default=SimulationConfig.budget_blocks)
    parser.add_argument("--blocks-per-event", type=int, default=SimulationConfig.blocks_per_event)
    parser.add_argument("--window", type=int, default=SimulationConfig.window)
    parser.add_argument("--seeds", type=int, default=SimulationConfig.seeds)
    parser.add_argument("--plot", default="simulate_survival.png", help="where to write the plot")
    parser.add_argument("--json", default=None, help="also write survival numbers as JSON here")
    args = parser.parse_args(argv)
    try:
        cfg = SimulationConfig(
            events=args.events,
            budget_blocks=args.budget_blocks,
            blocks_per_event=args.blocks_per_event,
            window=args.window,
            seeds=args.seeds,
        )
    except ValueError as exc:
        parser.error(str(exc))
    result = simulate(cfg, progress=True)
    print(
        f"survival to the end of the stream, blocks born in its first quarter ({cfg.seeds} streams)"
    )
    print(result.table())
    print(f"plot: {plot_survival(result, args.plot)}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"config": asdict(cfg), "survival": result.survival}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
