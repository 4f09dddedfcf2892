"""What a transformers session records of its eviction events, and the config a
session is built from by method and budget."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nexus_vllm.core import EvictionConfig

__all__ = ["EvictionEvent", "make_config"]


def make_config(method: str, budget: float | int | None, **knobs: object) -> EvictionConfig | None:
    """Build the :class:`EvictionConfig` for ``method`` at ``budget`` (``None`` for dense).

    Parameters
    ----------
    method : str
        ``"dense"`` (no eviction) or any ``EvictionConfig.method``.
    budget : float or int
        A float in (0, 1] is the kept fraction of tokens seen (``keep_ratio``); an int is a
        token count (``max_tokens``). Ignored for dense.
    **knobs
        Every other ``EvictionConfig`` field (block_size, window, sampler, ...).
    """
    if method in ("dense", "none"):
        return None
    if budget is None:
        raise ValueError("budget must be a float in (0, 1] or a positive int, got None")
    return EvictionConfig.from_budget(method, budget, **knobs)


@dataclass(frozen=True)
class EvictionEvent:
    """One eviction: when it fired and what the cache held afterwards."""

    seen: int  # logical tokens fed when the event fired
    prefill: bool
    blocks_before: int
    blocks_after: int
    budget_blocks: int
    kept_positions: torch.Tensor  # LongTensor[T_after], logical positions still cached
    # What the policy read: the logical ids of the live blocks it scored (LongTensor[N],
    # in cache order) and each evidence kind as gathered over them (``mass``: Tensor[W, N]
    # combined over heads and layers by the config's attention_reduce;
    # Evidence.from_gathered reads them back; empty for score-free policies).
    live_blocks: torch.Tensor | None = None
    gathered: dict[str, torch.Tensor] = field(default_factory=dict)
    prompt_end: bool = False  # the event after the prompt's last token
    # Head granularity: BoolTensor[full layers, Hkv, T_after], what each head holds.
    head_live: torch.Tensor | None = None

    @property
    def mass(self) -> torch.Tensor | None:
        return self.gathered.get("mass")
