"""Patch: ``--kv-*`` flags on ``vllm serve`` and their translation into engine arguments.

Why
    vLLM has no hook for plugins to add CLI flags. ``AsyncEngineArgs.add_cli_args`` calls
    ``load_general_plugins()`` *before* it calls ``EngineArgs.add_cli_args``, so a general
    plugin can wrap the latter and the flags show in ``vllm serve --help``; the values are
    dropped by ``EngineArgs.from_cli_args`` (it keeps dataclass fields only), so that is
    wrapped too.
How
    * ``add_cli_args``: add the "Nexus KV eviction" argument group
      (``server_config.add_cli_flags``; argparse validates each value and names the flag
      on error).
    * ``from_cli_args``: merge ``--kv-eviction-config`` < ``--additional-config nexus`` <
      flags into one validated ``EvictionConfig`` and store it in
      ``additional_config["nexus"]`` (``server_config.additional_config_from_cli``; it
      reaches every process inside ``VllmConfig``).
    * ``create_engine_config``: for an evicting config, read the engine arguments into
      ``engine_policy.EngineSettings``, refuse what eviction cannot run with (each
      refusal names the flag and what to use instead), set what it forces (our scheduler
      and worker, the block size, chunked prefill at ``chunk_size`` tokens per request
      and step and, on CUDA, PIECEWISE CUDA graphs; the model runner stays the one vLLM
      picks, every family has an adapter in ``integration/compat/runners.py``); after
      vLLM builds its config, pick our async scheduler where vLLM settled on async
      scheduling (its default on CUDA from 0.34), refuse an executor whose workers skip
      the worker's methods (vLLM 0.32's compiled-graph Ray executor), refuse models whose
      attention eviction cannot run on (``vllm_compat.model_attention_traits``, the same
      check the worker makes per layer) and settings that cannot work within its
      ``max_model_len`` or, for an MLA model, with the chunked prefill the platform left
      (``engine_policy.check_latent_attention``); an MLA model on the CPU is pinned to
      vLLM's reference ``CPU_MLA`` backend, the one eviction wraps, where a CPU with AMX
      tiles would get the AMX kernels (``pin_reference_cpu_mla``); an MLA model's eviction
      config takes the block size the platform forced (16 on CPU:
      ``adopt_platform_block_size``);
      vLLM's own refusal of the chunk size is restated naming ``--kv-chunk-size``. The
      policy itself is ``integration/frontend/engine_policy.py``. Also covers the Python
      ``LLM(..., additional_config={"nexus": {...}})`` path.
vLLM version
    0.32 to 0.34 (``vllm/engine/arg_utils.py``).
Plan
    Replace by a plugin CLI hook if vLLM grows one.
"""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from nexus_vllm.integration.compat.catalogue import swap
from nexus_vllm.integration.compat.vllm_compat import executor_skipping_worker
from nexus_vllm.integration.config import ADDITIONAL_CONFIG_KEY, config_from_additional
from nexus_vllm.integration.frontend.engine_policy import (
    EngineSettings,
    LatentAttention,
    check_engine_settings,
    check_executor,
    check_latent_attention,
    check_model,
    forced_cudagraph_mode,
    forced_engine_args,
    restate_vllm_refusal,
    scheduler_cls_for,
    with_engine_block_size,
)
from nexus_vllm.integration.frontend.server_config import (
    add_cli_flags,
    additional_config_from_cli,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from nexus_vllm.core import EvictionConfig

__all__ = ["adopt_platform_block_size", "apply", "check_model_config", "engine_settings",
           "latent_attention", "match_scheduler", "translate_engine_args"]

logger = init_logger(__name__)


def _cudagraph_mode(engine_args: EngineArgs) -> CUDAGraphMode | None:
    """The ``CUDAGraphMode`` given in ``engine_args`` (None: vLLM picks one)."""
    cc = getattr(engine_args, "compilation_config", None)
    if cc is None:
        return None
    mode = cc.get("cudagraph_mode") if isinstance(cc, dict) else getattr(
        cc, "cudagraph_mode", None)
    if isinstance(mode, str):
        from vllm.config.compilation import CUDAGraphMode

        mode = CUDAGraphMode[mode.upper()]
    return mode


def engine_settings(engine_args: EngineArgs) -> EngineSettings:
    """What ``engine_policy`` reads of vLLM's ``EngineArgs`` (``getattr``: a field a
    release lacks reads as its default; ``tests/integration/test_vllm_sources.py`` checks
    that every one exists)."""
    from vllm.platforms import current_platform

    on_cpu = bool(current_platform.is_cpu())
    mode = None if on_cpu else _cudagraph_mode(engine_args)
    sizes = {name: int(getattr(engine_args, name, 1) or 1) for name in (
        "pipeline_parallel_size", "data_parallel_size", "decode_context_parallel_size",
        "prefill_context_parallel_size")}
    return EngineSettings(
        **sizes,
        long_prefill_token_threshold_adaptive=bool(
            getattr(engine_args, "long_prefill_token_threshold_adaptive", False)),
        enable_dbo=bool(getattr(engine_args, "enable_dbo", False)),
        speculative=bool(getattr(engine_args, "speculative_config", None)),
        kv_cache_dtype=str(getattr(engine_args, "kv_cache_dtype", "auto") or "auto"),
        kv_connector=getattr(engine_args, "kv_transfer_config", None) is not None,
        scheduler_cls=engine_args.scheduler_cls,
        worker_cls=engine_args.worker_cls,
        on_cpu=on_cpu,
        cudagraph_mode=None if mode is None else mode.name,
        full_cudagraphs=mode is not None and bool(mode.has_full_cudagraphs()),
    )


def translate_engine_args(engine_args: EngineArgs) -> EvictionConfig | None:
    """Rewrite ``engine_args`` in place for an evicting config; return the config."""
    try:
        cfg = config_from_additional(engine_args.additional_config)
    except ValueError as exc:
        raise ValueError(f"--additional-config nexus: {exc}") from exc
    if cfg is None:
        return None
    settings = engine_settings(engine_args)
    check_engine_settings(cfg.method, settings)
    cfg = with_engine_block_size(cfg, engine_args.block_size)
    for name, value in forced_engine_args(cfg).items():
        setattr(engine_args, name, value)
    mode = forced_cudagraph_mode(settings)
    if mode is not None:
        from vllm.config.compilation import CUDAGraphMode

        cc = engine_args.compilation_config
        if isinstance(cc, dict):
            cc["cudagraph_mode"] = CUDAGraphMode[mode]
        else:
            cc.cudagraph_mode = CUDAGraphMode[mode]
    additional = dict(engine_args.additional_config)
    additional[ADDITIONAL_CONFIG_KEY] = cfg.to_dict()
    engine_args.additional_config = additional
    logger.info("nexus-vllm: KV eviction %s, budget %s tokens / keep ratio %s, block %d, "
                "chunk %d, prompt mode %s (prefill budget %s)", cfg.method, cfg.max_tokens,
                cfg.keep_ratio, cfg.block_size, cfg.chunk_size, cfg.prompt_mode,
                cfg.prefill_budget)
    return cfg


def match_scheduler(vllm_config: VllmConfig) -> None:
    """Our scheduler class for the scheduling vLLM settled on. vLLM decides
    ``async_scheduling`` while it builds its config (its default, the executor, the
    platform: the CPU platform turns it off), after the engine arguments are read."""
    scheduler = vllm_config.scheduler_config
    scheduler.scheduler_cls = scheduler_cls_for(bool(scheduler.async_scheduling))


def check_model_config(vllm_config: VllmConfig, cfg: EvictionConfig) -> None:
    """Refuse models eviction cannot run on (after vLLM has built its config)."""
    from nexus_vllm.integration.compat.vllm_compat import model_attention_traits

    model = vllm_config.model_config
    layers = getattr(model.hf_text_config, "num_hidden_layers", None)
    # Only now is max_model_len known (vLLM derives it from the model when not given).
    hybrid = not bool(vllm_config.scheduler_config.disable_hybrid_kv_cache_manager)
    check_model(cfg, str(model.model), model_attention_traits(model, hybrid),
                int(model.max_model_len), layers if isinstance(layers, int) else None)
    latent = latent_attention(vllm_config)
    if latent is not None:
        check_latent_attention(cfg, latent)


def latent_attention(vllm_config: VllmConfig) -> LatentAttention | None:
    """What eviction must know of an MLA model where it is served (None: not MLA): read
    after vLLM built its config, as the platform may have turned chunked prefill off."""
    if not getattr(vllm_config.model_config, "use_mla", False):
        return None
    return LatentAttention(chunked_prefill=bool(getattr(
        vllm_config.scheduler_config, "enable_chunked_prefill", True)))


def pin_reference_cpu_mla(engine_args: EngineArgs, vllm_config: VllmConfig) -> bool:
    """Ask for vLLM's reference CPU MLA backend (``CPU_MLA``) where the CPU platform would
    pick its AMX one for an MLA model; True when ``engine_args`` changed and the config must
    be built again.

    Eviction on MLA wraps ``CPU_MLA`` only (``worker/mla.py``). On a CPU with AMX tiles
    vLLM 0.32's ``CpuPlatform.check_and_update_config`` (vllm/platforms/cpu.py:246-255)
    runs MLA on AMX kernels with chunked prefill and 128-token blocks unless the backend is
    named ``CPU_MLA``; without the pin the same ``vllm serve`` line would start here and
    fail in the worker on another host. A backend the user named is left as it is (the
    worker refuses one it cannot wrap, naming it).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() \
            or not getattr(vllm_config.model_config, "use_mla", False) \
            or getattr(engine_args, "attention_backend", None) is not None \
            or getattr(getattr(engine_args, "attention_config", None), "backend",
                       None) is not None:
        return False
    chosen = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if chosen is not None and chosen.name == "CPU_MLA":
        return False
    logger.info("nexus-vllm: serving this MLA model on vLLM's CPU_MLA backend, the one "
                "eviction wraps (the platform would pick its AMX kernels here)")
    # By name, as `--attention-backend CPU_MLA` gives it: vLLM turns it into its enum.
    setattr(engine_args, "attention_backend", "CPU_MLA")  # noqa: B010
    return True


def adopt_platform_block_size(vllm_config: VllmConfig, cfg: EvictionConfig) -> EvictionConfig:
    """``cfg`` in the block size the platform settled on, written back to
    ``additional_config``: vLLM's CPU platform forces 16-token blocks for its MLA backend
    (``CpuPlatform.check_and_update_config``, vllm/platforms/cpu.py:273-280 in 0.32), after
    the engine arguments (and our block size) were read. MLA models only: elsewhere the
    block size we force is the one vLLM keeps."""
    block = getattr(vllm_config.cache_config, "block_size", None)
    if not getattr(vllm_config.model_config, "use_mla", False) or block is None \
            or int(block) == cfg.block_size:
        return cfg
    logger.info("nexus-vllm: the platform runs this MLA model with %d-token KV blocks; "
                "eviction uses them (nexus.block_size %d -> %d)", block, cfg.block_size,
                block)
    cfg = with_engine_block_size(cfg, int(block))
    additional: dict[str, Any] = dict(vllm_config.additional_config)  # type: ignore[arg-type]
    additional[ADDITIONAL_CONFIG_KEY] = cfg.to_dict()
    vllm_config.additional_config = additional
    return cfg


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.add_cli_args, "_nexus_patched", False):
        return
    orig_add = EngineArgs.add_cli_args
    orig_from = EngineArgs.from_cli_args.__func__  # type: ignore[attr-defined]
    orig_create = EngineArgs.create_engine_config

    @functools.wraps(orig_add)
    def add_cli_args(parser: FlexibleArgumentParser, *args: object,
                     **kwargs: object) -> FlexibleArgumentParser:
        parser = orig_add(parser, *args, **kwargs)
        return add_cli_flags(parser)

    @functools.wraps(orig_from)
    def from_cli_args(cls: type[EngineArgs], args: argparse.Namespace) -> EngineArgs:
        engine_args = orig_from(cls, args)
        try:
            additional = additional_config_from_cli(
                args, getattr(engine_args, "additional_config", None),
                getattr(engine_args, "block_size", None))
        except ValueError as exc:
            # A clean one-line startup error naming the flag, like argparse's.
            raise SystemExit(f"vllm serve: error: {exc}") from None
        if additional is not None:
            engine_args.additional_config = additional
        engine_args._nexus_from_cli = True
        return engine_args

    @functools.wraps(orig_create)
    def create_engine_config(self: EngineArgs, *args: Any, **kwargs: Any) -> VllmConfig:
        try:
            cfg = translate_engine_args(self)
            try:
                vllm_config = orig_create(self, *args, **kwargs)
                if cfg is not None and pin_reference_cpu_mla(self, vllm_config):
                    vllm_config = orig_create(self, *args, **kwargs)
            except ValueError as exc:
                ours = None if cfg is None else restate_vllm_refusal(cfg.method, str(exc))
                if ours is None:
                    raise
                raise ValueError(ours) from exc
            if cfg is not None:
                cfg = adopt_platform_block_size(vllm_config, cfg)
                match_scheduler(vllm_config)
                check_executor(cfg.method, executor_skipping_worker(vllm_config))
                check_model_config(vllm_config, cfg)
        except ValueError as exc:
            if getattr(self, "_nexus_from_cli", False) and "--kv-eviction" in str(exc):
                # A clean one-line startup error naming the flag, like argparse's.
                raise SystemExit(f"vllm serve: error: {exc}") from None
            raise
        return vllm_config

    add_cli_args._nexus_patched = True  # type: ignore[attr-defined]
    swap(EngineArgs, "add_cli_args", staticmethod(add_cli_args))
    swap(EngineArgs, "from_cli_args", classmethod(from_cli_args))
    swap(EngineArgs, "create_engine_config", create_engine_config)
