"""Expected attention: the attention that the queries still to come are expected to pay
each block, from the statistics of the recent queries (query-agnostic evidence).

In ``stream`` mode every prompt event but the last runs before the question is seen, and
what the window's rows attend to predicts what the next few tokens need, not a later
question. Expected attention (kvpress's ``ExpectedAttentionPress``, in our words) models
the future queries of each head as a Gaussian: the mean ``mu`` and covariance ``Sigma``
of the recent queries *before* RoPE, rotated by the average rotation ``A`` over the next
``HORIZON`` positions (``mu' = A mu``, ``Sigma' = A Sigma A^T``). A key ``k`` (post-RoPE,
as cached) then gets the expected unnormalised attention
``exp(k.mu' / sqrt(D) + k^T Sigma' k / (2 D))`` (a Gaussian's moment generating
function), normalised over the sequence's keys per head, summed over each block's tokens,
and reduced over heads and layers as the mass is (mean, or maximum then renormalised).

Both serving paths capture post-RoPE queries, so the window's rows are un-rotated with
the model's own rotary table (:class:`~nexus_vllm.core.rotary.Rotary`; each row's logical
position is known). With ``C`` the W centred, rotated rows of a head,
``k^T Sigma' k = mean_i (k . c_i)^2``: the quadratic term costs W dot products per key,
like the mass itself, instead of a ``D x D`` form. kvpress also multiplies by the value's
norm; the worker reads keys only, so this kind does not (measured in docs/algorithm.md).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ..rotary import Rotary
from ..scoring import normalize_rows, num_blocks_for
from .base import DenseSequence, EvidenceKind, PagedBatch, register_evidence

__all__ = ["EXPECTED_ATTENTION", "HORIZON", "ExpectedAttention", "expected_attention",
           "future_query_statistics", "token_logits"]

# Future positions the rotation is averaged over (kvpress's default).
HORIZON = 512


def future_query_statistics(queries: torch.Tensor, positions: torch.Tensor,
                            rows_valid: torch.Tensor, next_position: torch.Tensor,
                            rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and centred rows of the future queries of each head.

    Parameters
    ----------
    queries : Tensor[..., R, W, Hq, D]
        Post-RoPE query rows (any leading dims, e.g. layers).
    positions : LongTensor[R, W]
        Their logical positions.
    rows_valid : BoolTensor[R, W]
        Rows to use (at least one per sequence).
    next_position : LongTensor[R]
        The first future position.
    rotary : Rotary

    Returns
    -------
    mean : Tensor[..., R, Hq, D]
        ``A mu``.
    centred : Tensor[..., R, W, Hq, D]
        ``A (q_i - mu) / sqrt(n)`` for valid rows (``n`` valid rows), zeros elsewhere:
        ``Sigma' = centred^T centred`` summed over rows.
    """
    pre = rotary.unrotate(queries, positions)  # [..., R, W, Hq, D]
    weight = rows_valid.float()[..., None, None]  # [R, W, 1, 1]
    count = weight.sum(dim=-3).clamp_min(1.0)  # [R, 1, 1]
    mu = (pre * weight).sum(dim=-3) / count  # [..., R, Hq, D]
    centred = (pre - mu.unsqueeze(-3)) * weight / count.unsqueeze(-3).sqrt()
    rot = rotary.mean_rotation(next_position, HORIZON)  # [R, D, D]
    mean = torch.einsum("rde,...rhe->...rhd", rot, mu)
    centred = torch.einsum("rde,...rwhe->...rwhd", rot, centred)
    return mean, centred


def token_logits(keys: torch.Tensor, mean: torch.Tensor, centred: torch.Tensor
                  ) -> torch.Tensor:
    """``k.mu'/sqrt(D) + k^T Sigma' k/(2D)`` for keys ``[R, T, Hkv, D]``: ``[R, Hq, T]``
    (each query head reads its KV head's keys; no copy of the keys per query head)."""
    r, t, hkv, d = keys.shape
    hq, w = mean.shape[1], centred.shape[1]
    g = hq // hkv
    k = keys.float()
    linear = torch.einsum("rtkd,rkgd->rkgt", k, mean.view(r, hkv, g, d)) / math.sqrt(d)
    proj = torch.einsum("rtkd,rwkgd->rkgtw", k, centred.view(r, w, hkv, g, d))
    return (linear + proj.square().sum(dim=-1) / (2 * d)).reshape(r, hq, t)


