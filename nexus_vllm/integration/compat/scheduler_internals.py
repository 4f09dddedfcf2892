"""vLLM internals the scheduler side relies on (engine-core process): KV cache groups,
request block lists, the block pool, prefix caching, admission, request scheduling
fields. Part of :mod:`nexus_vllm.integration.compat.vllm_compat` (its inventory lists
every entry); import from there."""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nexus_vllm.integration.compat.catalogue import wrap_instance
from nexus_vllm.integration.compat.vllm_types import EngineRequest, KVBlock, StepSchedule

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheSpec
    from vllm.v1.request import Request


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
        For any other spec: sliding-window MLA, chunked-local, cross-attention, Mamba
        state, or a full-attention group holding sliding-window layers (the hybrid KV
        cache manager is off, so compaction would shift their window).
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    name = type(spec).__name__
    if isinstance(spec, SlidingWindowSpec) and "MLA" not in name:
        return "window"
    if type(spec) is MLAAttentionSpec and not _plain_latent_cache(spec):
        raise UnsupportedKVCacheGroup(
            f"a KV cache group of kind {name} whose latent rows eviction cannot read as "
            f"plain values (cache dtype {getattr(spec, 'cache_dtype_str', None)!r}; a "
            "sparse-attention index or DeepSeek-V4 layout): only 'auto', 'float16', "
            "'bfloat16' or 'float32' latent caches of dense MLA are evicted")
    # MLA's latent cache (one row per token, read by every head) is a full-attention
    # group too.
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
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


def _plain_latent_cache(spec: KVCacheSpec) -> bool:
    """An ``MLAAttentionSpec`` of a dense MLA layer whose cache holds the latent rows as
    model-dtype values (what scoring reads); None fields are a spec vLLM did not build
    from a layer (``MLAAttention.get_kv_cache_spec`` always declares its dtype)."""
    return (getattr(spec, "cache_dtype_str", None) in ("auto", "float16", "bfloat16",
                                                       "float32")
            and getattr(spec, "model_version", None) is None
            and not getattr(spec, "is_index_group_leader", False)
            and getattr(spec, "state_content_bytes", None) is None)


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


@contextmanager
def lone_request_prefill_cap(scheduler: Scheduler, cap: int) -> Iterator[None]:
    """Within the block, cap the tokens one ``scheduler.schedule()`` call may schedule at
    ``cap`` when vLLM would drop its per-request prefill cap.

    ``Scheduler.schedule`` caps each request's tokens at
    ``long_prefill_token_threshold`` only when more than one request is eligible
    (``num_running + num_waiting > 1``, from ``get_request_counts()``; 0.34 also needs
    chunked prefill, which evicting configs force on): a lone request may prefill its
    whole prompt in one step, past budget + one chunk. For such a call the step's token
    budget (``max_num_scheduled_tokens``, read once, as ``token_budget``, before any
    request is scheduled) is lowered to ``cap``: the lone request gets ``min(its tokens,
    cap)``, as the per-request cap would give it. The counts are the ones ``schedule()``
    reads (no request is added or removed between here and there), and the budget holds
    for the whole call, whatever reads it and in which order.
    """
    running, waiting = scheduler.get_request_counts()
    budget = scheduler.max_num_scheduled_tokens
    if cap <= 0 or running + waiting != 1 or budget <= cap:
        yield
        return
    scheduler.max_num_scheduled_tokens = cap
    try:
        yield
    finally:
        scheduler.max_num_scheduled_tokens = budget
