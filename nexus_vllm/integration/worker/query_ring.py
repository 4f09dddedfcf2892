"""The query ring: the newest queries of tracked requests (fed to the attention impls).

A preallocated ``[scored layers, slots, W, Hq, D]`` tensor; each tracked request owns a
slot (``request_table.RequestTable``), and its query at logical position ``p`` lives in
row ``p % W``. The impl mixin (``backend_mixins.NexusAttentionImplMixin``) calls
:meth:`QueryRing.capture` for every layer; the first call of a step works out, from the
batch compaction built, which query rows go where (the ring's own :class:`StepCapture`),
and every scored layer then copies them with one ``index_copy_``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nexus_vllm.integration.worker.request_table import RequestTable
from nexus_vllm.integration.worker.worker_step import (
    Batch,
    Compaction,
    LayerKeys,
    SelfCheckError,
    Staging,
)

__all__ = ["QueryRing", "StepCapture"]


@dataclass
class StepCapture:
    """The ring's capture of one step (its own: nothing else writes it)."""

    tracked: frozenset[str]
    ready: bool = False  # the indices below were worked out (first scored layer)
    src: torch.Tensor | None = None  # [N] query rows of the batch
    dst: torch.Tensor | None = None  # [N] ring rows (flattened over slots)
    failed: bool = False


