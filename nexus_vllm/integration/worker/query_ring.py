"""The query ring: the newest queries of tracked requests (fed to the attention impls).

A preallocated ``[scored layers, slots, W, Hq, D]`` tensor; each tracked request owns a
slot, and its query at logical position ``p`` lives in row ``p % W``. The impl mixin
(``attention.NexusAttentionImplMixin``) calls :meth:`QueryRing.capture` for every layer;
the first call of a step works out, from the step's batch (filled in by compaction), which
query rows go where, and every scored layer then copies them with one ``index_copy_``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from nexus_vllm.integration.worker.worker_step import LayerKeys, SelfCheckError, Staging, Step

__all__ = ["QueryRing"]


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
    """

    def __init__(self, *, window: int, max_requests: int, device: torch.device,
                 fault: Callable[..., None]) -> None:
        self.window = int(window)
        self.max_requests = int(max_requests)
        self.device = device
        self._fault = fault
        self.step: Step | None = None
        self.ring: torch.Tensor | None = None  # [L, slots, W, Hq, D]
        self.ring_layer: dict[int, int] = {}  # model layer number -> ring layer
        self.layer_keys: list[LayerKeys] = []
        self.slots: dict[str, int] = {}
        self.free_slots: list[int] = []
        self.captured_from: dict[str, int] = {}  # first logical position in the ring
        self.captured_end: dict[str, int] = {}  # logical position after the last one
        self._src: Staging | None = None
        self._dst: Staging | None = None
        self.keys_checked: set[int] = set()

    def allocate(self, num_layers: int, num_heads: int, head_size: int,
                 dtype: torch.dtype) -> None:
        """Allocate the ring (before vLLM profiles memory for the KV cache, so it is
        accounted for)."""
        self.ring = torch.zeros(num_layers, self.max_requests, self.window, num_heads,
                                head_size, dtype=dtype, device=self.device)
        self.free_slots = list(range(self.max_requests - 1, -1, -1))
        tokens = self.max_requests * self.window
        self._src = Staging(tokens, self.device)
        self._dst = Staging(tokens, self.device)

    def bind(self, scored: dict[int, LayerKeys]) -> None:
        """The scored layers (model layer number -> keys), in ring order."""
        self.layer_keys = [scored[i] for i in sorted(scored)]
        self.ring_layer = {li: k for k, li in enumerate(sorted(scored))}

    def nbytes(self) -> int:
        return 0 if self.ring is None else self.ring.numel() * self.ring.element_size()

    # -- slots ---------------------------------------------------------------------------
    def track(self, req_id: str) -> int | None:
        """The request's slot (a free one on first use; None when all are taken)."""
        slot = self.slots.get(req_id)
        if slot is None and self.free_slots:
            slot = self.free_slots.pop()
            self.slots[req_id] = slot
        return slot

    def forget(self, req_id: str) -> None:
        slot = self.slots.pop(req_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        self.captured_from.pop(req_id, None)
        self.captured_end.pop(req_id, None)

    def valid_rows(self, req_id: str, end: int) -> int:
        """Captured queries of the request that end at logical position ``end`` (0 when
        its window is not continuous up to ``end``)."""
        if req_id not in self.slots or self.captured_end.get(req_id) != end:
            return 0
        return end - self.captured_from.get(req_id, end)

    def rows(self, req_id: str, end: int, count: int) -> np.ndarray:
        """Ring rows (flattened over slots) of logical positions ``end - count .. end - 1``
        (positions before the request's start map to row 0; callers drop them)."""
        pos = np.arange(end - count, end, dtype=np.int64)
        return np.where(pos >= 0, self.slots[req_id] * self.window + pos % self.window, 0)

    # -- capture -------------------------------------------------------------------------
    def _prepare(self, step: Step) -> None:
        batch = step.batch
        if batch is None or not step.tracked or self.ring is None:
            return
        w = self.window
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        for i, req_id in enumerate(batch.req_ids):
            if req_id not in step.tracked:
                continue
            slot = self.slots.get(req_id)
            qs, qe = int(batch.query_start[i]), int(batch.query_start[i + 1])
            n = qe - qs
            if slot is None or n <= 0:
                continue
            end = int(batch.logical_lens[i])
            k = min(n, w)
            if self.captured_end.get(req_id) != end - n:
                self.captured_from[req_id] = end - k  # discontinuous: restart the window
            self.captured_end[req_id] = end
            src.append(np.arange(qe - k, qe, dtype=np.int64))
            dst.append(slot * w + np.arange(end - k, end, dtype=np.int64) % w)
        if not src:
            return
        assert self._src is not None and self._dst is not None
        step.capture_src = self._src.put(np.concatenate(src))
        step.capture_dst = self._dst.put(np.concatenate(dst))

    def capture(self, layer: int, query: torch.Tensor) -> None:
        """Copy this layer's queries of tracked requests into the ring (impl hook)."""
        step = self.step
        if step is None or step.batch is None or step.capture_failed:
            return
        if not step.capture_ready:  # first layer of the step
            step.capture_ready = True
            self._prepare(step)
        if step.capture_src is None or step.capture_dst is None:
            return
        k = self.ring_layer.get(layer)
        if k is None:
            return
        assert self.ring is not None
        try:
            _, slots, w, heads, dim = self.ring.shape
            q = query.reshape(query.shape[0], heads, dim)
            self.ring[k].view(slots * w, heads, dim).index_copy_(
                0, step.capture_dst, q.index_select(0, step.capture_src))
        except Exception:
            step.capture_failed = True
            self._fault("capture_error", "query capture failed; this step is not scored",
                        exc=True)

    def check_keys(self, layer: int, key: torch.Tensor | None) -> None:
        """Self-check: the layer's key view holds the keys it was just given."""
        k = self.ring_layer.get(layer)
        step = self.step
        if (k is None or key is None or layer in self.keys_checked or step is None
                or step.batch is None or step.slot_mapping is None):
            return
        n = int(step.batch.query_start[-1])
        cache = self.layer_keys[k].key_cache
        _, heads, bs, dim = cache.shape
        slots = step.slot_mapping[:n].long()
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
