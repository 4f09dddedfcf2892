"""Worker subclass selected by ``worker_cls`` for evicting configurations.

The base class is the platform's worker (``CPUWorker`` on CPU, ``Worker`` on CUDA); the
eviction path on top of it is the same on both:

* ``__init__``: point vLLM's attention-backend registry entries for this platform at
  their nexus subclasses (``integration/worker/attention.py``) before the model is built;
* ``load_model``: check every attention layer can be evicted from, and allocate the
  query ring before vLLM profiles memory for the KV cache;
* ``initialize_from_config``: pick the adapter of vLLM's model runner
  (``integration/compat/runners.py``), bind the eviction state to every metadata builder and
  attention impl, and to each scored layer's key cache; ``extend_kv_cache`` (vLLM 0.34
  re-binds every layer's KV tensors after warm-up) binds the key views again;
* ``execute_model``: apply the step's plan, run vLLM's step, score the requests due
  (with pipeline parallelism each stage scores the layers it holds and sends its part
  to the last stage, ``block_scorer``);
* ``sample_tokens``: take the step's reply token and close the step; attach the step's
  :class:`~nexus_vllm.integration.protocol.WorkerReply` to its output, or, for an
  ``AsyncModelRunnerOutput`` (async scheduling: vLLM takes the output later, after the
  next step has begun), return :class:`ReplyingAsyncOutput`, whose ``get_output()``
  attaches it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.outputs import AsyncModelRunnerOutput

from nexus_vllm.core import evidence_kind
from nexus_vllm.integration import faults
from nexus_vllm.integration.compat.runners import RunnerAdapter, runner_adapter
from nexus_vllm.integration.compat.vllm_compat import (
    StageLink,
    UnsupportedKVCacheGroup,
    attention_groups,
    attention_layers,
    check_vllm_version,
    gpu_sync_check,
    group_builders,
    group_role,
    is_async_output,
    pp_rank_and_size,
    rotary_table,
    steps_in_flight,
    tp_rank_and_size,
)
from nexus_vllm.integration.config import config_from_additional
from nexus_vllm.integration.protocol import attach_reply, read_plan
from nexus_vllm.integration.worker.attention import (
    CPU_BACKENDS,
    CUDA_BACKENDS,
    NexusAttentionImplMixin,
    NexusMetadataBuilderMixin,
    key_view,
    register_backends,
    wrapped_backend_name,
)
from nexus_vllm.integration.worker.block_scorer import PendingScores
from nexus_vllm.integration.worker.mla import MLA_BACKENDS, NexusMLAImplMixin, latent_rotary
from nexus_vllm.integration.worker.wire import RankLayout
from nexus_vllm.integration.worker.worker_state import (
    LayerKeys,
    ReplyToken,
    WorkerEvictionState,
    WorkerParts,
    layer_index,
)
from nexus_vllm.integration.worker.worker_step import Step

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

logger = init_logger(__name__)

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _BaseWorker
else:  # pragma: no cover - CUDA path, exercised by the device check
    from vllm.v1.worker.gpu_worker import Worker as _BaseWorker  # type: ignore[assignment]

__all__ = ["NexusWorker", "ReplyingAsyncOutput", "platform_backends"]


def platform_backends() -> tuple[str, ...]:
    """The attention backends eviction supports on this platform."""
    return CPU_BACKENDS if current_platform.is_cpu() else CUDA_BACKENDS


def _model_layers(vllm_config: VllmConfig, local_bound: int) -> int:
    """Decoder layers of the whole model (every pipeline stage), from the HF config;
    ``local_bound`` (one past this worker's last layer) when the config does not say."""
    text = getattr(vllm_config.model_config, "hf_text_config", None)
    layers = getattr(text, "num_hidden_layers", None)
    return max(int(layers), local_bound) if isinstance(layers, int) else local_bound


class ReplyingAsyncOutput(AsyncModelRunnerOutput):
    """vLLM's ``AsyncModelRunnerOutput`` of one step, whose output carries that step's
    reply: ``get_output()`` (vLLM's output thread, after the next step has begun) waits
    for the step's scores, then attaches them. Everything it reads belongs to its step
    (the :class:`~nexus_vllm.integration.worker.worker_state.ReplyToken`)."""

    def __init__(self, inner: AsyncModelRunnerOutput, token: ReplyToken) -> None:
        self.inner = inner
        self.token = token

    def get_output(self) -> ModelRunnerOutput:
        return attach_reply(self.inner.get_output(), self.token.reply())

    def get_kv_connector_output(self) -> KVConnectorOutput | None:
        # 0.33+ (salvaged when get_output fails); 0.32's outputs have none.
        getter = getattr(self.inner, "get_kv_connector_output", None)
        return None if getter is None else getter()  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        # Anything else vLLM reads of the output is the inner one's.
        return getattr(self.__dict__["inner"], name)


class NexusWorker(_BaseWorker):  # type: ignore[misc,valid-type]
    """Platform worker + eviction plan application + scoring + reply."""

    # vLLM's arguments are passed on untouched (their list changes between releases).
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_vllm_version()
        register_backends(platform_backends())
        super().__init__(*args, **kwargs)
        cfg = config_from_additional(self.vllm_config.additional_config)
        if cfg is None:
            raise RuntimeError("NexusWorker needs additional_config['nexus'] with a method "
                               "other than 'none' (use --kv-eviction)")
        self.nexus_cfg = cfg
        self.nexus_state: WorkerEvictionState | None = None
        # The step execute_model began and scored, for sample_tokens to reply on and end.
        self._nexus_scored_step: tuple[Step, PendingScores | None] | None = None
        self._nexus_scored: frozenset[int] = frozenset()  # decoder layer numbers scored

    # -- startup -----------------------------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        layers = attention_layers(self.vllm_config)
        if not layers:
            raise RuntimeError("nexus-vllm: the model has no attention layers to evict from")
        for view in layers:
            reason = view.unsupported_reason()
            if reason is not None:
                raise RuntimeError(f"nexus-vllm cannot evict from this model: {reason}")
            if view.is_mla and not isinstance(view.impl, NexusMLAImplMixin):
                raise RuntimeError(
                    f"nexus-vllm: layer {view.name} runs the MLA backend "
                    f"{type(view.impl).__name__}; eviction on multi-head latent attention "
                    f"is built for vLLM's CPU_MLA backend only ({', '.join(MLA_BACKENDS)}; "
                    "the CUDA MLA backends and CPU's AMX_MLA are not wrapped yet): serve "
                    "this model with --kv-eviction none")
            if not isinstance(view.impl, NexusAttentionImplMixin):
                raise RuntimeError(
                    f"nexus-vllm: layer {view.name} runs attention backend "
                    f"{type(view.impl).__name__}, which has no eviction support; supported "
                    f"here: {', '.join(platform_backends())} (choose one with "
                    "--attention-backend)")
        cfg = self.nexus_cfg
        indices = [layer_index(v.name) for v in layers]
        # With pipeline parallelism this stage holds only some layers: which layers are
        # scored, and the mean over them, follow the whole model's layer count.
        total = _model_layers(self.vllm_config, max(indices) + 1)
        # Only full-attention layers are scored: a sliding-window layer's old blocks are
        # freed by vLLM (and may already hold another request's keys).
        windowed = frozenset(i for v, i in zip(layers, indices, strict=True)
                             if v.sliding_window is not None)
        model_scored = [i for i in cfg.scored_layers(total) if i not in windowed]
        self._nexus_scored = frozenset(model_scored)
        scored = [v for v, i in zip(layers, indices, strict=True) if i in self._nexus_scored]
        if not model_scored:
            raise RuntimeError(f"nexus-vllm: skip_layers={cfg.skip_layers} leaves no "
                               f"full-attention layer to score (the model has {total} "
                               f"layers, {len(windowed)} of them sliding-window)")
        tp_rank, tp_size = tp_rank_and_size()
        pp_rank, pp_size = pp_rank_and_size()
        layout = RankLayout(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                            pp_size=pp_size)
        # Every rank builds the stage links (a collective), whether it sends or not.
        stages = StageLink.from_vllm() if pp_size > 1 else None
        k = steps_in_flight(self.vllm_config)
        # The scored (full-attention) layers' table: a hybrid model's sliding layers may
        # rotate with another base.
        rotary_kinds = sorted(kind for kind in cfg.evidence_kinds()
                              if evidence_kind(kind).needs_rotary)
        rotary = rotary_table(self.model_runner.model, scored[0].name if scored else None)
        if rotary is not None and any(v.is_mla for v in layers):
            # A latent query [q_nope @ W_UK_T | q_pe] rotates in its last channels only.
            rotary = latent_rotary(rotary, int(layers[0].impl.head_size))
        if rotary is None and rotary_kinds:
            raise RuntimeError(f"nexus-vllm: this model has no rotary embedding, and the "
                               f"eviction config ({cfg.method}) reads {rotary_kinds}, which "
                               "un-rotate the captured queries")
        state = WorkerEvictionState(
            block_size=int(self.cache_config.block_size),
            window=max(int(cfg.window), int(cfg.prompt_window)),
            max_requests=int(self.vllm_config.scheduler_config.max_num_seqs),
            device=torch.device(self.model_runner.device),
            score_backend="batched" if current_platform.is_cpu() else "auto",
            layout=layout, scored_layers=len(model_scored), attention_reduce=cfg.attention_reduce,
            steps_in_flight=k, stages=stages, rotary=rotary,
            parts=faults.with_doubles(WorkerParts()))
        dtype = self.model_runner.dtype
        assert isinstance(dtype, torch.dtype), dtype
        # A stage without scored layers gets an empty ring (it still joins every
        # reduction, adding zeros); the head shape is the same on every layer.
        impl = layers[0].impl
        state.allocate_ring(len(scored), int(impl.num_heads), int(impl.head_size), dtype)
        self.nexus_state = state
        logger.info("nexus-vllm worker: %d of %d attention layers scored here (%d in the "
                    "model), query ring %.1f MiB (%d requests x %d queries), TP rank %d/%d, "
                    "PP stage %d/%d, %d steps in flight", len(scored), len(layers),
                    len(model_scored), state.ring_bytes() / 2**20, state.max_requests,
                    state.window, tp_rank, tp_size, pp_rank, pp_size, k)

    def initialize_from_config(self, *args: object, **kwargs: object) -> None:
        super().initialize_from_config(*args, **kwargs)
        state = self.nexus_state
        assert state is not None
        # V2 runners create their block tables with the KV cache: adapt to it now, for
        # the one group eviction works on.
        adapter = runner_adapter(self.model_runner, self._evicted_group())
        logger.info("nexus-vllm worker: %s model runner (%s)", adapter.name,
                    type(self.model_runner).__name__)
        self._bind(adapter)

    def extend_kv_cache(self, *args: object, **kwargs: object) -> object:
        # vLLM 0.34 (extensible KV cache): every layer's KV tensors are replaced after
        # warm-up; key views taken before would read the old ones.
        out: object = super().extend_kv_cache(*args, **kwargs)  # type: ignore[misc]
        state = self.nexus_state
        if state is not None and state.runner is not None:
            self._bind(state.runner)
            logger.info("nexus-vllm worker: key views re-bound after the KV cache grew")
        return out

    def _evicted_group(self) -> int:
        """The KV cache group eviction works on: the one full-attention group (hybrid
        models put sliding-window layers in groups of their own, left to vLLM)."""
        try:
            roles = {g.kv_cache_group_id: group_role(g.kv_cache_spec)
                     for g in attention_groups(self.model_runner)}
        except UnsupportedKVCacheGroup as exc:
            raise RuntimeError(f"nexus-vllm cannot evict from this model: {exc}") from None
        evicted = sorted(i for i, role in roles.items() if role == "evicted")
        if len(evicted) != 1:
            raise RuntimeError(f"nexus-vllm: eviction needs exactly one full-attention KV "
                               f"cache group; this model has {len(evicted)}")
        return evicted[0]

    def _bind(self, adapter: RunnerAdapter) -> None:
        state = self.nexus_state
        assert state is not None
        runner = self.model_runner
        for group in attention_groups(runner):
            if getattr(group, "kernel_block_size", None) is not None:
                raise RuntimeError(
                    f"nexus-vllm: attention backend {group.backend.get_name()} needs kernel "
                    f"blocks of {group.kernel_block_size} tokens inside the "
                    f"{self.cache_config.block_size}-token KV blocks; choose a --block-size "
                    "the backend supports natively")
            # Sliding-window groups are built as vLLM builds them (never compacted).
            compacted = group.kv_cache_group_id == adapter.group
            for builder in group_builders(group):
                if not isinstance(builder, NexusMetadataBuilderMixin):
                    raise RuntimeError(f"nexus-vllm: metadata builder "
                                       f"{type(builder).__name__} has no eviction support")
                builder.nexus_compactor = state.compactor if compacted else None
        scored: dict[int, LayerKeys] = {}
        for view in attention_layers(self.vllm_config):
            idx = layer_index(view.name)
            impl = view.impl
            assert isinstance(impl, NexusAttentionImplMixin)  # load_model checked it
            impl.nexus_ring = state.ring
            impl.nexus_layer = idx
            impl.nexus_self_check = state.self_check
            if isinstance(impl, NexusMLAImplMixin):
                impl.nexus_mla_layer = view.layer  # its W_UK_T absorbs prompt queries
            if idx in self._nexus_scored:
                backend = wrapped_backend_name(view.layer.attn_backend)
                keys = key_view(backend, view.kv_cache, int(view.impl.head_size),
                                getattr(view.layer, "isa", None))
                scored[idx] = LayerKeys(view.name, keys)
        state.bind_layers(adapter, scored)

    # -- one step ----------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        state = self.nexus_state
        assert state is not None
        self._nexus_scored_step = None
        step = self._nexus_begin(state, scheduler_output)
        try:
            output = super().execute_model(scheduler_output)
            pending = self._nexus_score(state, step)
        except BaseException:
            state.end_step(step)  # never leave masked entries or armed hooks behind
            raise
        if output is None:
            # The output comes from sample_tokens, which replies.
            self._nexus_scored_step = (step, pending)
            return None
        # A step without tokens returns EMPTY_MODEL_RUNNER_OUTPUT: the reply rides on it.
        return self._reply_on(output, step, pending)

    @gpu_sync_check
    def _nexus_begin(self, state: WorkerEvictionState,
                     scheduler_output: SchedulerOutput) -> Step:
        return state.begin_step(scheduler_output, read_plan(scheduler_output))

    @gpu_sync_check
    def _nexus_score(self, state: WorkerEvictionState, step: Step) -> PendingScores | None:
        return state.finish_forward(step)

    def sample_tokens(self, grammar_output: GrammarOutput | None
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        state = self.nexus_state
        assert state is not None
        assert state.runner is not None
        scored, self._nexus_scored_step = self._nexus_scored_step, None
        with state.runner.sampling_guard():
            output = super().sample_tokens(grammar_output)
        return output if scored is None else self._reply_on(output, *scored)

    def _reply_on(self, output: ModelRunnerOutput | AsyncModelRunnerOutput, step: Step,
                  pending: PendingScores | None
                  ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """``output`` carrying ``step``'s reply (``pending``: its scores from
        ``finish_forward``); ``step`` is ended."""
        state = self.nexus_state
        assert state is not None
        token = state.reply_token(step, pending)
        state.end_step(step)
        if is_async_output(output):
            assert isinstance(output, AsyncModelRunnerOutput)
            return ReplyingAsyncOutput(output, token)
        return attach_reply(output, token.reply())