def _reduce_heads(per_head: torch.Tensor, attention_reduce: str) -> torch.Tensor:
    return per_head.mean(dim=1) if attention_reduce == "mean" else per_head.amax(dim=1)


def expected_attention(queries: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                       next_position: int, rotary: Rotary, block_size: int, *,
                       attention_reduce: str = "mean") -> torch.Tensor:
    """Expected attention of one layer of one sequence on its blocks (the reference).

    Parameters
    ----------
    queries : Tensor[W, Hq, D]
        Recent post-RoPE query rows.
    positions : LongTensor[W]
    keys : Tensor[T, Hkv, D]
        Cached (post-RoPE) keys.
    next_position : int
    rotary : Rotary
    block_size : int
    attention_reduce : {"mean", "max"}

    Returns
    -------
    Tensor[ceil(T / block_size)] (float32): each block's expected share, the mean over
    heads (sums to 1) or the maximum.
    """
    w = int(queries.shape[0])
    mean, centred = future_query_statistics(
        queries[None], positions.view(1, w), torch.ones(1, w, dtype=torch.bool),
        torch.tensor([int(next_position)]), rotary)
    probs = torch.softmax(token_logits(keys[None], mean, centred), dim=-1)  # [1, Hq, T]
    t = int(keys.shape[0])
    n = num_blocks_for(t, block_size)
    padded = torch.nn.functional.pad(probs, (0, n * block_size - t))
    per_head = padded.view(1, -1, n, block_size).sum(dim=-1)  # [1, Hq, N]
    return _reduce_heads(per_head, attention_reduce)[0]


class ExpectedAttention(EvidenceKind):
    name: ClassVar[str] = "expected_attention"
    carries: ClassVar[bool] = True
    layout: ClassVar[str] = "blocks"
    needs_rotary: ClassVar[bool] = True
    reads_queries: ClassVar[bool] = True

    def rank_reduce(self, attention_reduce: str) -> str:
        return "max" if attention_reduce == "max" else "sum"

    def gather_dense(self, seq: DenseSequence) -> torch.Tensor:
        if seq.rotary is None:
            raise ValueError("expected_attention needs the model's rotary table")
        per_layer = [expected_attention(layer.queries, seq.query_positions, layer.keys,
                                        seq.next_position, seq.rotary, seq.block_size,
                                        attention_reduce=seq.attention_reduce)
                     for layer in seq.layers]
        stacked = torch.stack(per_layer)
        return stacked.mean(dim=0) if seq.attention_reduce == "mean" else stacked.amax(dim=0)

    def gather_paged(self, batch: PagedBatch, out: torch.Tensor) -> None:
        if batch.rotary is None:
            raise ValueError("expected_attention needs the model's rotary table")
        r, n_max = out.shape
        w = int(batch.queries.shape[2])
        valid_rows = torch.arange(w, device=out.device).view(1, w) >= (
            w - batch.rows.to(out.device).view(r, 1))
        tables = batch.tables[:, :n_max].long()
        lens = batch.seq_lens.long().to(out.device)
        # The statistics of every layer at once (one un-rotation, one mean rotation).
        means, centred = future_query_statistics(
            batch.queries, batch.query_positions, valid_rows, batch.next_positions,
            batch.rotary)
        pos = torch.arange(n_max * batch.key_caches[0].shape[2], device=out.device)
        beyond = pos.view(1, 1, -1) >= lens.view(r, 1, 1)
        for li, cache in enumerate(batch.key_caches):  # [nb, Hkv, bs, D]
            _, hkv, bs, d = cache.shape
            keys = cache.index_select(0, tables.reshape(-1)).view(r, n_max, hkv, bs, d)
            keys = keys.transpose(2, 3).reshape(r, n_max * bs, hkv, d)
            logits = token_logits(keys, means[li], centred[li]).masked_fill_(
                beyond, float("-inf"))  # [R, Hq, T]
            probs = torch.softmax(logits, dim=-1).view(r, -1, n_max, bs).sum(dim=-1)
            if batch.attention_reduce == "mean":
                out.add_(probs.mean(dim=1) / batch.layers_divisor)
            else:
                torch.maximum(out, probs.amax(dim=1), out=out)

    def finish(self, raw: torch.Tensor, attention_reduce: str) -> dict[str, torch.Tensor]:
        # A distribution over blocks (under max, the maxima renormalised).
        return {self.name: normalize_rows(raw.float().view(1, -1)).view(-1)}


EXPECTED_ATTENTION = register_evidence(ExpectedAttention())
