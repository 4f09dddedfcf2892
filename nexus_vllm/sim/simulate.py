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
sampling it survives with the product of its inclusion probabilities.

This module is the simulation only (torch, no I/O); ``nexus_vllm.sim.cli`` is the
``nexus-vllm simulate`` command and the plot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nexus_vllm.core import (
    POLICIES,
    EvictionPolicy,
    Evidence,
    forced_count,
    get_policy,
    normalize_rows,
)
from nexus_vllm.core._validate import check_int

__all__ = [
    "BLOCK_CLASSES",
    "DEFAULT_POLICIES",
    "SIMULATED_KINDS",
    "SimulationConfig",
    "SimulationResult",
    "simulate",
]

BLOCK_CLASSES = ("background", "intermittent", "bridge", "spike")

# The evidence kinds the synthetic stream makes (``_Stream.evidence``). A kind registered
# since is not simulated until it is synthesised there: its policies are left out.
SIMULATED_KINDS = frozenset({"mass", "key_norms", "expected_attention"})


def _simulated(cls: type[EvictionPolicy]) -> bool:
    """A block score (the simulator pages blocks) reading only simulated kinds."""
    return not cls.head_only and cls().needs <= SIMULATED_KINDS


# name -> (policy, knobs): Nexus with each sampler, then every other registered policy
# the stream can feed.
DEFAULT_POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "nexus": ("nexus", {}),
    "nexus-ares": ("nexus", {"sampler": "ares"}),
    "nexus-topk": ("nexus", {"sampler": "topk"}),
    **{name: (name, {}) for name, cls in POLICIES.items()
       if name != "nexus" and _simulated(cls)},
}

# The stream's shape. Importances are in units of the median background block (1.0).
# With the default config (34 live blocks cut to 32 at each event, 4 of them forced) the
# cutoff, i.e. the importance of the best block evicted, sits at about 0.9-1.0 of that
# unit: top-K on direct mass drops two blocks out of 30 candidates per event.
BACKGROUND_LOG_SIGMA = 0.6  # spread of background importance: lognormal(0, 0.6)
# Fixed importances of the special classes (background is drawn):
#   intermittent 6.0: far above the cutoff, except when it dips (DIP_FACTOR below);
#   bridge 1.6: above the cutoff on the time average, and flat, so a single row never
#     singles it out;
#   spike 1.0: its mass is set by SPIKE_* below; the importance only sets its key norm,
#     at the background median, so knorm cannot tell spikes apart.
CLASS_IMPORTANCE = {"intermittent": 6.0, "bridge": 1.6, "spike": 1.0}
DIP_PROB = 0.5  # an intermittent block dips in a random half of the events...
DIP_FACTOR = 0.15  # ...to 6.0 * 0.15 = 0.9: just under the cutoff, where top-K drops it
ATTENTION_LOG_SIGMA = 0.4  # per-(event, query, block) noise on direct attention
KEY_NORM_LOG_SIGMA = 0.3  # key norm = noise / importance: informative but not exact
SPIKE_FLOOR = 0.05  # a spike's mass on every query but one...
SPIKE_PEAK_PER_ROW = 6.0  # ...and W * 6.0 on that one: a column mean of about 6
# Offset between a stream's seed and its policies' sampler seed, so the sampler's draws
# do not reuse the stream generator's sequence (which would correlate them with the data).
POLICY_SEED_OFFSET = 10_000


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
    sink_blocks, recent_blocks : int
        The policies' forced set (as in ``EvictionConfig``).
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
            "budget_blocks", self.budget_blocks,
            low=forced_count(self.sink_blocks, self.recent_blocks)
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
        self.importance = torch.exp(
            BACKGROUND_LOG_SIGMA * torch.randn(total, generator=self.gen, dtype=torch.float64)
        )
        for j, c in enumerate(self.classes):
            if c in CLASS_IMPORTANCE:
                self.importance[j] = CLASS_IMPORTANCE[c]
        self.key_norms = (
            1.0
            / self.importance
            * torch.exp(
                KEY_NORM_LOG_SIGMA * torch.randn(total, generator=self.gen, dtype=torch.float64)
            )
        )
        self.dips = torch.rand(cfg.events, total, generator=self.gen) < DIP_PROB
        # Each event's mass is drawn once so every policy sees identical evidence.
        self.noise = torch.exp(
            ATTENTION_LOG_SIGMA
            * torch.randn(cfg.events, cfg.window, total, generator=self.gen, dtype=torch.float64)
        )
        self.spike_rows = torch.randint(0, cfg.window, (cfg.events, total), generator=self.gen)

    def mass(self, event: int, live: list[int]) -> torch.Tensor:
        """Row-normalised block mass ``[W, len(live)]`` of ``event`` over the ``live`` blocks."""
        ids = torch.tensor(live)
        w = self.cfg.window
        mass = self.importance[ids][None, :] * self.noise[event][:, ids]
        for col, j in enumerate(live):
            kind = self.classes[j]
            if kind == "intermittent" and bool(self.dips[event, j]):
                mass[:, col] *= DIP_FACTOR
            elif kind == "bridge":
                mass[:, col] = self.importance[j]  # flat: moderate support from every row
            elif kind == "spike":
                mass[:, col] = SPIKE_FLOOR
                mass[int(self.spike_rows[event, j]), col] = SPIKE_PEAK_PER_ROW * w
        return normalize_rows(mass).float()

    def evidence(self, event: int, live: list[int]) -> Evidence:
        """Every evidence kind of ``event`` over the ``live`` blocks: the mass, the key
        norms, and as expected attention the latent importance seen through the key
        norms' noise (normalised ``1 / key norm``: a query-agnostic estimate, the same
        information KNorm reads)."""
        ids = torch.tensor(live)
        norms = self.key_norms[ids]
        expected = 1.0 / norms
        return Evidence(self.mass(event, live), norms,
                        expected_attention=normalize_rows(expected).float())


