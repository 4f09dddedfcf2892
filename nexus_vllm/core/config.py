"""``EvictionConfig``: the one validated description of an eviction setup.

The vLLM plugin, the transformers path and the evaluation harness all build their
policies and budgets from this, so a setting means the same thing everywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from ._validate import ConfigError, check_choice, check_float, check_int
from .policies import POLICIES, EvictionPolicy, NexusPolicy, get_policy
from .scoring import cdiv
from .weights import check_indirect

__all__ = ["METHODS", "EvictionConfig"]

METHODS = ("none", *POLICIES)
# Engine-level fields that policies do not take; every other field a policy class also
# declares is passed to it by policy() (the policy's own default is the field's default).
_ENGINE_FIELDS = ("method", "max_tokens", "keep_ratio", "block_size", "interval", "window",
                  "prefill_window", "chunk_size", "skip_layers", "layer_stride", "indirect",
                  "prefill_indirect", "seed")


def _policy_default(cls: type, name: str) -> Any:
    """A policy class's default for knob ``name`` (the one source of truth)."""
    return {f.name: f.default for f in fields(cls)}[name]


@dataclass(frozen=True)
class EvictionConfig:
    """How one request's KV cache is kept within budget.

    Parameters
    ----------
    method : str
        ``"none"`` (no eviction) or a policy name: nexus, h2o, snapkv, tova, streaming,
        random, knorm.
    max_tokens : int, optional
        Fixed budget in tokens (the cache never grows past it).
    keep_ratio : float, optional
        Budget as a fraction in (0, 1] of the tokens seen so far. At most one of
        ``max_tokens`` and ``keep_ratio``; with neither, nothing is evicted.
    block_size : int
        Tokens per block (a vLLM KV block; 32 on CPU vLLM and for small models).
    sink_blocks, recent_blocks : int
        Forced set: oldest blocks (>= 1) and newest full blocks (>= 0) always kept, plus the
        current block.
    interval : int
        Decode tokens between eviction events once over budget.
    window, prefill_window : int
        W, the newest queries scored at decode and after a prefill chunk.
    chunk_size : int
        Prefill chunk in tokens; an event follows each chunk.
    skip_layers : int
        Layers below this index are not scored.
    layer_stride : int
        Score every ``layer_stride``-th layer from ``skip_layers`` on (1: every layer).
        Scoring costs rows x layers: ``configs/nexus-fast.yaml`` (16 prefill rows, every
        other layer) costs a quarter at prefill, for a small loss of quality
        (docs/results.md, "Cheaper scoring").
    indirect, prefill_indirect : str
        Nexus indirect mode at decode and at prefill.
    steps, lam, walk_rows, sampler, n, knorm_prior :
        Nexus knobs (see :class:`~nexus_vllm.core.policies.NexusPolicy`, which holds their
        defaults).
    seed : int
        Global seed; each request's generator is seeded from (seed, request seed).
    """

    method: str = "nexus"
    max_tokens: int | None = None
    keep_ratio: float | None = None
    block_size: int = 32
    sink_blocks: int = 1
    recent_blocks: int = 4
    interval: int = 16
    window: int = 16
    prefill_window: int = 32
    chunk_size: int = 512
    skip_layers: int = 2
    layer_stride: int = 1
    indirect: str = _policy_default(NexusPolicy, "indirect")
    prefill_indirect: str = "walk"
    steps: int = _policy_default(NexusPolicy, "steps")
    lam: float = _policy_default(NexusPolicy, "lam")
    walk_rows: str = _policy_default(NexusPolicy, "walk_rows")
    sampler: str = _policy_default(NexusPolicy, "sampler")
    n: int = _policy_default(NexusPolicy, "n")
    knorm_prior: float = _policy_default(NexusPolicy, "knorm_prior")
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("method", self.method, METHODS)
        if self.max_tokens is not None and self.keep_ratio is not None:
            raise ConfigError("max_tokens", "give at most one of max_tokens and keep_ratio")
        check_int("block_size", self.block_size, low=1)
        check_int("sink_blocks", self.sink_blocks, low=1)
        check_int("recent_blocks", self.recent_blocks, low=0)
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, low=1)
            floor = self.num_forced * self.block_size
            if self.max_tokens < floor:
                raise ConfigError(
                    "max_tokens",
                    f"max_tokens must be >= (sink_blocks + recent_blocks + 1) * block_size = "
                    f"{floor}; got {self.max_tokens}",
                )
        if self.keep_ratio is not None:
            check_float("keep_ratio", self.keep_ratio, low=0.0, high=1.0, low_open=True)
        check_int("interval", self.interval, low=1)
        check_int("window", self.window, low=1)
        check_int("prefill_window", self.prefill_window, low=1)
        check_int("chunk_size", self.chunk_size, low=1)
        check_int("skip_layers", self.skip_layers, low=0)
        check_int("layer_stride", self.layer_stride, low=1)
        check_indirect("prefill_indirect", self.prefill_indirect)
        check_int("seed", self.seed)
        # The policies validate their own knobs (one source of truth for ranges too).
        NexusPolicy(**self._knobs_for(NexusPolicy, prefill=False))

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvictionConfig:
        """Build from a mapping, rejecting unknown keys (typos must not pass silently)."""
        if not isinstance(data, dict):
            raise ConfigError("", f"eviction config must be a mapping; got "
                                  f"{type(data).__name__}")
        allowed = {f.name for f in fields(cls)}
        # key=repr: a YAML file may hold non-string keys, which do not sort with str.
        unknown = sorted(set(data) - allowed, key=repr)
        if unknown:
            hints = [f"{m[0]!r} for {k!r}" for k in unknown if isinstance(k, str)
                     for m in [difflib.get_close_matches(k, allowed, n=1)] if m]
            hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
            raise ConfigError(
                str(unknown[0]),
                f"unknown eviction config key(s) {unknown}{hint}; allowed: {sorted(allowed)}",
            )
        return cls(**data)

    @classmethod
    def from_budget(cls, method: str, budget: float | int, **knobs: Any) -> EvictionConfig:
        """The one budget rule: a float in (0, 1] is a keep ratio of the tokens seen, an int
        a token count (``max_tokens``).

        Raises
        ------
        ConfigError
            Naming ``budget`` when it is neither.
        """
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise ConfigError("budget", f"budget must be a float in (0, 1] or a positive int "
                                        f"number of tokens; got {budget!r}")
        if isinstance(budget, int):
            if budget < 1:
                raise ConfigError("budget", f"budget must be a positive token count; got "
                                            f"{budget}")
            return cls.from_dict({"method": method, "max_tokens": budget, **knobs})
        if not (math.isfinite(budget) and 0.0 < budget <= 1.0):
            raise ConfigError("budget", f"budget as a ratio must be in (0, 1]; got {budget}")
        return cls.from_dict({"method": method, "keep_ratio": float(budget), **knobs})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> EvictionConfig:
        """A copy with ``changes`` applied (validated; unknown keys rejected)."""
        merged = self.to_dict()
        unknown = sorted(set(changes) - set(merged))
        if unknown:
            raise ConfigError(unknown[0], f"unknown eviction config key(s) {unknown}")
        merged.update(changes)
        return EvictionConfig(**merged)

    # -- derived --------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.method != "none" and (
            self.max_tokens is not None or self.keep_ratio is not None
        )

    @property
    def num_forced(self) -> int:
        return self.sink_blocks + self.recent_blocks + 1

    def scored_layers(self, num_layers: int) -> range:
        """Indices of the layers whose attention is scored, of ``num_layers`` layers
        (empty when ``skip_layers`` leaves none)."""
        return range(self.skip_layers, num_layers, self.layer_stride)

    def budget_blocks(self, num_tokens_seen: int) -> int:
        """Blocks a sequence that has seen ``num_tokens_seen`` tokens may keep.

        ``max_tokens // block_size`` for a fixed budget, ``ceil(keep_ratio * blocks seen)``
        for a ratio; never below the forced set. Without a budget, every block.
        """
        check_int("num_tokens_seen", num_tokens_seen, low=0)
        seen_blocks = cdiv(num_tokens_seen, self.block_size)
        if self.max_tokens is not None:
            allowed = self.max_tokens // self.block_size
        elif self.keep_ratio is not None:
            allowed = math.ceil(self.keep_ratio * seen_blocks - 1e-9)
        else:
            return seen_blocks
        return max(allowed, self.num_forced)

    def policy(self, *, prefill: bool = False) -> EvictionPolicy:
        """The policy object for decode events, or for prefill-chunk events."""
        if self.method == "none":
            raise ValueError("method 'none' has no eviction policy")
        return get_policy(self.method, **self._knobs_for(POLICIES[self.method],
                                                         prefill=prefill))

    def _knobs_for(self, cls: type[EvictionPolicy], *, prefill: bool) -> dict[str, Any]:
        """This config's values of the knobs policy ``cls`` takes."""
        takes = {f.name for f in fields(cls)}
        knobs = {f.name: getattr(self, f.name) for f in fields(self)
                 if f.name in takes and f.name not in _ENGINE_FIELDS}
        if "indirect" in takes:
            knobs["indirect"] = self.prefill_indirect if prefill else self.indirect
        return knobs

    def generator(self, request_seed: int | str = 0) -> torch.Generator:
        """CPU generator seeded from (global seed, request seed): a recomputed (preempted)
        request draws the same evictions."""
        digest = hashlib.blake2b(f"{self.seed}:{request_seed}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
