"""A :class:`~nexus_vllm.hf.streaming.StreamingSession`'s per-head bookkeeping at head
granularity (:mod:`nexus_vllm.core.head_paged`): which cache slots each (full layer, KV
head) holds, the best score each entry has had, and the per-head evidence of an event.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeGuard

import torch

from nexus_vllm.core import EvictionConfig, EvictionPolicy, Rotary
from nexus_vllm.core._validate import ConfigError
from nexus_vllm.core.event_policies import EventPolicies
from nexus_vllm.core.head_paged import (
    HeadEvidence,
    head_expected_attention,
    head_key_norms,
    head_window_attention,
    load_head_profile,
)
from nexus_vllm.core.head_pages import select_packed
from nexus_vllm.core.head_scorer import HeadScorer, load_head_scorer, shipped_head_scorers
from nexus_vllm.hf.capture import has_attention_sinks

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["HeadLedger"]


@dataclass
class HeadLedger:
    """A session's per-head bookkeeping at head granularity.

    Attributes
    ----------
    layers : list of int
        The full-attention layers (the ones evicted), in order.
    live : BoolTensor[len(layers), Hkv, T]
        Which cache slots each (layer, KV head) still attends to.
    best : Tensor[len(layers), Hkv, T]
        The largest score each entry has had at any event (-inf before its first): an
        entry keeps what its own chunk's queries saw in it once later rows look away.
    scales : dict of int to float
        Each layer's attention logit scale (the module's ``scaling``).
    shares : Tensor[len(layers), Hkv] or None
        The config's ``head_profile``: a fixed allocation over the heads.
    scorer : HeadScorer or None
        When an event's policy reads the ``reconstruction`` evidence: the learned
        stand-in (the config's ``head_scorer``, or the one shipped for the model).
    estimate : Tensor[len(layers), Hkv, T] or None
        The scorer's prediction for every slot, made when its token was fed.
    """

    layers: list[int]
    live: torch.Tensor
    best: torch.Tensor
    scales: dict[int, float]
    shares: torch.Tensor | None = None
    scorer: HeadScorer | None = None
    estimate: torch.Tensor | None = None

    @classmethod
    def start(cls, model: PreTrainedModel, full_layers: list[int], latent: bool,
              config: EvictionConfig, policies: EventPolicies) -> HeadLedger:
        """The ledger of a session with no slot yet; ``policies``: the session's, whose
        reading the ``reconstruction`` evidence loads the head scorer."""
        if latent:
            raise ValueError("granularity 'head' needs KV heads; an MLA model caches one "
                             "latent row per token (use granularity 'block')")
        if has_attention_sinks(model):
            raise ValueError("granularity 'head' masks SDPA's attention; a model with "
                             "attention sinks attends eagerly (use granularity 'block')")
        text = model.config.get_text_config(decoder=True)
        hkv = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        scales = {int(m.layer_idx): float(m.scaling) for m in model.modules()
                  if _is_scaled_attention(m)}
        shape = (len(full_layers), hkv, 0)
        shares = None
        profile = config.head_profile
        if profile is not None:
            shares = load_head_profile(profile).tensor()
            if tuple(shares.shape) != shape[:2]:
                raise ValueError(f"head_profile {profile!r} allocates over "
                                 f"{tuple(shares.shape)} (layers, KV heads); this model has "
                                 f"{shape[:2]}")
        scorer = None
        if "reconstruction" in policies.head_needs:
            scorer = _head_scorer_for(model, config.head_scorer, len(full_layers), hkv)
        return cls(layers=list(full_layers), live=torch.zeros(shape, dtype=torch.bool),
                   best=torch.zeros(shape), scales=scales, shares=shares, scorer=scorer,
                   estimate=torch.zeros(shape) if scorer is not None else None)

    @classmethod
    def after_dense(cls, model: PreTrainedModel, full_layers: list[int], latent: bool,
                    config: EvictionConfig, policies: EventPolicies, cached: int
                    ) -> HeadLedger:
        """The ledger of a dense session's ``cached`` slots forked into ``config``
        (``StreamingSession.with_config``): every slot live in every head."""
        ledger = cls.start(model, full_layers, latent, config, policies)
        if ledger.scorer is not None:
            # Its estimates are made as tokens are fed, from inputs not kept after.
            raise ValueError("the reconstruction stand-in scores tokens as they are "
                             "fed: run the session under its config from the start")
        ledger.append(cached)
        return ledger

    def evidence(self, kinds: frozenset[str], rows: list[torch.Tensor],
                 keys: list[torch.Tensor], seen: int, rotary: Rotary | None
                 ) -> HeadEvidence:
        """Each per-head kind in ``kinds`` over every layer's live entries, from each
        layer's query ``rows`` (``[W, Hq, D]``) and cached ``keys`` (``[T, Hkv, D]``),
        ``seen`` tokens fed; ``rotary`` for ``expected_attention``."""
        live = self.live
        per_kind: dict[str, list[torch.Tensor]] = {k: [] for k in sorted(kinds)}
        for i, li in enumerate(self.layers):
            if "mass" in per_kind:
                per_kind["mass"].append(head_window_attention(
                    rows[i], keys[i], live[i], scale=self.scales.get(li)))
            if "expected_attention" in per_kind:
                assert rotary is not None
                w = int(rows[i].shape[0])
                per_kind["expected_attention"].append(head_expected_attention(
                    rows[i], torch.arange(seen - w, seen), keys[i], live[i], seen, rotary))
            if "key_norms" in per_kind:
                per_kind["key_norms"].append(head_key_norms(keys[i]))
            if "reconstruction" in per_kind:
                assert self.estimate is not None  # start loads the scorer
                per_kind["reconstruction"].append(self.estimate[i].masked_fill(~live[i], 0.0))
        return HeadEvidence(live=live, kinds={k: torch.stack(v) for k, v in per_kind.items()})

    def select(self, policy: EvictionPolicy, evidence: HeadEvidence, positions: torch.Tensor,
               seen: int, budget_blocks: int, config: EvictionConfig,
               generator: torch.Generator | None) -> torch.Tensor:
        """One event's choice: ``policy``'s per-head score remembered (:meth:`remember`),
        then one threshold over the entries before the newest token's block within
        ``budget_blocks - 1`` x layers x KV heads head-blocks, that block kept whole
        (:func:`~nexus_vllm.core.head_pages.select_packed`, the server's rule), and the
        forced set (``positions``: each slot's logical position, ``seen`` tokens fed)
        kept. Sets and returns :attr:`live`."""
        scores = self.remember(policy.head_score(evidence))
        self.live = select_packed(
            scores, self.live, budget_blocks, config.block_size, positions=positions,
            seen=seen, sink_blocks=policy.sink_blocks, recent_blocks=policy.recent_blocks,
            group=config.head_group,
            sampler=policy.head_sampler, n=int(getattr(policy, "n", 1)),
            generator=generator, shares=self.shares)
        return self.live

    def live_of(self, layer_idx: int) -> torch.Tensor | None:
        """The live mask ``[Hkv, T]`` of one layer (None for a sliding layer)."""
        if layer_idx not in self.layers:
            return None
        return self.live[self.layers.index(layer_idx)]

    def append(self, n: int, estimate: torch.Tensor | None = None) -> None:
        """``n`` new slots, live in every head, not scored yet; ``estimate``
        ``[L, Hkv, n]``: the scorer's prediction for them."""
        layers, heads, _ = self.live.shape
        self.live = torch.cat([self.live, torch.ones(layers, heads, n, dtype=torch.bool)],
                              dim=-1)
        self.best = torch.cat([self.best, torch.full((layers, heads, n), float("-inf"))],
                              dim=-1)
        if self.estimate is not None:
            assert estimate is not None and estimate.shape[-1] == n
            self.estimate = torch.cat([self.estimate, estimate.float()], dim=-1)

    def remember(self, scores: torch.Tensor) -> torch.Tensor:
        """Raise each live entry's best score to ``scores`` (``[L, Hkv, T]``); return it."""
        self.best = torch.where(self.live, torch.maximum(self.best, scores.float()),
                                self.best)
        return self.best

    def keep_slots(self, token_idx: torch.Tensor) -> None:
        self.live = self.live.index_select(-1, token_idx)
        self.best = self.best.index_select(-1, token_idx)
        if self.estimate is not None:
            self.estimate = self.estimate.index_select(-1, token_idx)

    def copy(self) -> HeadLedger:
        return HeadLedger(layers=list(self.layers), live=self.live.clone(),
                          best=self.best.clone(), scales=dict(self.scales), shares=self.shares,
                          scorer=self.scorer,
                          estimate=None if self.estimate is None else self.estimate.clone())


class _ScaledAttention(Protocol):
    """What is read of a transformers attention layer: its index and logit scale."""

    layer_idx: int
    scaling: float


def _is_scaled_attention(module: object) -> TypeGuard[_ScaledAttention]:
    """An attention layer with ``q_proj``, ``scaling`` and a ``layer_idx``."""
    return hasattr(module, "q_proj") and hasattr(module, "scaling") \
        and getattr(module, "layer_idx", None) is not None


def _head_scorer_for(model: PreTrainedModel, ref: str | None, layers: int, heads: int) -> HeadScorer:
    """The config's ``head_scorer``, or the one shipped under the model's name (its
    checkpoint folder's, lower-cased), checked against the model's shape."""
    name = ref or Path(str(model.config.name_or_path)).name.lower()
    if ref is None and name not in shipped_head_scorers():
        raise ConfigError("head_scorer", f"policy 'reconstruction' needs a head scorer; "
                          f"none is shipped for {name!r} (shipped: "
                          f"{', '.join(shipped_head_scorers()) or 'none'}): train one with "
                          "scripts/train_head_scorer.py and set head_scorer to its file")
    scorer = load_head_scorer(name)
    text = model.config.get_text_config(decoder=True)
    scorer.check_model(layers, int(text.hidden_size), heads, name)
    return scorer

