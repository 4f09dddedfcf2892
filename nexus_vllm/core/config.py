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
from .sampling import SAMPLERS
from .scoring import cdiv
from .weights import check_indirect

__all__ = ["METHODS", "PROMPT_MODES", "EvictionConfig"]

METHODS = ("none", *POLICIES)
# When the budget holds: from the first prompt chunk (the paper's streaming setting), from
# the prompt's end (one event with the question in its window), or on generated tokens
# only (the prompt is never evicted).
PROMPT_MODES = ("stream", "end", "keep")
# Engine-level fields that policies do not take; every other field a policy class also
# declares is passed to it by policy() (the policy's own default is the field's default).
_ENGINE_FIELDS = ("method", "max_tokens", "keep_ratio", "prompt_mode", "prefill_budget",
                  "block_size", "interval", "window", "prefill_window", "chunk_size",
                  "skip_layers", "layer_stride", "indirect", "prefill_indirect", "sampler",
                  "prefill_sampler", "seed")


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
    prompt_mode : {"stream", "end", "keep"}
        When the budget holds. ``stream`` (the paper's setting): from the first prompt
        chunk, an event after every chunk. ``end``: the prompt is computed under the looser
        ``prefill_budget``, then one event after its last chunk evicts down to the budget,
        with the prompt's last ``prefill_window`` tokens (the question) as its window.
        ``keep``: the prompt is never evicted; the budget counts generated tokens only.
        Decode events are the same in every mode.
    prefill_budget : int, optional
        ``end`` only: tokens a sequence may keep while its prompt is computed (default:
        the whole prompt). At least the budget.
    block_size : int
        Tokens per block (a vLLM KV block; 32 on CPU vLLM and for small models).
    sink_blocks, recent_blocks : int
        Forced set: oldest blocks (>= 1) and newest full blocks (>= 0) always kept, plus the
        current block.
    interval : int
        Decode tokens between eviction events once over budget.
    window, prefill_window : int
        W, the newest queries scored at decode and at prefill events (after a prompt
        chunk; at the prompt-end event, the prompt's last ``prefill_window`` tokens).
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
        Nexus indirect mode at decode and at prefill events (after prompt chunks, and the
        prompt-end event). ``prefill_indirect`` None: ``none`` in ``end`` mode, else
        ``walk`` (:attr:`prefill_knobs`).
    sampler, prefill_sampler : str
        Nexus sampler at decode and at prefill events. ``prefill_sampler`` None: top-K in
        ``end`` mode, else ``sampler``.
    steps, lam, walk_rows, n, knorm_prior :
        Nexus knobs (see :class:`~nexus_vllm.core.policies.NexusPolicy`, which holds their
        defaults).
    seed : int
        Global seed; each request's generator is seeded from (seed, request seed).
    """

    method: str = "nexus"
    max_tokens: int | None = None
    keep_ratio: float | None = None
    prompt_mode: str = "stream"
    prefill_budget: int | None = None
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
    prefill_indirect: str | None = None
    steps: int = _policy_default(NexusPolicy, "steps")
    lam: float = _policy_default(NexusPolicy, "lam")
    walk_rows: str = _policy_default(NexusPolicy, "walk_rows")
    sampler: str = _policy_default(NexusPolicy, "sampler")
    prefill_sampler: str | None = None
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
        check_choice("prompt_mode", self.prompt_mode, PROMPT_MODES)
        if self.prefill_budget is not None:
            if self.prompt_mode != "end":
                raise ConfigError("prefill_budget", f"prefill_budget applies to prompt_mode "
                                  f"'end' only; prompt_mode is {self.prompt_mode!r}")
            check_int("prefill_budget", self.prefill_budget, low=1)
            floor = max(self.max_tokens or 0, self.num_forced * self.block_size)
            if self.prefill_budget < floor:
                raise ConfigError("prefill_budget", f"prefill_budget must be at least the "
                                  f"budget ({floor} tokens); got {self.prefill_budget}")
        check_int("interval", self.interval, low=1)
        check_int("window", self.window, low=1)
        check_int("prefill_window", self.prefill_window, low=1)
        check_int("chunk_size", self.chunk_size, low=1)
        check_int("skip_layers", self.skip_layers, low=0)
        check_int("layer_stride", self.layer_stride, low=1)
        if self.prefill_indirect is not None:
            check_indirect("prefill_indirect", self.prefill_indirect)
        if self.prefill_sampler is not None:
            check_choice("prefill_sampler", self.prefill_sampler, SAMPLERS)
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

    # -- the budget over a request's life: the one rule for the plugin, the transformers
    # path, admission and the capacity planner ---------------------------------------
    def target_blocks(self, tokens: int, prompt_tokens: int) -> int:
        """Blocks a sequence may keep once ``tokens`` of its tokens are computed, its prompt
        being ``prompt_tokens`` long (``tokens < prompt_tokens``: mid-prefill).

        ``stream``: :meth:`budget_blocks` throughout. ``end``: ``prefill_budget`` (none:
        every block) until the prompt is computed, then the budget. ``keep``: every prompt
        block plus the budget over the generated tokens.
        """
        if self.prompt_mode == "stream":
            return self.budget_blocks(tokens)
        if tokens < prompt_tokens:
            if self.prompt_mode == "end" and self.prefill_budget is not None:
                return max(self.prefill_budget // self.block_size, self.num_forced)
            return cdiv(tokens, self.block_size)
        if self.prompt_mode == "end":
            return self.budget_blocks(tokens)
        return self.prompt_blocks(prompt_tokens) + self.budget_blocks(tokens - prompt_tokens)

    def prompt_blocks(self, prompt_tokens: int) -> int:
        """Blocks forced to stay besides the forced set: the prompt's, in ``keep`` mode."""
        return cdiv(prompt_tokens, self.block_size) if self.prompt_mode == "keep" else 0

    @property
    def chunk_blocks(self) -> int:
        return cdiv(self.chunk_size, self.block_size)

    def hard_limit(self, tokens: int, prompt_tokens: int) -> int:
        """Most blocks a sequence may hold once ``tokens`` are computed, before the event
        that may follow: the target it was computed under plus one prefill chunk (an event
        follows every chunk; decoding fires one at once on reaching this). In ``end`` mode
        the prompt's last chunk is computed under the prefill target, so at the prompt's
        end this is the prompt's peak, not the budget's."""
        if self.prompt_mode == "end" and tokens <= prompt_tokens:
            return self.target_blocks(min(tokens, prompt_tokens - 1), prompt_tokens) \
                + self.chunk_blocks
        return self.target_blocks(tokens, prompt_tokens) + self.chunk_blocks

    def bound_blocks(self, prompt_tokens: int, total_tokens: int) -> int:
        """Most blocks a request of ``prompt_tokens`` growing to ``total_tokens`` ever holds
        (what admission reserves): the larger of its prompt's peak and its final hard
        limit, never more than the whole sequence."""
        seq_blocks = cdiv(total_tokens, self.block_size)
        prompt_peak = min(cdiv(prompt_tokens, self.block_size),
                          self.hard_limit(prompt_tokens, prompt_tokens))
        last = max(total_tokens, prompt_tokens + 1)
        return min(seq_blocks, max(prompt_peak, self.hard_limit(last, prompt_tokens)))

    def peak_from(self, tokens: int, prompt_tokens: int, total_tokens: int) -> int:
        """Most blocks a request may still come to hold once ``tokens`` are computed (what
        admission keeps reserved for it). Before the prompt's end, :meth:`bound_blocks`;
        after it, the decode hard limit: an ``end`` request that has shed its prompt no
        longer needs the prompt's peak."""
        if tokens < prompt_tokens:
            return self.bound_blocks(prompt_tokens, total_tokens)
        last = max(total_tokens, prompt_tokens + 1)
        return min(cdiv(total_tokens, self.block_size), self.hard_limit(last, prompt_tokens))

    def policy(self, *, prefill: bool = False, prompt_tokens: int = 0) -> EvictionPolicy:
        """The policy object for decode events, or for prefill events (after a prompt
        chunk, and the prompt-end event). In ``keep`` mode the prompt's blocks
        (``prompt_tokens``) join the sinks, so no event evicts them."""
        if self.method == "none":
            raise ValueError("method 'none' has no eviction policy")
        knobs = self._knobs_for(POLICIES[self.method], prefill=prefill)
        knobs["sink_blocks"] = max(self.sink_blocks, self.prompt_blocks(prompt_tokens))
        return get_policy(self.method, **knobs)

    def _knobs_for(self, cls: type[EvictionPolicy], *, prefill: bool) -> dict[str, Any]:
        """This config's values of the knobs policy ``cls`` takes."""
        takes = {f.name for f in fields(cls)}
        knobs = {f.name: getattr(self, f.name) for f in fields(self)
                 if f.name in takes and f.name not in _ENGINE_FIELDS}
        if "indirect" in takes:
            knobs["indirect"] = self.prefill_knobs[0] if prefill else self.indirect
        if "sampler" in takes:
            knobs["sampler"] = self.prefill_knobs[1] if prefill else self.sampler
        return knobs

    @property
    def prefill_knobs(self) -> tuple[str, str]:
        """Nexus ``(indirect, sampler)`` at prefill events. Unset, they are ``("walk",
        sampler)``, the paper's; in ``end`` mode ``("none", "topk")``: at its one decisive
        event, with the question in the window, direct attention and top-K keep the
        needle where the walk and pps's hedging drop it (docs/algorithm.md, "The
        prompt-end event")."""
        end = self.prompt_mode == "end"
        indirect = self.prefill_indirect or ("none" if end else "walk")
        sampler = self.prefill_sampler or ("topk" if end else self.sampler)
        return indirect, sampler

    def generator(self, request_seed: int | str = 0) -> torch.Generator:
        """CPU generator seeded from (global seed, request seed): a recomputed (preempted)
        request draws the same evictions."""
        digest = hashlib.blake2b(f"{self.seed}:{request_seed}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
