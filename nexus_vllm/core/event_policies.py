"""Which policy, with which knobs, each kind of eviction event of a request runs.

An event is one of three kinds: ``decode`` (after a decode step), ``prefill`` (after a
prompt chunk that does not end the prompt) and ``prompt_end`` (after the prompt's last
chunk: in ``stream`` the one prompt event that sees the question). Each kind's knobs are
overlaid here and nowhere else (:func:`event_knobs`), and each kind's policy is built here
and nowhere else (:func:`build_event_policy`). A request resolves the three once into a
frozen :class:`EventPolicies` (:meth:`EvictionConfig.event_policies`), which the
scheduler's request state and the transformers session hold and select from by the
trigger's event kind (:meth:`EventPolicies.at`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

from ._validate import ConfigError
from .policies import POLICIES, EvictionPolicy
from .scoring import cdiv

if TYPE_CHECKING:
    from .config import EvictionConfig

__all__ = ["EVENT_KINDS", "EventPolicies", "EventPolicyKind", "build_event_policy",
           "event_kind", "event_knobs"]

EventPolicyKind = Literal["decode", "prefill", "prompt_end"]
# The three kinds, in the order a table lists them.
EVENT_KINDS: tuple[EventPolicyKind, ...] = ("decode", "prefill", "prompt_end")


def event_kind(*, prefill: bool, prompt_end: bool) -> EventPolicyKind:
    """The kind of an event after a prefill or decode step; ``prompt_end`` (the step
    computed the prompt's last token, :meth:`EvictionTrigger.ends_prompt`) only counts
    after a prefill step."""
    if not prefill:
        return "decode"
    return "prompt_end" if prompt_end else "prefill"


def event_knobs(cfg: EvictionConfig, kind: EventPolicyKind) -> dict[str, object]:
    """The knobs the config's policy runs with at events of ``kind``.

    ``policy_args`` (over the policy's declared ``stream_defaults`` in ``prompt_mode``
    ``stream``) at decode events; at prefill events (after a prompt chunk, and the
    prompt-end event) overridden by the policy's declared defaults for the event
    (``prompt_end_defaults`` at the prompt-end event, and at every prefill event in
    ``end``, whose events all see the prompt's end; else ``prefill_defaults``), then by
    ``prefill_args``. A knob named nowhere takes the policy's own default. ``end`` and
    ``keep`` treat every prefill event alike.
    """
    if cfg.method == "none":
        raise ValueError("method 'none' has no eviction policy")
    cls = POLICIES[cfg.method]
    knobs: dict[str, object] = dict(cls.stream_defaults) if cfg.prompt_mode == "stream" \
        else {}
    knobs.update(cfg.policy_args)
    if kind != "decode":
        at_end = cfg.prompt_mode == "end" or (kind == "prompt_end"
                                              and cfg.prompt_mode == "stream")
        knobs.update(cls.prompt_end_defaults if at_end else cls.prefill_defaults)
        knobs.update(cfg.prefill_args)
    return knobs


def build_event_policy(cfg: EvictionConfig, kind: EventPolicyKind,
                       prompt_tokens: int = 0) -> EvictionPolicy:
    """The one place an event's policy is built: the config's method with
    :func:`event_knobs` and the config's forced set. In ``keep`` mode the prompt's blocks
    (``prompt_tokens``) join the sinks, so no event evicts them.

    Raises
    ------
    ConfigError
        A bad knob, named ``policy_args.<knob>`` or ``prefill_args.<knob>`` (where the
        event's value came from).
    """
    knobs = event_knobs(cfg, kind)
    prompt_blocks = cdiv(prompt_tokens, cfg.block_size) if cfg.prompt_mode == "keep" else 0
    try:
        return POLICIES[cfg.method](sink_blocks=max(cfg.sink_blocks, prompt_blocks),
                                    recent_blocks=cfg.recent_blocks, carry=cfg.carry,
                                    **knobs)
    except (TypeError, ValueError) as exc:
        knob = str(getattr(exc, "field", ""))
        source = "prefill_args" if kind != "decode" and knob in cfg.prefill_args \
            else "policy_args"
        qualified = f"{source}.{knob}" if knob else source
        msg = str(exc)
        msg = qualified + msg[len(knob):] if knob and msg.startswith(knob) \
            else f"{qualified}: {msg}"
        raise ConfigError(qualified, msg) from None


@dataclass(frozen=True)
class EventPolicies:
    """The policy of each event kind of one request, resolved once
    (:meth:`EvictionConfig.event_policies`)."""

    decode: EvictionPolicy
    prefill: EvictionPolicy
    prompt_end: EvictionPolicy

    def at(self, *, prefill: bool, prompt_end: bool = False) -> EvictionPolicy:
        """The policy of an event after a prefill (``prefill``) or decode step;
        ``prompt_end``: the prefill step computed the prompt's last token."""
        policy: EvictionPolicy = getattr(self, event_kind(prefill=prefill,
                                                          prompt_end=prompt_end))
        return policy

    def items(self) -> Iterator[tuple[EventPolicyKind, EvictionPolicy]]:
        """``(kind, policy)`` in :data:`EVENT_KINDS` order."""
        return ((kind, getattr(self, kind)) for kind in EVENT_KINDS)

    def map(self, wrap: Callable[[EvictionPolicy], EvictionPolicy]) -> EventPolicies:
        """Each kind's policy passed through ``wrap``."""
        return EventPolicies(**{kind: wrap(policy) for kind, policy in self.items()})

    @property
    def needs(self) -> frozenset[str]:
        """Every evidence kind some event reads (at block granularity)."""
        return frozenset().union(*(p.needs for _, p in self.items()))

    @property
    def head_needs(self) -> frozenset[str]:
        """Every per-head evidence kind some event reads (at head granularity)."""
        return frozenset().union(*(p.head_needs for _, p in self.items()))

    @property
    def stochastic(self) -> bool:
        """Whether some event's choice depends on the generator."""
        return any(p.stochastic for _, p in self.items())

    def table(self, granularity: str = "block") -> str:
        """A plain-text table, one row per event kind: the policy, its forced set and
        carry, the evidence it reads at ``granularity`` and every knob's value."""
        rows = [("event", "policy", "sink/recent/carry", "reads", "knobs")]
        for kind, policy in self.items():
            knobs = ", ".join(f"{f.name}={getattr(policy, f.name)!r}"
                              for f in fields(policy) if f.name in type(policy).knobs())
            needs = policy.head_needs if granularity == "head" else policy.needs
            reads = ", ".join(sorted(needs)) or "-"
            rows.append((kind, policy.name, f"{policy.sink_blocks}/{policy.recent_blocks}/"
                         f"{policy.carry}", reads, knobs or "-"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)),
                                    row[-1]]).rstrip() for row in rows)
