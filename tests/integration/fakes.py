"""Stand-ins for vLLM's V1 model runner and per-step metadata (for worker-side tests).

They hold exactly the fields ``nexus_vllm.integration.compat.runners.RunnerV1`` reads, with
the same types as vLLM 0.32 (a NumPy block table, per-request block id lists), so the
worker's eviction state runs unmodified against them.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from nexus_vllm.core import cdiv

BS = 32


class FakeRunner:
    """``requests[id].block_ids[0]``, ``input_batch.{req_ids, req_id_to_index,
    block_table[0].block_table.np, num_reqs, generators}`` and ``discard_request_mask``."""

    def __init__(self, block_ids: dict[str, list[int]], max_blocks: int = 16,
                 max_rows: int = 0) -> None:
        req_ids = list(block_ids)
        self.table = np.zeros((max(max_rows, len(req_ids) + 2), max_blocks), dtype=np.int32)
        for row, r in enumerate(req_ids):
            self.table[row, : len(block_ids[r])] = block_ids[r]
        bt = SimpleNamespace(block_table=SimpleNamespace(np=self.table))
        self.input_batch = SimpleNamespace(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            block_table=[bt], num_reqs=len(req_ids), generators={})
        self.requests = {r: SimpleNamespace(block_ids=[list(block_ids[r])]) for r in req_ids}
        self.discard_request_mask = SimpleNamespace(np=np.zeros(self.table.shape[0], dtype=bool))


def engine_request(req_id: str, prompt: int, *, max_tokens: int = 64,
                   **extra: Any) -> SimpleNamespace:
    """A stand-in for vLLM's ``Request`` with the fields the scheduler side reads
    (``vllm_types.EngineRequest``); ``extra`` are its ``vllm_xargs``."""
    params = SimpleNamespace(extra_args=extra or None, seed=None)
    return SimpleNamespace(request_id=req_id, num_prompt_tokens=prompt, num_computed_tokens=0,
                           sampling_params=params, max_tokens=max_tokens, num_preemptions=0,
                           next_decode_eligible_step=0)


def adapter(runner: FakeRunner) -> Any:
    """A ``RunnerV1`` over a fake runner."""
    from nexus_vllm.integration.compat.runners import RunnerV1

    return RunnerV1(runner)


def make_state(runner: FakeRunner, *, window: int = 8, max_requests: int = 4,
               device: str = "cpu", layers: dict[int, torch.Tensor] | None = None,
               heads: int = 4, head_size: int = 64, steps_in_flight: int = 1) -> Any:
    """A bound ``WorkerEvictionState``; ``layers`` maps model layer number -> key view."""
    from nexus_vllm.integration.worker.worker_state import LayerKeys, WorkerEvictionState

    state = WorkerEvictionState(block_size=BS, window=window, max_requests=max_requests,
                                device=torch.device(device), score_backend="torch",
                                steps_in_flight=steps_in_flight)
    layers = layers or {}
    state.allocate_ring(max(1, len(layers)), heads, head_size, torch.float32)
    state.bind_layers(adapter(runner), {i: LayerKeys(f"model.layers.{i}.self_attn.attn", k)
                                        for i, k in layers.items()})
    return state


def scheduler_output(finished: tuple[str, ...] = (), new: tuple[str, ...] = (),
                     resumed: tuple[str, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(
        finished_req_ids=set(finished),
        scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)))


def common_metadata(runner: FakeRunner, seq_lens: list[int], query_lens: list[int], *,
                    device: str = "cpu") -> Any:
    """vLLM's ``CommonAttentionMetadata`` for the runner's batch, as MRV1 builds it: the
    block table and lengths are device tensors, their upper bound a CPU tensor."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    rows = len(seq_lens)
    qsl = torch.zeros(rows + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    table = torch.from_numpy(runner.table[:rows].copy()).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl,
        seq_lens=lens.to(device), num_reqs=rows, num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=table,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=lens.clone())


def write_keys(kv: torch.Tensor, key: torch.Tensor, val: torch.Tensor,
               blocks: list[int]) -> None:
    """Write ``key``/``val`` ``[T, Hkv, D]`` into a CPU KV cache with vLLM's own writer."""
    from nexus_vllm.integration.compat.vllm_compat import cpu_cache_writer

    nb, hkv, bs, _ = kv.shape
    kc, vc = kv.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)
    slot = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(key.shape[0])])
    cpu_cache_writer()(key, val, kc, vc, slot, "vec", k_scale=1.0, v_scale=1.0,
                       kv_cache_dtype="auto")