class QueryRing:
    """Per-request windows of the newest queries, for every scored layer.

    Parameters
    ----------
    window : int
        W: queries kept per request and scored layer (the longest scoring window).
    max_requests : int
        Requests tracked at once (vLLM's ``max_num_seqs``).
    device : torch.device
    fault : callable
        ``(kind, message, exc=...)``: count and log a fault.
    requests : RequestTable
        The worker's requests: their slots and captured windows.
    compaction : callable
        ``() -> Compaction | None``: the step's compaction (its batch), once built.
    """

    def __init__(self, *, window: int, max_requests: int, device: torch.device,
                 fault: Callable[..., None], requests: RequestTable,
                 compaction: Callable[[], Compaction | None]) -> None:
        self.window = int(window)
        self.max_requests = int(max_requests)
        self.device = device
        self._fault = fault
        self.requests = requests
        self._compaction = compaction
        self.step_capture: StepCapture | None = None  # between begin() and end()
        self.ring: torch.Tensor | None = None  # [L, slots, W, Hq, D]
        self.ring_layer: dict[int, int] = {}  # model layer number -> ring layer
        self.layer_keys: list[LayerKeys] = []
        self._src: Staging | None = None
        self._dst: Staging | None = None
        self.keys_checked: set[int] = set()

    def allocate(self, num_layers: int, num_heads: int, head_size: int,
                 dtype: torch.dtype) -> None:
        """Allocate the ring (before vLLM profiles memory for the KV cache, so it is
        accounted for)."""
        self.ring = torch.zeros(num_layers, self.max_requests, self.window, num_heads,
                                head_size, dtype=dtype, device=self.device)
        tokens = self.max_requests * self.window
        self._src = Staging(tokens, self.device)
        self._dst = Staging(tokens, self.device)

    def bind(self, scored: dict[int, LayerKeys]) -> None:
        """The scored layers (model layer number -> keys), in ring order."""
        self.layer_keys = [scored[i] for i in sorted(scored)]
        self.ring_layer = {li: k for k, li in enumerate(sorted(scored))}

    def nbytes(self) -> int:
        return 0 if self.ring is None else self.ring.numel() * self.ring.element_size()

    # -- one step ------------------------------------------------------------------------
    def begin(self, tracked: frozenset[str]) -> None:
        """Arm for one step: capture the queries of ``tracked`` requests."""
        self.step_capture = StepCapture(tracked=tracked)

    def end(self) -> None:
        self.step_capture = None

    @property
    def capture_failed(self) -> bool:
        """Whether this step's capture failed (its scores would read stale queries)."""
        return self.step_capture is not None and self.step_capture.failed

    # -- reading -------------------------------------------------------------------------
    def valid_rows(self, req_id: str, end: int) -> int:
        """Captured queries of the request that end at logical position ``end`` (0 when
        its window is not continuous up to ``end``)."""
        req = self.requests.get(req_id)
        return 0 if req is None else req.valid_rows(end)

    def rows(self, req_id: str, end: int, count: int) -> np.ndarray:
        """Ring rows (flattened over slots) of logical positions ``end - count .. end - 1``
        (positions before the request's start map to row 0; callers drop them)."""
        req = self.requests.get(req_id)
        assert req is not None and req.slot is not None, req_id
        pos = np.arange(end - count, end, dtype=np.int64)
        return np.where(pos >= 0, req.slot * self.window + pos % self.window, 0)

    # -- capture -------------------------------------------------------------------------
    def _prepare(self, capture: StepCapture, batch: Batch) -> None:
        if not capture.tracked or self.ring is None:
            return
        w = self.window
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        for i, req_id in enumerate(batch.req_ids):
            if req_id not in capture.tracked:
                continue
            req = self.requests.get(req_id)
            qs, qe = int(batch.query_start[i]), int(batch.query_start[i + 1])
            n = qe - qs
            if req is None or req.slot is None or n <= 0:
                continue
            end = int(batch.logical_lens[i])
            k = min(n, w)
            if req.captured_end != end - n:
                req.captured_from = end - k  # discontinuous: restart the window
            req.captured_end = end
            src.append(np.arange(qe - k, qe, dtype=np.int64))
            dst.append(req.slot * w + np.arange(end - k, end, dtype=np.int64) % w)
        if not src:
            return
        assert self._src is not None and self._dst is not None
        capture.src = self._src.put(np.concatenate(src))
        capture.dst = self._dst.put(np.concatenate(dst))

    def capture(self, layer: int, query: torch.Tensor) -> None:
        """Copy this layer's queries of tracked requests into the ring (impl hook)."""
        capture = self.step_capture
        if capture is None or capture.failed:
            return
        if not capture.ready:  # first layer of the step
            compaction = self._compaction()
            if compaction is None:
                return
            capture.ready = True
            self._prepare(capture, compaction.batch)
        if capture.src is None or capture.dst is None:
            return
        k = self.ring_layer.get(layer)
        if k is None:
            return
        assert self.ring is not None
        try:
            _, slots, w, heads, dim = self.ring.shape
            q = query.reshape(query.shape[0], heads, dim)
            self.ring[k].view(slots * w, heads, dim).index_copy_(
                0, capture.dst, q.index_select(0, capture.src))
        except Exception:
            capture.failed = True
            self._fault("capture_error", "query capture failed; this step is not scored",
                        exc=True)

    def check_keys(self, layer: int, key: torch.Tensor | None) -> None:
        """Self-check: the layer's key view holds the keys it was just given."""
        k = self.ring_layer.get(layer)
        if k is None or key is None or layer in self.keys_checked or self.step_capture is None:
            return
        compaction = self._compaction()
        if compaction is None:
            return
        n = int(compaction.batch.query_start[-1])
        cache = self.layer_keys[k].key_cache
        _, heads, bs, dim = cache.shape
        slots = compaction.slot_mapping[:n].long()
        ok = slots >= 0
        got = cache[slots[ok] // bs, :, slots[ok] % bs, :]
        want = key[:n].reshape(n, heads, dim)[ok]
        if not torch.equal(got, want.to(got.dtype)):
            raise SelfCheckError(
                f"nexus-vllm self-check: the key view of layer {self.layer_keys[k].name} does "
                f"not hold the keys vLLM wrote (max diff "
                f"{(got.float() - want.float()).abs().max().item():.3g}); scoring would read "
                "the wrong memory")
        self.keys_checked.add(layer)
