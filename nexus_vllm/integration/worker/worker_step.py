"""What one step's parts hand each other.

The worker's eviction state (``worker_state.py``) applies the plan and begins a frozen
:class:`Step`: the usable plan, the requests to track and how many blocks each request's
row loses to compaction. Each part is handed what it needs of it and keeps its own
result: compaction (``compaction.py``, fed to the metadata builders) builds the
:class:`Compaction` of the batch attention sees; the query ring (``query_ring.py``, fed to
the attention impls) reads that batch and keeps its own capture indices; the scorer
(``block_scorer.py``) is handed the plan, the batch and whether capture failed, and
returns the scores on their way to the host. Nothing of a step is written by a part
other than the one that made it, and nothing is shared with the next step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict

import numpy as np
import torch

from nexus_vllm.integration.protocol import StepPlan

__all__ = ["Batch", "Compaction", "LayerKeys", "Masked", "MetadataChanges",
           "SelfCheckError", "Staging", "Step"]


class SelfCheckError(RuntimeError):
    """A ``NEXUS_VLLM_SELF_CHECK`` check failed: never absorbed as a fault."""


@dataclass(frozen=True)
class LayerKeys:
    """Where the scorer reads one scored layer's keys."""

    name: str
    key_cache: torch.Tensor  # [num_blocks, Hkv, block_size, D] view of the layer's cache


class Masked(NamedTuple):
    """Block-table entries of one request nulled for one step only (a missed plan)."""

    req_id: str
    idxs: tuple[int, ...]  # logical block indices
    original: tuple[int, ...]  # the block ids they held


@dataclass(frozen=True)
class Step:
    """One step as its plan was applied, from ``begin_step`` to ``end_step``."""

    plan: StepPlan | None  # the usable plan (None: missing, stale or dropped)
    tracked: frozenset[str]  # requests whose queries the ring captures
    # Blocks compacted out of each request's row: evicted for good, plus masked.
    compacted: Mapping[str, int]
    masked: tuple[Masked, ...] = ()

    @property
    def ack(self) -> int | None:
        """The plan this step's reply acknowledges (None: no usable plan)."""
        return None if self.plan is None else self.plan.step_id


@dataclass(frozen=True)
class Batch:
    """This step's batch as attention metadata sees it (CPU values)."""

    req_ids: list[str]
    query_start: np.ndarray  # [R + 1]
    logical_lens: np.ndarray  # [R] tokens after this step
    evicted_counts: np.ndarray  # [R] blocks compacted out of each row
    tables: torch.Tensor  # [R, W] the block table attention reads (compacted or stock)
    seq_lens: torch.Tensor  # [R] the sequence lengths attention reads


class MetadataChanges(TypedDict, total=False):
    """The ``CommonAttentionMetadata`` fields compaction rewrites (none: nothing evicted
    in the batch)."""

    block_table_tensor: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu_upper_bound: torch.Tensor
    max_seq_len: int
    _num_computed_tokens_cache: torch.Tensor | None


@dataclass(frozen=True)
class Compaction:
    """What compaction built from a step's first attention metadata."""

    batch: Batch
    changes: MetadataChanges  # empty: nothing compacted in this batch
    table_key: tuple[int, tuple[int, ...]]  # (data pointer, shape) of the stock table
    slot_mapping: torch.Tensor  # [T] vLLM's slot of each token (the self-check reads it)


class Staging:
    """A host buffer and its device twin for per-step index tensors (pinned on CUDA).

    The host buffer is written again only once its last non-blocking copy has run (an
    event recorded after each copy): with async scheduling nothing else orders the next
    step's write after this step's copy, as vLLM's own runner guards its staged inputs.
    The device buffer needs no guard: the next copy is queued behind this step's kernels
    on the same stream.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.device = self.host if device.type == "cpu" else torch.zeros_like(
            self.host, device=device)
        self._cuda = device.type == "cuda"
        self._copied: Any = None  # torch.cuda.Event recorded after the last copy

    def put(self, values: np.ndarray) -> torch.Tensor:
        n = int(values.shape[0])
        if n > self.host.shape[0]:
            raise ValueError(f"staging buffer holds {self.host.shape[0]} values, got {n}")
        if self.device is self.host:
            self.host[:n].numpy()[:] = values
            return self.host[:n]
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the host buffer
        self.host[:n].numpy()[:] = values
        out = self.device[:n].copy_(self.host[:n], non_blocking=True)
        if self._cuda:
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        return out