def _run_one(
    policy: EvictionPolicy, stream: _Stream, cfg: SimulationConfig, seed: int
) -> list[int]:
    live = list(range(cfg.budget_blocks))
    nxt = cfg.budget_blocks
    gen = torch.Generator().manual_seed(POLICY_SEED_OFFSET + seed)
    state: dict[str, Any] = {}
    for event in range(cfg.events):
        live += list(range(nxt, nxt + cfg.blocks_per_event))
        nxt += cfg.blocks_per_event
        evidence = stream.evidence(event, live)
        keep = policy.select(evidence, cfg.budget_blocks, generator=gen, state=state)
        live = [live[i] for i in keep.tolist()]
    return live


def simulate(
    cfg: SimulationConfig | None = None,
    policies: dict[str, tuple[str, dict[str, Any]]] | None = None,
    *,
    on_stream: Callable[[int], None] | None = None,
) -> SimulationResult:
    """Run every policy over ``cfg.seeds`` synthetic streams.

    Survival counts blocks born in the first quarter of the stream (old enough to have
    faced many events) that are still cached after the last event.

    Parameters
    ----------
    cfg : SimulationConfig, optional
        The stream's shape (defaults: ``SimulationConfig()``).
    policies : dict, optional
        ``name -> (policy, knobs)``; defaults to :data:`DEFAULT_POLICIES`.
    on_stream : callable, optional
        Called with the seed after each stream (a progress bar, for example).
    """
    cfg = cfg or SimulationConfig()
    policies = policies or DEFAULT_POLICIES
    for name, (kind, knobs) in policies.items():
        missing = get_policy(kind, **knobs).needs - SIMULATED_KINDS
        if missing:
            raise ValueError(f"policy {name!r} reads {sorted(missing)}, which the simulator "
                             f"does not synthesise (it makes {sorted(SIMULATED_KINDS)})")
    built = {
        # No carry: the synthetic stream has no continuation for it to keep.
        name: get_policy(
            kind, sink_blocks=cfg.sink_blocks, recent_blocks=cfg.recent_blocks, carry=0,
            **knobs
        )
        for name, (kind, knobs) in policies.items()
    }
    alive_counts = {name: dict.fromkeys(BLOCK_CLASSES, 0) for name in built}
    class_counts = dict.fromkeys(BLOCK_CLASSES, 0)
    curves: dict[str, list[tuple[float, bool]]] = {name: [] for name in built}
    horizon = cfg.budget_blocks + (cfg.events * cfg.blocks_per_event) // 4
    for seed in range(cfg.seeds):
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
        if on_stream is not None:
            on_stream(seed)
    survival = {
        name: {
            c: per[c] / class_counts[c] if class_counts[c] else float("nan") for c in BLOCK_CLASSES
        }
        for name, per in alive_counts.items()
    }
    return SimulationResult(cfg, survival, curves)