def cpu_ops() -> Any:
    """vLLM's CPU attention ops: ``vllm._custom_ops`` up to 0.33, ``vllm._cpu_ops`` in 0.34."""
    import importlib

    try:
        ops = importlib.import_module("vllm._cpu_ops")
        if hasattr(ops, "cpu_attn_get_scheduler_metadata"):
            return ops
    except ImportError:
        pass
    return importlib.import_module("vllm._custom_ops")


def scheduler_side(num_blocks: int = 64, *, window: int | None = None,
                   step_tokens: int = 128, **flags: Any) -> tuple[Any, Any, Any]:
    """``(EvictionManager, FullAttentionManager, BlockPool)``: the scheduler side over
    vLLM's real block pool, with a stand-in for the parts of ``KVCacheManager`` the
    manager hooks (prefix hits, admission). ``flags`` are ``EvictionConfig`` fields; the
    server streams (``prompt_mode`` ``stream``, an event after every prompt chunk) unless
    they say otherwise, since the tests step prompts chunk by chunk. With ``window``
    (tokens) the model is hybrid, as vLLM groups Gemma 3: a sliding-window group first
    (``mgr.windows.groups[0].manager``), then the full-attention group, over one pool."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import (
        FullAttentionManager,
        SlidingWindowManager,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from nexus_vllm.integration.frontend.server_config import resolve_config
    from nexus_vllm.integration.scheduler.manager import EvictionManager

    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=False, hash_block_size=BS)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype=torch.float32)
    managers: list[Any] = []
    if window is not None:
        sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=32,
                                    dtype=torch.float32, sliding_window=window)
        managers.append(SlidingWindowManager(sliding, block_pool=pool, enable_caching=False,
                                             kv_cache_group_id=0, scheduler_block_size=BS))
    single = FullAttentionManager(spec, block_pool=pool, enable_caching=False,
                                  kv_cache_group_id=len(managers), scheduler_block_size=BS)
    managers.append(single)
    kvm = SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=tuple(managers)),
                          block_pool=pool, get_computed_blocks=lambda r: ((), 0, 0),
                          truncate_computed_blocks=lambda blocks, n: blocks,
                          allocate_slots=lambda *a, **k: None)
    cfg = resolve_config(flags={"method": "nexus", "seed": 3, "prompt_mode": "stream",
                                **flags})
    return EvictionManager(cfg, kvm, BS, step_tokens=step_tokens), single, pool


def live_indices(mgr: Any, req_id: str, num_tokens: int | None = None) -> list[int]:
    """Logical indices of an evicting request's live blocks, as ``mgr`` (an
    ``EvictionManager``) keeps them: among the first ``ceil(num_tokens / block_size)``
    when given (``LiveBlocks.live_indices``)."""
    st = mgr.states.get(req_id)
    if st is None:
        raise KeyError(f"{req_id!r} is not an evicting request seen by the scheduler")
    num_blocks = None if num_tokens is None else cdiv(num_tokens, mgr.block_size)
    return list(mgr.blocks.live_indices(st, num_blocks))


def live_count(mgr: Any, req_id: str, num_tokens: int | None = None) -> int:
    """How many of :func:`live_indices`."""
    return len(live_indices(mgr, req_id, num_tokens))


def fake_evidence(kinds: Iterable[str], rows: int, live: int,
                  generator: torch.Generator) -> dict[str, np.ndarray]:
    """Random evidence of every kind in ``kinds`` over ``live`` blocks, shaped as the
    registry lays each out (a rows kind: ``rows`` row-normalised rows; a blocks kind:
    positive values), as a worker's reply carries it for one request."""
    from nexus_vllm.core import evidence_kind

    out = {}
    for name in kinds:
        if evidence_kind(name).layout == "rows":
            values = torch.softmax(torch.randn(rows, live, generator=generator), dim=-1)
        else:
            values = torch.rand(live, generator=generator) + 0.5
        out[name] = values.numpy().astype(np.float32)
    return out
