"""vLLM internals the worker side relies on (worker processes): attention layers and
groups, metadata builders, tensor- and pipeline-parallel groups, the CPU cache ops, the
rotary table; and the attention traits startup checks read from a model's config. Part of
:mod:`nexus_vllm.integration.compat.vllm_compat` (its inventory lists every entry);
import from there."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from nexus_vllm.integration.compat.attention_traits import AttentionTraits, unsupported_attention

if TYPE_CHECKING:
    from vllm.config import ModelConfig, SchedulerConfig, VllmConfig
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.attention.backend import AttentionImpl, AttentionMetadataBuilder
    from vllm.v1.worker.utils import AttentionGroup

    from nexus_vllm.core import Rotary

_Fn = TypeVar("_Fn", bound=Callable[..., Any])

def is_async_output(output: object) -> bool:
    """Whether a runner's output is an ``AsyncModelRunnerOutput`` (async scheduling: its
    ``get_output()`` is called later, after the next step has started)."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

    return isinstance(output, AsyncModelRunnerOutput)


@dataclass(frozen=True)
class AttentionLayerView:
    """One decoder attention layer of the loaded model."""

    name: str
    layer: Attention | MLAAttention

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention: one cached latent row per token, shared by the
        heads (``integration/worker/mla.py``)."""
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention

        return isinstance(self.layer, MLAAttention)

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
        hybrid=bool(model_config.is_hybrid),
        encoder_decoder=bool(model_config.is_encoder_decoder),
        mm_prefix=bool(model_config.is_mm_prefix_lm),
        reference_sliding_window=model_config.rswa_window is not None)


def attention_layers(vllm_config: VllmConfig) -> list[AttentionLayerView]:
    """Every ``Attention`` and ``MLAAttention`` layer of the model, in model order
    (``MLAAttention`` is not an ``Attention``: an ``AttentionLayerBase`` of its own)."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    ctx = vllm_config.compilation_config.static_forward_context
    return [AttentionLayerView(name, layer) for name, layer in ctx.items()
            if isinstance(layer, (Attention, MLAAttention))]


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


def cpu_attention_op(name: str) -> Callable[..., None]:
    """vLLM's CPU attention op ``name`` (``cpu_attn_reshape_and_cache``,
    ``cpu_attention_with_kv_cache``, ``cpu_attn_get_scheduler_metadata``): in
    ``vllm._custom_ops`` up to 0.33, in ``vllm._cpu_ops`` from 0.34."""
    import importlib

    for module in ("vllm._cpu_ops", "vllm._custom_ops"):
        try:
            op = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if op is not None:
            return op  # type: ignore[no-any-return]
    raise RuntimeError(f"nexus-vllm: vLLM's CPU attention op {name!r} was not found")


def cpu_cache_writer() -> Callable[..., None]:
    """vLLM's CPU KV-cache writer ``cpu_attn_reshape_and_cache(key, value, key_cache,
    value_cache, slot_mapping, isa, k_scale, v_scale, kv_cache_dtype)``."""
    return cpu_attention_op("cpu_attn_reshape_and_cache")


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


def rotary_table(model: torch.nn.Module, near: str | None = None) -> Rotary | None:
    """The rotary embedding of the attention layer ``near`` (a module name, e.g. a scored
    layer's ``model.layers.5.self_attn.attn``: the closest ``RotaryEmbeddingBase`` above
    it; hybrid models such as Gemma 3 give sliding and full-attention layers different
    bases), else the model's first, as a :class:`~nexus_vllm.core.Rotary`
    (``cos_sin_cache``, ``is_neox_style``, ``head_size``; every scaling variant subclasses
    it); None for a model without one. Evidence that un-rotates the captured queries
    (expected attention) reads it."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    from nexus_vllm.core import Rotary

    scopes: list[torch.nn.Module] = []
    parts = near.split(".") if near else []
    for end in range(len(parts), 0, -1):
        try:
            scopes.append(model.get_submodule(".".join(parts[:end])))
        except AttributeError:
            continue
    scopes.append(model)
    for scope in scopes:
        for module in scope.modules():
            if isinstance(module, RotaryEmbeddingBase):
                cache = getattr(module, "cos_sin_cache", None)
                if not isinstance(cache, torch.Tensor):
                    return None
                return Rotary(cache.detach().float().clone(),
                              neox=bool(module.is_neox_style), head_size=int(module.head_size))
    return None
