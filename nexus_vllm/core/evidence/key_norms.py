"""Key norms: the mean L2 norm of each block's keys (KNorm's evidence: low-norm keys draw
attention in many models). Over its tokens, the KV heads and the scored layers; ranks sum
their shares of the mean. Query-agnostic: it reads no query.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..scoring import num_blocks_for
from .base import DenseSequence, EvidenceKind, PagedBatch, register_evidence

__all__ = ["KEY_NORMS", "KeyNorms", "block_key_norms"]


def block_key_norms(keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean key L2 norm of each block (the reference).

    Parameters
    ----------
    keys : Tensor[L, T, Hkv, D]
        The sequence's keys in the scored layers.
    block_size : int

    Returns
    -------
    Tensor[ceil(T / block_size)] (float32): the mean over layers, KV heads and the
    block's tokens (a partial last block: its tokens only).
    """
    per_token = keys.float().norm(dim=-1).mean(dim=(0, 2))  # [T]
    t = int(per_token.shape[0])
    n = num_blocks_for(t, block_size)
    padded = torch.full((n * block_size,), float("nan"), device=per_token.device)
    padded[:t] = per_token
    return padded.view(n, block_size).nanmean(dim=1)


class KeyNorms(EvidenceKind):
    name: ClassVar[str] = "key_norms"
    layout: ClassVar[str] = "blocks"

    def gather_dense(self, seq: DenseSequence) -> torch.Tensor:
        return block_key_norms(torch.stack([layer.keys for layer in seq.layers]),
                               seq.block_size)

    def gather_paged(self, batch: PagedBatch, out: torch.Tensor) -> None:
        r, n_max = out.shape
        tables = batch.tables[:, :n_max].long()
        lens = batch.seq_lens.long()
        total: torch.Tensor | None = None
        for cache in batch.key_caches:  # [nb, Hkv, bs, D]
            blocks = cache.index_select(0, tables.reshape(-1)).float()
            per_token = blocks.norm(dim=-1).mean(dim=1).view(r, n_max, -1)  # [R, n, bs]
            total = per_token if total is None else total + per_token
        assert total is not None
        bs = total.shape[-1]
        pos = torch.arange(n_max * bs, device=total.device).view(1, n_max, bs)
        valid = (pos < lens[:, None, None]).to(total.dtype)
        per_block = (total * valid).sum(-1) / valid.sum(-1).clamp_(min=1.0)
        out.copy_(per_block.div_(batch.layers_divisor))


KEY_NORMS = register_evidence(KeyNorms())
