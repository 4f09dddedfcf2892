"""``EvictionConfig``: the one validated description of an eviction setup.

The vLLM plugin, the transformers path and the evaluation harness all build their
policies and budgets from this, so a setting means the same thing everywhere. This is the
schema (fields, rules, parsing; a rule's ``ConfigError.reads`` names the fields it read);
the budget's arithmetic is :mod:`.budget`, each event's policy :mod:`.event_policies`.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TypeVar

import torch

from ._validate import ConfigError, check_choice, check_float, check_int
from .event_policies import EVENT_KINDS, EventPolicies, EventPolicyKind, build_event_policy
from .head_paged import GRANULARITIES, check_head_group, load_head_profile
from .head_scorer import load_head_scorer
from .policies import (
    METHODS,
    POLICIES,
    SHARED_KNOBS,
    EvictionPolicy,
    check_shared_knobs,
    forced_count,
    knob_owners,
    knob_refusal,
    no_head_score,
)
from .scoring import ATTENTION_REDUCES

__all__ = ["METHODS", "PROMPT_MODES", "RENAMED_FIELDS", "EvictionConfig"]

logger = logging.getLogger(__name__)

# When the budget holds: from the first prompt chunk (the paper's streaming setting), from
# the prompt's end (one event with the question in its window), or on generated tokens
# only (the prompt is never evicted).
PROMPT_MODES = ("stream", "end", "keep")
_PREFILL = "prefill_"
# Former names of fields, still accepted (each with a deprecation line, once per process)
# so that no config written for an earlier release breaks.
RENAMED_FIELDS = {"head_reduce": "attention_reduce", "prefill_window": "prompt_window"}
_warned_renamed: set[str] = set()
# What the budget floor (the forced set in tokens) reads, besides the budget itself.
_FLOOR_READS = ("block_size", "sink_blocks", "recent_blocks")
_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


def _current_names(data: Mapping[_Key, _Value]) -> dict[_Key | str, _Value]:
    """``data`` with former field names replaced by the current ones, in order (a later
    key wins over an earlier one, as in any merge of mappings)."""
    out: dict[_Key | str, _Value] = {}
    for key, value in data.items():
        if isinstance(key, str) and key in RENAMED_FIELDS:
            new = RENAMED_FIELDS[key]
            if key not in _warned_renamed:
                _warned_renamed.add(key)
                logger.warning("nexus-vllm: eviction config key %r is now %r; the old name "
                               "is still accepted and will go in a later release", key, new)
            out.pop(new, None)
            out[new] = value
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class EvictionConfig:
    """How one request's KV cache is kept within budget.

    Parameters
    ----------
    method : str
        ``"none"`` (no eviction) or a registered policy's name
        (:data:`~nexus_vllm.core.policies.POLICIES`).
    max_tokens : int, optional
        Fixed budget in tokens (the cache never grows past it).
    keep_ratio : float, optional
        Budget as a fraction in (0, 1] of the tokens seen so far. At most one of
        ``max_tokens`` and ``keep_ratio``; with neither, nothing is evicted.
    prompt_mode : {"stream", "end", "keep"}
        When the budget holds. ``stream`` (the paper's setting): from the first prompt
        chunk, an event after every chunk. ``end``: the prompt is computed under the looser
        ``prefill_budget``, then one event after its last chunk evicts down to the budget,
        with the prompt's last ``prompt_window`` tokens (the question) as its window.
        ``keep``: the prompt is never evicted; the budget counts generated tokens only.
        Decode events are the same in every mode.
    prefill_budget : int, optional
        ``end`` only: tokens a sequence may keep while its prompt is computed (default:
        the whole prompt). At least the budget.
    block_size : int
        Tokens per block (a vLLM KV block; 32 on CPU vLLM and for small models).
    sink_blocks, recent_blocks : int
        Forced set: oldest blocks (>= 1) and newest full blocks (>= 0) always kept, plus the
        current block (defaults: every policy's, :data:`~nexus_vllm.core.policies.\
SHARED_KNOBS`, as ``carry``'s).
    carry : int
        Policies that read attention mass raise each block's weight to that of the
        ``carry`` blocks before it (a fact found in one block often ends in the next;
        :func:`~nexus_vllm.core.policies.carry_forward`). 0: off.
    attention_reduce : {"mean", "max"}
        How the scored heads' and layers' attention becomes the evidence: their mean, or
        their maximum with rows renormalised and each row's total kept
        (:meth:`~nexus_vllm.core.evidence.Evidence.from_gathered`).
    interval : int
        Decode tokens between eviction events once over budget.
    window, prompt_window : int
        W, the newest queries scored at decode and at prefill events (after a prompt
        chunk; at the prompt-end event, the prompt's last ``prompt_window`` tokens).
    chunk_size : int
        Prefill chunk in tokens; an event follows each chunk (that leaves the sequence
        over its target). Where no event can fire before the prompt's end
        (:func:`~nexus_vllm.core.budget.evicts_mid_prompt` false) a server leaves the
        chunking to vLLM and runs with vLLM's own per-step cap here, which bounds nothing
        but the last chunk.
    skip_layers : int
        Layers below this index are not scored.
    layer_stride : int
        Score every ``layer_stride``-th layer from ``skip_layers`` on (1: every layer).
        Scoring costs rows x layers: ``configs/nexus-fast.yaml`` (16 prefill rows, every
        other layer) costs a quarter at prefill, for a small loss of quality
        (docs/results.md, "Cheaper scoring").
    policy_args : Mapping[str, object]
        The chosen policy's knobs (:meth:`EvictionPolicy.knobs`, e.g. Nexus's ``steps``,
        ``sampler``, ``eps``); empty: the policy's own defaults. :meth:`from_dict`,
        :meth:`replace` and :meth:`from_budget` also take them as top-level keys
        (``{"method": "nexus", "steps": 5}``).
    prefill_args : Mapping[str, object]
        Knob overrides at prefill events (after prompt chunks, and the prompt-end event),
        over ``policy_args`` and the policy's declared prefill defaults
        (:func:`~nexus_vllm.core.event_policies.event_knobs`); top-level
        ``prefill_<knob>`` keys land here.
    seed : int
        Global seed; each request's generator is seeded from (seed, request seed).
    granularity : {"block", "head"}
        What an event keeps or drops. ``block``: one block set for every layer and KV
        head. ``head``: each (layer, KV head) keeps its own tokens, chosen by one threshold
        over every (layer, head, token) unit of the policy's per-head score
        (:mod:`~nexus_vllm.core.head_paged`), packed into head-blocks within the same
        memory as ``block``; every full-attention layer is scored (``skip_layers`` and
        ``layer_stride`` are block granularity's). The transformers path runs it; the
        vLLM server does not yet.
    head_group : int
        Under ``head``: tokens scored as one unit (aligned logical positions; a divisor of
        ``block_size``). 1: every token on its own.
    head_profile : str, optional
        Under ``head``: a fixed allocation over (layer, KV head), calibrated offline for
        the model (a shipped profile's name or a JSON file,
        :func:`~nexus_vllm.core.head_paged.load_head_profile`); each head then keeps its
        share of the budget, its own best entries in it. None: one threshold per event.
    head_scorer : str, optional
        Under ``head``, for a policy that reads the ``reconstruction`` evidence: the
        learned stand-in for KVzip's reconstruction score (a shipped scorer's name or a
        ``.pt`` file, :func:`~nexus_vllm.core.head_scorer.load_head_scorer`). None: the
        one shipped for the model, by the model's name.
    """

    method: str = "nexus"
    max_tokens: int | None = None
    keep_ratio: float | None = None
    prompt_mode: str = "end"
    prefill_budget: int | None = None
    block_size: int = 32
    sink_blocks: int = SHARED_KNOBS["sink_blocks"]
    recent_blocks: int = SHARED_KNOBS["recent_blocks"]
    carry: int = SHARED_KNOBS["carry"]
    attention_reduce: str = "max"
    interval: int = 16
    window: int = 16
    prompt_window: int = 32
    chunk_size: int = 512
    skip_layers: int = 2
    layer_stride: int = 1
    # Plain dicts (copied here): the config travels as JSON through vLLM's
    # additional_config and is compared, never hashed.
    policy_args: Mapping[str, object] = field(default_factory=dict)
    prefill_args: Mapping[str, object] = field(default_factory=dict)
    seed: int = 0
    granularity: str = "block"
    head_group: int = 1
    head_profile: str | None = None
    head_scorer: str | None = None

    def __post_init__(self) -> None:
        check_choice("method", self.method, METHODS)
        if self.max_tokens is not None and self.keep_ratio is not None:
            raise ConfigError("max_tokens", "give at most one of max_tokens and keep_ratio",
                              reads=("keep_ratio",))
        check_int("block_size", self.block_size, low=1)
        check_shared_knobs(self.sink_blocks, self.recent_blocks, self.carry)
        check_choice("attention_reduce", self.attention_reduce, ATTENTION_REDUCES)
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, low=1)
            floor = self.forced_tokens
            if self.max_tokens < floor:
                raise ConfigError(
                    "max_tokens",
                    f"max_tokens must be >= (sink_blocks + recent_blocks + 1) * block_size = "
                    f"{floor}; got {self.max_tokens}", reads=_FLOOR_READS)
        if self.keep_ratio is not None:
            check_float("keep_ratio", self.keep_ratio, low=0.0, high=1.0, low_open=True)
        check_choice("prompt_mode", self.prompt_mode, PROMPT_MODES)
        if self.prefill_budget is not None:
            if self.prompt_mode != "end":
                raise ConfigError("prefill_budget", f"prefill_budget applies to prompt_mode "
                                  f"'end' only; prompt_mode is {self.prompt_mode!r}",
                                  reads=("prompt_mode",))
            check_int("prefill_budget", self.prefill_budget, low=1)
            floor = max(self.max_tokens or 0, self.forced_tokens)
            if self.prefill_budget < floor:
                raise ConfigError("prefill_budget", f"prefill_budget must be at least the "
                                  f"budget ({floor} tokens); got {self.prefill_budget}",
                                  reads=("max_tokens", *_FLOOR_READS))
        check_int("interval", self.interval, low=1)
        check_int("window", self.window, low=1)
        check_int("prompt_window", self.prompt_window, low=1)
        check_int("chunk_size", self.chunk_size, low=1)
        check_int("skip_layers", self.skip_layers, low=0)
        check_int("layer_stride", self.layer_stride, low=1)
        check_int("seed", self.seed)
        check_choice("granularity", self.granularity, GRANULARITIES)
        check_head_group(self.head_group, self.block_size)
        if self.head_profile is not None:
            if self.granularity != "head":
                raise ConfigError("head_profile", "head_profile allocates per (layer, KV "
                                  "head): it needs granularity 'head'", reads=("granularity",))
            load_head_profile(self.head_profile)
        if self.head_scorer is not None:
            if self.granularity != "head":
                raise ConfigError("head_scorer", "head_scorer scores per (layer, KV head): "
                                  "it needs granularity 'head'", reads=("granularity",))
            load_head_scorer(self.head_scorer)
        for name in ("policy_args", "prefill_args"):
            value = getattr(self, name)
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                raise ConfigError(name, f"{name} must be a mapping of knob names to values; "
                                        f"got {value!r}")
            object.__setattr__(self, name, dict(value))
        self._check_policy_args()

    def _check_policy_args(self) -> None:
        """Validate every knob now, decode and prefill, by building each event's policy
        (:meth:`event_policy`): a bad one fails at startup, naming ``policy_args.<knob>``
        or ``prefill_args.<knob>``, not at every eviction event."""
        if self.method == "none":
            for name in ("policy_args", "prefill_args"):
                if getattr(self, name):
                    raise ConfigError(name, f"method 'none' runs no policy, so it takes no "
                                            f"{name}; got {getattr(self, name)!r}",
                                      reads=("method",))
            return
        takes = POLICIES[self.method].knobs()
        for name in ("policy_args", "prefill_args"):
            for knob in getattr(self, name):
                if knob not in takes:
                    raise ConfigError(f"{name}.{knob}",
                                      f"{name}.{knob}: {knob_refusal(knob, self.method)}",
                                      reads=("method",))
        for kind in EVENT_KINDS:
            try:
                policy = self.event_policy(kind)
            except ConfigError:
                raise
            except (TypeError, ValueError) as exc:
                raise ConfigError("policy_args", f"policy_args: {exc}") from None
            if self.granularity == "head" and not policy.head_needs:
                raise ConfigError("granularity", no_head_score(policy), reads=("method",))
            if self.granularity != "head" and policy.head_only:
                raise ConfigError("method", f"policy {policy.name!r} scores "
                                  "(layer, KV head, token) units only: it needs "
                                  "granularity 'head'", reads=("granularity",))

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> EvictionConfig:
        """Build from a mapping, rejecting unknown keys (typos must not pass silently).

        Besides the fields, a knob of the chosen policy may be a top-level key
        (``{"method": "nexus", "steps": 5}``, as the presets write them) and goes to
        ``policy_args``; ``prefill_<knob>`` goes to ``prefill_args`` (None: the policy's
        prefill default). Top-level knobs override the same knob in ``policy_args``.

        Raises
        ------
        ConfigError
            An unknown key (with a close match as a hint), or a knob of another policy
            than ``method`` (naming the policy it belongs to), or any bad value.
        """
        if not isinstance(data, Mapping):
            raise ConfigError("", f"eviction config must be a mapping; got "
                                  f"{type(data).__name__}")
        data = _current_names(data)
        method = data.get("method", cls.method)
        check_choice("method", method, METHODS)
        assert isinstance(method, str)  # check_choice passed: a method's name
        takes = POLICIES[method].knobs() if method in POLICIES else ()
        allowed = {f.name for f in fields(cls)}
        out: dict[str, object] = {}
        lifted: dict[str, dict[str, object]] = {"policy_args": {}, "prefill_args": {}}
        unknown = []
        for key, value in data.items():
            if key in allowed:
                out[key] = value
                continue
            if not isinstance(key, str):
                unknown.append(key)
                continue
            prefill = key.startswith(_PREFILL)
            knob = key[len(_PREFILL):] if prefill else key
            if knob in takes:
                if not (prefill and value is None):
                    lifted["prefill_args" if prefill else "policy_args"][knob] = value
            elif knob_owners(knob):
                if method == "none":
                    continue  # no policy runs: the knobs a preset was written with are moot
                raise ConfigError(key, f"{key}: {knob_refusal(knob, method)}")
            else:
                unknown.append(key)
        if unknown:
            # key=repr: a YAML file may hold non-string keys, which do not sort with str.
            unknown.sort(key=repr)
            names = sorted(allowed | set(takes))
            candidates = names + [_PREFILL + k for k in takes]
            hints = [f"{m[0]!r} for {k!r}" for k in unknown if isinstance(k, str)
                     for m in [difflib.get_close_matches(k, candidates, n=1)] if m]
            hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
            also = f", and prefill_<knob> for the {method} knobs" if takes else ""
            raise ConfigError(
                str(unknown[0]),
                f"unknown eviction config key(s) {unknown}{hint}; allowed: {names}{also}",
            )
        for name, knobs in lifted.items():
            given = out.get(name, {})
            if knobs and isinstance(given, Mapping):  # a non-mapping fails in __post_init__
                out[name] = {**given, **knobs}
        # Called with the values as given: __post_init__ checks every one.
        build: Callable[..., EvictionConfig] = cls
        try:
            return build(**out)
        except ConfigError as exc:
            # Name a knob the way it was given: a top-level key keeps its own name.
            source, _, knob = exc.field.partition(".")
            written = {"policy_args": knob, "prefill_args": _PREFILL + knob}.get(source)
            if written is None or knob not in lifted.get(source, {}):
                raise
            msg = str(exc)
            msg = written + msg[len(exc.field):] if msg.startswith(exc.field) else msg
            raise ConfigError(written, msg) from None

    @classmethod
    def from_budget(cls, method: str, budget: float | int, **knobs: object) -> EvictionConfig:
        """The one budget rule: a float in (0, 1] is a keep ratio of the tokens seen, an int
        a token count (``max_tokens``). ``knobs`` are any :meth:`from_dict` keys.

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

    def to_dict(self) -> dict[str, object]:
        """Plain, JSON-serialisable fields; :meth:`from_dict` rebuilds an equal config."""
        return {f.name: dict(v) if isinstance(v := getattr(self, f.name), Mapping) else v
                for f in fields(self)}

    def replace(self, **changes: object) -> EvictionConfig:
        """A copy with ``changes`` applied: any :meth:`from_dict` keys, validated. A new
        ``method`` starts from its policy's defaults (the old policy's knobs mean nothing
        to it) unless ``changes`` gives its knobs."""
        merged = self.to_dict()
        changes = _current_names(changes)
        if changes.get("method", self.method) != self.method:
            merged["policy_args"], merged["prefill_args"] = {}, {}
        merged.update(changes)
        return EvictionConfig.from_dict(merged)

    # -- derived --------------------------------------------------------------------
    @property
    def num_forced(self) -> int:
        return forced_count(self.sink_blocks, self.recent_blocks)

    @property
    def forced_tokens(self) -> int:
        """The always-kept blocks (sink, recent and current) in tokens: the least budget
        a config allows."""
        return self.num_forced * self.block_size

    def scored_layers(self, num_layers: int) -> range:
        """Indices of the layers whose attention is scored, of ``num_layers`` layers
        (empty when ``skip_layers`` leaves none)."""
        return range(self.skip_layers, num_layers, self.layer_stride)

    def event_policy(self, kind: EventPolicyKind, prompt_tokens: int = 0
                     ) -> EvictionPolicy:
        """The policy of events of ``kind`` (:func:`~nexus_vllm.core.event_policies.\
build_event_policy`; a config that wraps its policies overrides this)."""
        return build_event_policy(self, kind, prompt_tokens)

    def event_policies(self, prompt_tokens: int = 0) -> EventPolicies:
        """The policy of each event kind of a request whose prompt is ``prompt_tokens``
        long (in ``keep`` mode its blocks join the sinks), resolved once: what a request
        holds for its life."""
        return EventPolicies(**{kind: self.event_policy(kind, prompt_tokens)
                                for kind in EVENT_KINDS})

    def evidence_kinds(self) -> frozenset[str]:
        """Every evidence kind this config's events read (decode and prefill events)."""
        if self.method == "none":
            return frozenset()
        return self.event_policies().needs

    def generator(self, request_seed: int | str = 0) -> torch.Generator:
        """CPU generator seeded from (global seed, request seed): a recomputed (preempted)
        request draws the same evictions."""
        digest = hashlib.blake2b(f"{self.seed}:{request_seed}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))

