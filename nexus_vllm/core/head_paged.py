"""Head-paged eviction: every (layer, KV head) keeps its own tokens, and one threshold
over every (layer, KV head, token) unit decides how many each keeps.

At block granularity one block set serves every layer and head, so a token that one
retrieval head needs costs a slot in every head. Spending the budget unevenly across
layers and heads, as the evidence says, is what keeps dense's answers in the measurement
behind this module (KVzip's own score: one threshold over (layer, head, token) keeps all of
them at 20% of long documents; equal counts per head keep none): ``docs/algorithm.md``,
"Head-paged KV".

Storage is packed: a (layer, head) that keeps ``k`` tokens holds ``ceil(k / block_size)``
head-blocks, and a request that holds ``B`` vLLM blocks owns ``B x layers x KV heads``
head-blocks to share out. :func:`select_head_units` keeps that bound by construction: the
kept tokens need at most ``budget_head_blocks`` head-blocks, exactly as many vLLM blocks as
block granularity at the same budget.

Everything here is pure PyTorch on one sequence (the reference the serving path will be
tested against). This module holds the selection:

* :func:`forced_positions`: the sinks and the newest tokens every head keeps;
* :func:`select_head_units`: one threshold (or pps draws) over the units, then the
  head-block rounding; or a fixed allocation, a :class:`HeadProfile` calibrated offline
  per model, with each head's own best entries in its share
  (:func:`apportion_head_blocks`);
* the head-block arithmetic: :func:`head_blocks_held`, :func:`head_budget_blocks`,
  :func:`head_tokens_held`, :func:`check_head_group`.

What a per-head score reads (:data:`HEAD_KINDS`, :class:`HeadEvidence` and the functions
that compute it) is :mod:`.head_evidence`; the per-model allocations
(:class:`HeadProfile`, :func:`load_head_profile`) are :mod:`.head_profile`. Both are
importable from here too.
"""

from __future__ import annotations

import torch

from ._validate import ConfigError
from .head_evidence import (
    HEAD_KINDS,
    HeadEvidence,
    head_expected_attention,
    head_key_norms,
    head_window_attention,
)
from .head_profile import PROFILES_DIR, HeadProfile, load_head_profile
from .sampling import sample_blocks, top_k_indices
from .scoring import cdiv

__all__ = [
    "GRANULARITIES",
    "HEAD_KINDS",
    "PROFILES_DIR",
    "apportion_head_blocks",
    "check_head_group",
    "HeadEvidence",
    "HeadProfile",
    "forced_positions",
    "head_blocks_held",
    "head_budget_blocks",
    "head_expected_attention",
    "head_key_norms",
    "head_tokens_held",
    "head_window_attention",
    "load_head_profile",
    "select_head_units",
]

# ``block``: one block set for every layer and head (vLLM's own paging). ``head``: each
# (layer, KV head) keeps its own tokens, packed into head-blocks.
GRANULARITIES = ("block", "head")


