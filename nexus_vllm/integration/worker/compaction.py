"""Compaction: evicted blocks taken out of the attention metadata (fed to the builders).

The metadata builder mixin (``backend_mixins.NexusMetadataBuilderMixin``) hands every
``CommonAttentionMetadata`` to :meth:`Compactor.compact` before the stock ``build``. For a
batch with evicted blocks it rewrites ``block_table_tensor``, ``seq_lens``,
``seq_lens_cpu_upper_bound``, ``max_seq_len`` and clears ``_num_computed_tokens_cache``;
the outputs are persistent buffers owned here (CUDA-graph safe), and nothing is read back
from the device. The first call of a step computes the step's
:class:`~nexus_vllm.integration.worker.worker_step.Compaction`; later calls (other
attention groups of the same step) reuse it. The compactor keeps it until the step ends:
the query ring and the scorer read its batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from nexus_vllm.integration.compat.vllm_compat import NULL_BLOCK_ID
from nexus_vllm.integration.worker.worker_step import Batch, Compaction, MetadataChanges

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata

__all__ = ["Compactor"]


class Compactor:
    """Persistent compaction buffers and the per-step rewrite of attention metadata.

    Parameters
    ----------
    block_size : int
    max_requests : int
        Rows the persistent buffers hold at least (vLLM's ``max_num_seqs``).
    backend : str
        ``nexus_vllm.kernels`` backend of ``compact_block_tables``.
    """

    def __init__(self, *, block_size: int, max_requests: int, backend: str) -> None:
        self.block_size = int(block_size)
        self.max_requests = int(max_requests)
        self.backend = backend
        self._batch_req_ids: Callable[[int], list[str]] | None = None
        # Between begin() and end(): blocks compacted out per request, and what this
        # step's first metadata gave.
        self._counts: Mapping[str, int] | None = None
        self._result: Compaction | None = None
        self._tables: torch.Tensor | None = None
        self._lens: torch.Tensor | None = None

    def bind(self, batch_req_ids: Callable[[int], list[str]]) -> None:
        """``num_rows -> request ids`` of the batch rows (the runner adapter)."""
        self._batch_req_ids = batch_req_ids

    def begin(self, compacted: Mapping[str, int]) -> None:
        """Arm for one step: ``compacted`` maps a request to the blocks its row loses
        (``Step.compacted``; absent: none)."""
        self._counts, self._result = compacted, None

    def end(self) -> None:
        """Disarm (between steps, warm-up and profiling runs pass through)."""
        self._counts, self._result = None, None

    def result(self) -> Compaction | None:
        """This step's compaction (None: no step, or no metadata built yet)."""
        return self._result

    def compact(self, cm: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """``cm`` with evicted blocks compacted out (the builder mixin's hook)."""
        if self._counts is None:
            return cm
        table = cm.block_table_tensor
        key = (table.data_ptr(), tuple(table.shape))
        result = self._result
        if result is None:
            result = self._result = self._compute(cm, self._counts, key)
        elif result.table_key != key:
            # One computation per step assumes one KV cache group (refused otherwise):
            # never hand a group a compaction of another group's table.
            raise RuntimeError("nexus-vllm: two different block tables in one step; eviction "
                               "supports models with one KV cache group")
        return dataclasses.replace(cm, **result.changes) if result.changes else cm

    def _compute(self, cm: CommonAttentionMetadata, compacted: Mapping[str, int],
                 key: tuple[int, tuple[int, ...]]) -> Compaction:
        assert self._batch_req_ids is not None, "bind a runner adapter first"
        rows = int(cm.num_reqs)
        req_ids = self._batch_req_ids(rows)
        upper = cm.seq_lens_cpu_upper_bound
        if upper is None:
            raise RuntimeError("nexus-vllm: attention metadata without "
                               "seq_lens_cpu_upper_bound; cannot compact without a sync")
        logical = upper[:rows].numpy().astype(np.int64)
        counts = np.array([compacted.get(r, 0) for r in req_ids], dtype=np.int64)
        tables, lens = cm.block_table_tensor, cm.seq_lens
        changes: MetadataChanges = {}
        if counts.any():
            from nexus_vllm.kernels import compact_block_tables

            tables, lens = self._buffers(cm.block_table_tensor, cm.seq_lens, rows)
            compact_block_tables(cm.block_table_tensor, cm.seq_lens, self.block_size,
                                 null_block=NULL_BLOCK_ID, out_tables=tables,
                                 out_seq_lens=lens, backend=self.backend, validate=False)
            live = logical - counts * self.block_size
            changes = {
                "block_table_tensor": tables,
                "seq_lens": lens,
                "seq_lens_cpu_upper_bound": torch.from_numpy(live).to(upper.dtype),
                "max_seq_len": int(live.max()) if rows else 0,
                # vLLM's cached (seq_lens - query_lens): stale once seq_lens change.
                "_num_computed_tokens_cache": None,
            }
        batch = Batch(req_ids=req_ids,
                      query_start=cm.query_start_loc_cpu[: rows + 1].numpy().copy(),
                      logical_lens=logical, evicted_counts=counts, tables=tables,
                      seq_lens=lens)
        return Compaction(batch=batch, changes=changes, table_key=key,
                          slot_mapping=cm.slot_mapping)

    def _buffers(self, table: torch.Tensor, seq_lens: torch.Tensor,
                 rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = table.shape[1]
        if (self._tables is None or self._tables.shape[0] < rows
                or self._tables.shape[1] != width or self._tables.dtype != table.dtype):
            cap = max(rows, self.max_requests)
            self._tables = torch.zeros(cap, width, dtype=table.dtype, device=table.device)
        if (self._lens is None or self._lens.shape[0] < rows
                or self._lens.dtype != seq_lens.dtype):
            cap = max(rows, self.max_requests)
            self._lens = torch.zeros(cap, dtype=seq_lens.dtype, device=seq_lens.device)
        return self._tables[:rows], self._lens[:rows]
