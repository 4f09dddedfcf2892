"""The worker's head-paged requests: each one's layout, scores and events, and the
per-layer tile tables a step's attention reads.

At head granularity the worker decides an event (it holds the per-head evidence, one
score per (layer, KV head, token)), makes its moves in the step that scored, and names
the logical blocks it gave back; the scheduler nulls and frees them when the reply comes,
as it does with block plans. A freed block is written only by a step scheduled after the
free, and every step after the event reads the request through its new tables, so a
block reused by another request is never read here again (tested by overwriting it).

An event is keyed by its plan's step id: a plan that arrives again gets the same answer
and moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nexus_vllm.core.head_pages import HeadPageEvent, HeadPages, select_packed
from nexus_vllm.integration.worker.head_attention import TileSpace

__all__ = ["HeadEventRequest", "HeadRequest", "HeadRequests"]


@dataclass(frozen=True)
class HeadEventRequest:
    """What one event of one request asks for.

    Attributes
    ----------
    step_id : int
        The plan's step id (an event is made once per step id).
    seen : int
        Tokens written to the cache when the event runs.
    budget_blocks : int
        vLLM blocks the request may hold afterwards, its tail included.
    sink_blocks, recent_blocks : int
        The forced set every head keeps (``core.head_pages.select_packed``).
    sampler : str
        ``topk``, ``pps`` or ``ares`` over the units (``select_head_units``).
    """

    step_id: int
    seen: int
    budget_blocks: int
    sink_blocks: int = 1
    recent_blocks: int = 1
    sampler: str = "topk"


@dataclass
class HeadRequest:
    """One request's head-paged state on this worker.

    Attributes
    ----------
    pages : HeadPages
    block_ids : LongTensor[B]
        vLLM's block id of each logical block (nulled entries stay: they are never read).
    scores : Tensor[U, capacity]
        Each (layer, KV head)'s best score of each logical position so far (``-inf``:
        none yet).
    events : dict
        Step id -> the event made then, and the blocks it freed.
    """

    pages: HeadPages
    block_ids: torch.Tensor
    scores: torch.Tensor
    events: dict[int, HeadPageEvent] = field(default_factory=dict)


class HeadRequests:
    """Every head-paged request of this worker over one :class:`TileSpace`.

    Parameters
    ----------
    space : TileSpace
    token_offsets : LongTensor[block_size, 2 x D]
        Where a slot's key and value channels sit in a tile (``cpu_token_offsets``).
    """

    def __init__(self, space: TileSpace, token_offsets: torch.Tensor) -> None:
        self.space = space
        self.token_offsets = token_offsets
        self.num_layers = int(space.layer_base.numel())
        self.num_units = self.num_layers * space.num_kv_heads
        self.requests: dict[str, HeadRequest] = {}

    def add(self, req_id: str) -> HeadRequest:
        """Track ``req_id`` from its first token (a fresh layout: block granularity's)."""
        req = HeadRequest(HeadPages.fresh(self.num_units, self.space.block_size),
                          torch.zeros(0, dtype=torch.long),
                          torch.zeros(self.num_units, 0))
        self.requests[req_id] = req
        return req

    def remove(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def set_blocks(self, req_id: str, block_ids: torch.Tensor) -> None:
        """The request's logical block list as vLLM holds it now (it only grows at the
        end; entries this worker freed may read as vLLM's null block)."""
        self.requests[req_id].block_ids = block_ids.long().clone()

    def record_scores(self, req_id: str, positions: torch.Tensor, scores: torch.Tensor
                      ) -> None:
        """Raise the best score of ``positions`` (``[n]``) to ``scores`` (``[U, n]``)."""
        req = self.requests[req_id]
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > req.scores.shape[1]:
            grow = torch.full((self.num_units, need - req.scores.shape[1]), float("-inf"))
            req.scores = torch.cat([req.scores, grow], dim=1)
        req.scores[:, positions] = torch.maximum(req.scores[:, positions], scores.float())

    def evict(self, req_id: str, ask: HeadEventRequest) -> torch.Tensor:
        """Make ``ask``'s event (once per step id) and return the logical blocks freed.

        The choice is the transformers path's (``select_packed`` over the request's best
        scores); the moves go into the cache before this returns."""
        req = self.requests[req_id]
        if ask.step_id in req.events:
            return req.events[ask.step_id].freed_blocks
        seen, bs = int(ask.seen), self.space.block_size
        positions = torch.arange(seen)
        live = req.pages.live(seen)
        scores = torch.full((self.num_units, seen), float("-inf"))
        known = min(seen, req.scores.shape[1])
        scores[:, :known] = req.scores[:, :known]
        hkv = self.space.num_kv_heads
        shape = (self.num_layers, hkv, seen)
        keep = select_packed(scores.view(shape), live.view(shape), ask.budget_blocks, bs,
                             positions=positions, seen=seen, sink_blocks=ask.sink_blocks,
                             recent_blocks=ask.recent_blocks, sampler=ask.sampler)
        req.pages, event = req.pages.plan_event(keep.view(self.num_units, seen), seen)
        self.space.apply(event, req.block_ids, self.token_offsets)
        req.events[ask.step_id] = event
        return event.freed_blocks

    def acknowledged(self, step_id: int) -> None:
        """The scheduler has the answers of plans up to ``step_id``: forget their
        events (a plan is never sent again once its reply is acknowledged)."""
        for req in self.requests.values():
            for old in [s for s in req.events if s <= step_id]:
                del req.events[old]

    def layer_tables(self, req_ids: list[str], seen: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's tile tables: ``[L, R, Hkv, W]`` global tile ids and ``[L, R, Hkv]``
        lengths, request ``i`` with ``seen[i]`` tokens in the cache (its queries
        included)."""
        hkv = self.space.num_kv_heads
        rows, lengths = [], []
        for req_id, n in zip(req_ids, seen):
            req = self.requests[req_id]
            local, length = req.pages.tables(n)
            rows.append(self.space.global_tiles(local, req.block_ids))
            lengths.append(length)
        width = max(int(r.shape[1]) for r in rows)
        tables = torch.stack([torch.nn.functional.pad(r, (0, width - r.shape[1]))
                              for r in rows])  # [R, U, W]
        lens = torch.stack(lengths)  # [R, U]
        r = len(req_ids)
        return (tables.view(r, self.num_layers, hkv, width).transpose(0, 1),
                lens.view(r, self.num_layers, hkv).transpose(0, 1))