def forced_positions(positions: torch.Tensor, next_position: int, block_size: int,
                     sink_blocks: int, recent_blocks: int) -> torch.Tensor:
    """Which cached tokens every head keeps: the first ``sink_blocks`` logical blocks and
    the ``recent_blocks`` full blocks before the current one, plus the current (partial)
    block: block granularity's forced set, read per token.

    Parameters
    ----------
    positions : LongTensor[T]
        Each cache slot's logical position.
    next_position : int
        Tokens seen.

    Returns
    -------
    BoolTensor[T]
    """
    current = (max(int(next_position) - 1, 0) // block_size) * block_size
    tail_start = current - int(recent_blocks) * block_size
    return (positions < int(sink_blocks) * block_size) | (positions >= tail_start)


def head_blocks_held(live: torch.Tensor, block_size: int) -> int:
    """Head-blocks the entries in ``live`` (``[..., T]``) fill when each head's tokens
    are packed: the sum of ``ceil(k / block_size)`` over heads."""
    return int(_blocks_per_head(live, block_size).sum())


def _blocks_per_head(entries: torch.Tensor, block_size: int) -> torch.Tensor:
    """``ceil(k / block_size)`` for each head's ``k`` entries in ``entries`` (``[..., T]``)."""
    return (entries.sum(dim=-1) + block_size - 1) // block_size


def _group_scores(scores: torch.Tensor, live: torch.Tensor, positions: torch.Tensor,
                  group: int) -> torch.Tensor:
    """Each live entry's score replaced by the largest live score of its group (aligned
    runs of ``group`` logical positions), so a group rises or falls as one unit."""
    if group == 1:
        return scores
    ids = (positions // group).view(1, 1, -1).expand_as(scores)
    ids = ids - ids.amin()
    n = int(ids.max()) + 1
    masked = scores.masked_fill(~live, float("-inf"))
    best = torch.full((*scores.shape[:-1], n), float("-inf"), dtype=scores.dtype)
    best = best.scatter_reduce(-1, ids, masked, reduce="amax", include_self=True)
    return best.gather(-1, ids)


def select_head_units(scores: torch.Tensor, live: torch.Tensor, forced: torch.Tensor,
                      budget_head_blocks: int, block_size: int, *,
                      positions: torch.Tensor | None = None, group: int = 1,
                      sampler: str = "topk", n: int = 1,
                      generator: torch.Generator | None = None,
                      shares: torch.Tensor | None = None) -> torch.Tensor:
    """The entries to keep: one threshold over every (layer, KV head, token) unit, then
    each head's count rounded to whole head-blocks within the budget; or, with a fixed
    allocation (``shares``, a per-model profile), each head's head-blocks first and its
    own best entries in them.

    1. Every live forced entry is kept; the others are ranked by score over all heads at
       once (``topk``), or drawn by ``sampler`` with inclusion probabilities proportional
       to their scores (``pps``, ``ares``), up to ``budget_head_blocks x block_size``
       entries in all.
    2. Each head's count is rounded down to whole head-blocks (never below its forced
       entries' blocks); the head-blocks that frees go, one each, to the heads whose best
       entry past their last whole block scores highest, filled to the block's end with
       their next best entries (free: the block is paid for).

    Parameters
    ----------
    scores : Tensor[L, Hkv, T]
        Larger is kept first (finite on live entries).
    live : BoolTensor[L, Hkv, T]
        What each head holds now.
    forced : BoolTensor[T]
        Cache slots every head keeps (:func:`forced_positions`).
    budget_head_blocks : int
        Head-blocks the sequence may fill: its block budget x layers x KV heads.
    block_size : int
    positions : LongTensor[T], optional
        Logical positions of the slots (``group`` > 1 aligns groups on them).
    group : int
        Tokens scored as one unit (1: every token on its own).
    sampler : {"topk", "pps", "ares"}
    n : int
        Uniforms averaged by ``ares``.
    generator : torch.Generator, optional
    shares : Tensor[L, Hkv], optional
        Each head's share of the budget (:func:`apportion_head_blocks`); the entries in a
        head are then ranked by score inside it only (``sampler`` is not read).

    Returns
    -------
    BoolTensor[L, Hkv, T]: a subset of ``live`` holding every live forced entry, whose
    :func:`head_blocks_held` is at most ``budget_head_blocks``.

    Raises
    ------
    ValueError
        When the forced entries alone need more than ``budget_head_blocks``.
    """
    shape = scores.shape
    t = shape[2]
    live = live.bool()
    must = live & forced.view(1, 1, t)
    floor_blocks = _blocks_per_head(must, block_size)  # [L, H]
    if int(floor_blocks.sum()) > budget_head_blocks:
        raise ValueError(f"the forced entries need {int(floor_blocks.sum())} head-blocks; the "
                         f"budget is {budget_head_blocks}")
    if head_blocks_held(live, block_size) <= budget_head_blocks:
        return live.clone()
    if positions is None:
        positions = torch.arange(t)
    unit = _group_scores(scores.float(), live, positions, group)
    if shares is not None:
        blocks = apportion_head_blocks(shares, budget_head_blocks, floor_blocks,
                                       _blocks_per_head(live, block_size))
        _, order = _rank_in_heads(unit, live, must, torch.zeros_like(live))
        return _keep_best(order, live, blocks.view(-1), block_size).view(shape)
    order, blocks = _threshold_blocks(unit, live, must, floor_blocks.view(-1),
                                      budget_head_blocks, block_size, sampler=sampler, n=n,
                                      generator=generator)
    return _keep_best(order, live, blocks, block_size).view(shape)


def _threshold_blocks(unit: torch.Tensor, live: torch.Tensor, must: torch.Tensor,
                      floor_blocks: torch.Tensor, budget_head_blocks: int, block_size: int,
                      *, sampler: str, n: int, generator: torch.Generator | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """One threshold (or draws) over the optional entries of every head, then each head's
    count rounded to whole head-blocks: each head's entries in keep order
    (:func:`_rank_in_heads`, ``[L * Hkv, T]``) and its head-blocks ``[L * Hkv]``, summing
    to at most the budget."""
    t = unit.shape[-1]
    capacity = budget_head_blocks * block_size - int(must.sum())
    chosen = _choose(unit, live & ~must, capacity, sampler=sampler, n=n, generator=generator)
    key, order = _rank_in_heads(unit, live, must, chosen)
    held = live.reshape(-1, t).sum(dim=-1)
    counts = (must | chosen).reshape(-1, t).sum(dim=-1)
    blocks = torch.maximum(counts // block_size, floor_blocks)
    _trim_to_budget(blocks, floor_blocks, key, order, block_size, budget_head_blocks)
    # The freed head-blocks, one each, to the heads whose next entry scores highest.
    spare = budget_head_blocks - int(blocks.sum())
    can_grow = held > blocks * block_size
    if spare > 0 and bool(can_grow.any()):
        next_idx = order.gather(-1, (blocks * block_size).clamp_max(t - 1).view(-1, 1))
        next_key = key.gather(-1, next_idx).view(-1)
        next_key = next_key.masked_fill(~can_grow, float("-inf"))
        grow = torch.argsort(next_key, descending=True, stable=True)[:spare]
        grow = grow[can_grow[grow]]
        blocks[grow] += 1
    return order, blocks


def _rank_in_heads(unit: torch.Tensor, live: torch.Tensor, must: torch.Tensor,
                   chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head ``[L * Hkv, T]``: the scores (-inf on dead entries) and the entries in
    keep order: forced first, then the chosen, then the rest, each by score (two stable
    sorts: by score, then by tier)."""
    t = unit.shape[-1]
    key = unit.masked_fill(~live, float("-inf")).reshape(-1, t)
    tier = (must.long() * 2 + chosen.long() + live.long()).reshape(-1, t)
    by_score = torch.argsort(key, dim=-1, descending=True, stable=True)
    order = by_score.gather(-1, torch.argsort(tier.gather(-1, by_score), dim=-1,
                                              descending=True, stable=True))
    return key, order


def _keep_best(order: torch.Tensor, live: torch.Tensor, blocks: torch.Tensor,
               block_size: int) -> torch.Tensor:
    """Each head's first ``blocks x block_size`` entries in keep ``order``
    (:func:`_rank_in_heads`), at most what it holds: ``[L * Hkv, T]``."""
    t = order.shape[-1]
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(t).expand_as(order))
    flat_live = live.reshape(-1, t)
    keep_count = torch.minimum(blocks * block_size, flat_live.sum(dim=-1))
    return (rank < keep_count.view(-1, 1)) & flat_live


def apportion_head_blocks(shares: torch.Tensor, budget_head_blocks: int,
                          floor_blocks: torch.Tensor, held_blocks: torch.Tensor
                          ) -> torch.Tensor:
    """Head-blocks per (layer, KV head) from a fixed allocation: each head's forced
    blocks, then the rest of the budget in proportion to ``shares`` (largest remainders
    first), never past what a head holds; what a full head cannot take goes to the
    others.

    Parameters
    ----------
    shares : Tensor[L, Hkv]
        Non-negative; only their ratios count.
    budget_head_blocks : int
    floor_blocks, held_blocks : LongTensor[L, Hkv]
        Each head's forced blocks, and the blocks it would fill keeping everything.

    Returns
    -------
    LongTensor[L, Hkv], at least ``floor_blocks``, at most ``max(floor, held)``, summing
    to at most ``budget_head_blocks``.
    """
    floor = floor_blocks.reshape(-1).long()
    cap = torch.maximum(held_blocks.reshape(-1).long(), floor)
    want = shares.reshape(-1).double().clamp_min(0.0)
    blocks = floor.clone()
    for _ in range(int(want.numel()) + 1):  # each pass fills at least one head, or ends
        spare = budget_head_blocks - int(blocks.sum())
        open_ = blocks < cap
        if spare <= 0 or not bool(open_.any()):
            break
        w = torch.where(open_, want, torch.zeros_like(want))
        if float(w.sum()) <= 0:
            w = open_.double()
        ideal = blocks.double() + spare * w / w.sum()
        grown = torch.minimum(torch.floor(ideal).long(), cap)
        grown = torch.maximum(grown, blocks)
        left = budget_head_blocks - int(grown.sum())
        if left > 0:  # largest remainders, among heads with room
            rem = (ideal - torch.floor(ideal)).masked_fill(grown >= cap, -1.0)
            extra = torch.argsort(rem, descending=True, stable=True)[:left]
            extra = extra[rem[extra] >= 0]
            grown[extra] += 1
        if torch.equal(grown, blocks):
            break
        blocks = grown
    return blocks.view(shares.shape)


def _choose(unit: torch.Tensor, optional: torch.Tensor, capacity: int, *, sampler: str,
            n: int, generator: torch.Generator | None) -> torch.Tensor:
    """``capacity`` of the ``optional`` entries by ``unit`` score (one threshold over all
    heads, or draws by weight): a BoolTensor shaped like ``unit``."""
    flat_idx = torch.nonzero(optional.reshape(-1)).view(-1)
    k = max(0, min(capacity, int(flat_idx.numel())))
    weights = unit.reshape(-1)[flat_idx].double()
    if sampler == "topk":  # any finite scores (KNorm's are negative norms)
        picked = top_k_indices(weights, k)
    else:
        picked = sample_blocks(weights.clamp_min(0.0), k, sampler=sampler, n=n,
                               generator=generator)
    out = torch.zeros(unit.numel(), dtype=torch.bool)
    out[flat_idx[picked]] = True
    return out.view(unit.shape)


def _trim_to_budget(blocks: torch.Tensor, floor_blocks: torch.Tensor, key: torch.Tensor,
                    order: torch.Tensor, block_size: int, budget_head_blocks: int) -> None:
    """Lower ``blocks`` (per head, in place) until their sum fits the budget: each time
    the head whose last whole block holds the lowest best entry loses it (raising a head
    to its forced floor can overshoot by a few blocks)."""
    excess = int(blocks.sum()) - budget_head_blocks
    t = key.shape[1]
    while excess > 0:
        shrinkable = blocks > floor_blocks
        first = ((blocks - 1) * block_size).clamp(0, t - 1).view(-1, 1)
        value = key.gather(-1, order.gather(-1, first)).view(-1)
        value = value.masked_fill(~shrinkable, float("inf"))
        head = int(torch.argmin(value))
        if not bool(shrinkable[head]):
            raise ValueError("no head can give up a head-block: the budget is below the "
                             "forced entries")
        blocks[head] -= 1
        excess -= 1


def check_head_group(group: int, block_size: int) -> None:
    """``group`` must divide ``block_size`` (a unit never straddles a head-block's worth)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 \
            or block_size % group:
        raise ConfigError("head_group", f"head_group must be a positive divisor of block_size "
                                        f"({block_size}); got {group!r}")


def head_budget_blocks(budget_blocks: int, num_layers: int, num_kv_heads: int) -> int:
    """Head-blocks a sequence may fill at a block budget: every (layer, head) of its
    blocks."""
    return int(budget_blocks) * int(num_layers) * int(num_kv_heads)


def head_tokens_held(live: torch.Tensor) -> int:
    """The mean tokens a (layer, head) of ``live`` (``[L, Hkv, T]``) holds, rounded up
    (what a budget in tokens counts under head granularity)."""
    return cdiv(int(live.sum()), max(int(live.shape[0] * live.shape[1]), 1))
