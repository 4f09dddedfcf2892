"""What the worker's eviction parts share within one step.

The worker's eviction state (``worker_state.py``) applies the plan and opens a
:class:`Step`; compaction (``compaction.py``, fed to the metadata builders) fills in the
:class:`Batch` attention sees; the query ring (``query_ring.py``, fed to the attention
impls) captures queries of that batch; the scorer (``block_scorer.py``) scores it after the
forward. Each part is handed the step explicitly; none reaches into another.

A :class:`Step` also carries what its reply needs (the plan it acknowledges and the
scores on their way to the host), so that, with async scheduling, the next step can start
before this one's reply is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np
import torch

from nexus_vllm.integration.protocol import StepPlan

__all__ = ["Batch", "LayerKeys", "MetadataChanges", "SelfCheckError", "Staging", "Step"]


class SelfCheckError(RuntimeError):
    """A ``NEXUS_VLLM_SELF_CHECK`` check failed: never absorbed as a fault."""


@dataclass(frozen=True)
class LayerKeys:
    """Where the scorer reads one scored layer's keys."""

    name: str
    key_cache: torch.Tensor  # [num_blocks, Hkv, block_size, D] view of the layer's cache


@dataclass
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


@dataclass
class Step:
    """One step, from the plan's application to the reply."""

    plan: StepPlan | None
    tracked: set[str]
    # The plan it acknowledges (None: no usable plan).
    ack: int | None = None
    # The scorer's scores on their way to the host (``block_scorer.PendingScores``).
    pending: Any = None
    # (req_id, logical indices, original ids) masked for this step only (missed plan).
    masked: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    masked_counts: dict[str, int] = field(default_factory=dict)
    batch: Batch | None = None
    changes: MetadataChanges | None = None
    table_key: tuple[int, tuple[int, ...]] | None = None
    slot_mapping: torch.Tensor | None = None
    capture_ready: bool = False  # the capture indices of this step were worked out
    capture_src: torch.Tensor | None = None
    capture_dst: torch.Tensor | None = None
    capture_failed: bool = False


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
