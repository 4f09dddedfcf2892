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
tested against):

* :func:`head_window_attention`, :func:`head_expected_attention`, :func:`head_key_norms`:
  per-(KV head, token) evidence of one layer over its live entries;
* :class:`HeadEvidence`: those, stacked over layers, with the live mask;
* :func:`forced_positions`: the sinks and the newest tokens every head keeps;
* :func:`select_head_units`: one threshold (or pps draws) over the units, then the
  head-block rounding; or a fixed allocation, a :class:`HeadProfile` calibrated offline
  per model (``head_profiles/``), with each head's own best entries in its share.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ._validate import ConfigError, shipped_or_file
from .evidence.expected_attention import future_query_statistics, token_logits
from .rotary import Rotary
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
# Evidence a per-head score may read, each ``[L, Hkv, T]``.
HEAD_KINDS = ("mass", "expected_attention", "key_norms", "reconstruction")
# The shipped per-model allocations (``head_profile`` by name): scripts/calibrate_head_profile.py
PROFILES_DIR = pathlib.Path(__file__).with_name("head_profiles")


def _grouped_queries(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[W, Hq, D]`` -> ``[Hkv, g * W, D]``: each KV head's query group as one set of
    rows (query head ``j`` reads KV head ``j // g``, transformers' ``repeat_kv``)."""
    w, hq, d = queries.shape
    g = hq // num_kv_heads
    return queries.float().permute(1, 0, 2).reshape(num_kv_heads, g * w, d)


def head_window_attention(queries: torch.Tensor, keys: torch.Tensor, live: torch.Tensor,
                          *, scale: float | None = None) -> torch.Tensor:
    """Each live entry's largest attention weight from any query row of its KV head's
    group (KVzip's reduction: a token one row needs sharply is kept).

    Parameters
    ----------
    queries : Tensor[W, Hq, D]
        The newest W query rows (post-RoPE); the last W cached tokens are theirs, so row
        ``r`` sees keys up to ``T - W + r`` (causal).
    keys : Tensor[T, Hkv, D]
        Cached keys (post-RoPE), in cache order.
    live : BoolTensor[Hkv, T]
        Entries each head still holds; the softmax runs over them, as attention does.
    scale : float, optional
        Logit scale (default ``1 / sqrt(D)``).

    Returns
    -------
    Tensor[Hkv, T] (float32), 0 on dead entries.
    """
    w, _, d = queries.shape
    t, hkv, _ = keys.shape
    q = _grouped_queries(queries, hkv)  # [Hkv, gW, D]
    k = keys.float().transpose(0, 1)  # [Hkv, T, D]
    logits = torch.matmul(q, k.transpose(1, 2)) * (scale or 1.0 / math.sqrt(d))
    row_of = torch.arange(w).repeat(q.shape[1] // w)  # [gW] row index within the window
    causal = torch.arange(t).view(1, t) <= (t - w + row_of).view(-1, 1)  # [gW, T]
    logits = logits.masked_fill(~(causal.unsqueeze(0) & live.unsqueeze(1)), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs.amax(dim=1).masked_fill(~live, 0.0)


def head_expected_attention(queries: torch.Tensor, positions: torch.Tensor,
                            keys: torch.Tensor, live: torch.Tensor, next_position: int,
                            rotary: Rotary) -> torch.Tensor:
    """Expected attention of the queries still to come (kvpress's model, as
    :mod:`~nexus_vllm.core.evidence.expected_attention` computes it), per live entry: the
    largest share over the KV head's query group, each head's softmax over its own live
    entries.

    Parameters
    ----------
    queries : Tensor[W, Hq, D]
    positions : LongTensor[W]
        The rows' logical positions.
    keys : Tensor[T, Hkv, D]
    live : BoolTensor[Hkv, T]
    next_position : int
    rotary : Rotary

    Returns
    -------
    Tensor[Hkv, T] (float32), 0 on dead entries.
    """
    w = int(queries.shape[0])
    t, hkv, _ = keys.shape
    mean, centred = future_query_statistics(
        queries[None], positions.view(1, w), torch.ones(1, w, dtype=torch.bool),
        torch.tensor([int(next_position)]), rotary)
    logits = token_logits(keys[None], mean, centred)[0]  # [Hq, T]
    logits = logits.view(hkv, -1, t).masked_fill(~live.unsqueeze(1), float("-inf"))
    return torch.softmax(logits, dim=-1).amax(dim=1).masked_fill(~live, 0.0)


def head_key_norms(keys: torch.Tensor) -> torch.Tensor:
    """L2 norm of every cached key: ``[T, Hkv, D]`` -> ``[Hkv, T]`` (float32)."""
    return torch.linalg.vector_norm(keys.float(), dim=-1).transpose(0, 1)


@dataclass(frozen=True)
class HeadEvidence:
    """What a per-head score reads at one event.

    Attributes
    ----------
    live : BoolTensor[L, Hkv, T]
        The entries each (layer, KV head) holds, over the sequence's cache slots.
    kinds : Mapping[str, Tensor[L, Hkv, T]]
        Each gathered kind of :data:`HEAD_KINDS` (0 on dead entries).
    """

    live: torch.Tensor
    kinds: Mapping[str, torch.Tensor]

    def __getitem__(self, kind: str) -> torch.Tensor:
        if kind not in self.kinds:
            raise ValueError(f"head evidence holds {sorted(self.kinds)}, not {kind!r}")
        return self.kinds[kind]


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


@dataclass(frozen=True)
class HeadProfile:
    """A per-model allocation of the budget over (layer, KV head), calibrated offline.

    Attributes
    ----------
    model : str
        The model it was calibrated on.
    shares : tuple of tuple of float
        ``[full-attention layers][KV heads]``: each head's share of the kept entries.
    budget_share : float
        The budget, as a share of the context, it was calibrated at.
    source : str
        How it was made (the command and the text).
    """

    model: str
    shares: tuple[tuple[float, ...], ...]
    budget_share: float
    source: str

    def __post_init__(self) -> None:
        widths = {len(row) for row in self.shares}
        if not self.shares or len(widths) != 1 or min(widths) < 1:
            raise ConfigError("head_profile", "a head profile's shares must be a non-empty "
                                              "[layers][KV heads] table")
        if any(not math.isfinite(x) or x < 0 for row in self.shares for x in row) \
                or sum(map(sum, self.shares)) <= 0:
            raise ConfigError("head_profile", "a head profile's shares must be finite, "
                                              "non-negative and not all 0")

    def tensor(self) -> torch.Tensor:
        """The shares as Tensor[L, Hkv] (float64)."""
        return torch.tensor(self.shares, dtype=torch.float64)


def load_head_profile(ref: str) -> HeadProfile:
    """A shipped profile by name (``smollm2-135m-instruct``) or a JSON file's path.

    Raises
    ------
    ConfigError
        Naming ``head_profile``: no such profile, or not a profile.
    """
    path = shipped_or_file(ref, PROFILES_DIR, ".json", "head_profile", "profile")
    try:
        data = json.loads(path.read_text())
        return HeadProfile(model=str(data["model"]),
                           shares=tuple(tuple(float(x) for x in row) for row in data["shares"]),
                           budget_share=float(data["budget_share"]),
                           source=str(data.get("source", "")))
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError("head_profile", f"head_profile {ref!r}: not a head profile "
                                          f"({exc})") from None
