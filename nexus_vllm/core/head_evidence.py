"""Per-head evidence: what a score at head granularity reads for each (layer, KV head,
token) unit, in pure PyTorch on one sequence (the reference the serving path will be
tested against).

* :data:`HEAD_KINDS`: the kinds a per-head score may read;
* :func:`head_window_attention`, :func:`head_expected_attention`, :func:`head_key_norms`:
  per-(KV head, token) evidence of one layer over its live entries;
* :class:`HeadEvidence`: those, stacked over layers, with the live mask.

The selection that spends a budget over these scores is :mod:`.head_paged`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .evidence.expected_attention import future_query_statistics, token_logits
from .rotary import Rotary

__all__ = [
    "HEAD_KINDS",
    "HeadEvidence",
    "head_expected_attention",
    "head_key_norms",
    "head_window_attention",
]

# Evidence a per-head score may read, each ``[L, Hkv, T]``.
HEAD_KINDS = ("mass", "expected_attention", "key_norms", "reconstruction")


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
