"""Block attention mass: how much the window's newest queries attend to each block.

Rows per query ``[W, N]``; over heads and layers the mean (rows stay distributions; ranks
sum their shares) or the maximum (rows of maxima, renormalised by :meth:`finish`, which
keeps each row's total as ``row_scale``; ranks take the maximum). The reference is
:func:`nexus_vllm.core.scoring.block_attention_mass`; the worker runs the Triton kernel
``nexus_vllm.kernels.block_attention_mass_paged_layers`` over every scored layer at once,
handed in with the batch (``PagedBatch.paged_mass``: core imports no kernel).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..scoring import block_attention_mass, combine_layer_masses, normalize_rows
from .base import DenseSequence, EvidenceKind, PagedBatch, register_evidence

__all__ = ["MASS", "Mass"]


class Mass(EvidenceKind):
    name: ClassVar[str] = "mass"
    carries: ClassVar[bool] = True
    layout: ClassVar[str] = "rows"
    reads_queries: ClassVar[bool] = True

    def rank_reduce(self, attention_reduce: str) -> str:
        return "max" if attention_reduce == "max" else "sum"

    def gather_dense(self, seq: DenseSequence) -> torch.Tensor:
        masses = [block_attention_mass(layer.queries, layer.keys, seq.block_size,
                                       attention_reduce=seq.attention_reduce) for layer in seq.layers]
        return combine_layer_masses(masses, seq.attention_reduce)

    def gather_paged(self, batch: PagedBatch, out: torch.Tensor) -> None:
        if batch.paged_mass is None:
            raise ValueError("the mass kind's worker gatherer runs the paged kernel the batch "
                             "carries (PagedBatch.paged_mass); none was given")
        r, w, n_max = out.shape
        batch.paged_mass(
            batch.queries, batch.key_caches, batch.tables[:, :n_max], batch.seq_lens,
            kv_layout="HND", out=out, attention_reduce=batch.attention_reduce)
        if batch.attention_reduce == "mean":
            out.div_(batch.layers_divisor)

    def finish(self, raw: torch.Tensor, attention_reduce: str) -> dict[str, torch.Tensor]:
        raw = raw.float()
        if attention_reduce == "mean":
            return {"mass": raw}
        return {"mass": normalize_rows(raw), "row_scale": raw.sum(dim=-1)}


MASS = register_evidence(Mass())
