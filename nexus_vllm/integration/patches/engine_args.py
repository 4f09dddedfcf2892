"""Patch: ``--kv-*`` flags on ``vllm serve`` and their translation into engine arguments.

Why
    vLLM has no hook for plugins to add CLI flags. ``AsyncEngineArgs.add_cli_args`` calls
    ``load_general_plugins()`` *before* it calls ``EngineArgs.add_cli_args``, so a general
    plugin can wrap the latter and the flags show in ``vllm serve --help``; the values are
    dropped by ``EngineArgs.from_cli_args`` (it keeps dataclass fields only), so that is
    wrapped too.
How
    * ``add_cli_args``: add a "Nexus KV eviction" argument group (argparse validates each
      value and names the flag on error): ``--kv-eviction``, ``--kv-budget``,
      ``--kv-keep-ratio``, ``--kv-eviction-config``, ``--kv-eviction-seed``,
      ``--kv-chunk-size``, ``--kv-prompt-mode``, ``--kv-prefill-budget``.
    * ``from_cli_args``: merge ``--kv-eviction-config`` < ``--additional-config nexus`` <
      flags into one validated ``EvictionConfig``; store it in
      ``additional_config["nexus"]`` (reaches every process inside ``VllmConfig``).
    * ``create_engine_config``: for an evicting config refuse what eviction cannot run
      with (each refusal names the flag and what to use instead), select our scheduler
      and worker, set the block size, chunked prefill at ``chunk_size`` tokens per request
      and step, synchronous scheduling (see ``check_engine_args``) and, on CUDA,
      PIECEWISE CUDA graphs; the model runner stays the one vLLM picks (every runner
      family has an adapter, ``integration/runners.py``); after vLLM
      builds its config, refuse models with sliding
      windows, ALiBi, MLA, hybrid layers or an encoder, and settings that cannot work
      within its ``max_model_len`` (``check_max_model_len``: a budget above it never
      evicts); vLLM's own refusal of the chunk size is restated naming
      ``--kv-chunk-size``. Also covers the Python
      ``LLM(..., additional_config={"nexus": {...}})`` path.
vLLM version
    0.32 to 0.34 (``vllm/engine/arg_utils.py``).
Plan
    Replace by a plugin CLI hook if vLLM grows one.
"""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from nexus_vllm.core.config import PROMPT_MODES
from nexus_vllm.integration.config import (
    ADDITIONAL_CONFIG_KEY,
    CLI_FLAGS,
    METHODS,
    check_max_model_len,
    config_from_additional,
    resolve_config,
)
from nexus_vllm.integration.patches.catalogue import swap

__all__ = ["apply", "translate_engine_args"]

logger = init_logger(__name__)

SCHEDULER_CLS = "nexus_vllm.integration.scheduler.NexusScheduler"
WORKER_CLS = "nexus_vllm.integration.worker.NexusWorker"
_DEFAULT_SCHEDULERS = (None, "vllm.v1.core.sched.scheduler.Scheduler", SCHEDULER_CLS)


def _int_at_least(low: int, meaning: str) -> Callable[[str], int]:
    """argparse type: an int >= ``low``; errors say ``must be {meaning}``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {meaning}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {meaning}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def add_nexus_args(parser: Any) -> Any:
    """Add the ``--kv-*`` flags to ``parser`` (no-op when already there)."""
    if "--kv-eviction" in getattr(parser, "_option_string_actions", {}):
        return parser
    group = parser.add_argument_group(
        title="Nexus KV eviction (nexus-vllm plugin)",
        description="Streaming KV-cache eviction under a per-request token budget.",
    )
    group.add_argument("--kv-eviction", choices=METHODS, default=None,
                       help="Eviction method; 'none' (default) leaves vLLM unchanged.")
    group.add_argument("--kv-budget", type=_positive_int, default=None, metavar="TOKENS",
                       help="KV budget per request, in tokens.")
    group.add_argument("--kv-keep-ratio", type=_ratio, default=None, metavar="R",
                       help="KV budget as a fraction of the tokens seen (instead of "
                            "--kv-budget).")
    group.add_argument("--kv-eviction-config", type=str, default=None, metavar="FILE|NAME",
                       help="YAML/JSON file of eviction knobs, or a shipped preset's name "
                            "(e.g. nexus-fast; `nexus-vllm presets` lists them).")
    group.add_argument("--kv-eviction-seed", type=_non_negative_int, default=None,
                       help="Seed of the block sampler (per request: mixed with the "
                            "request's seed).")
    group.add_argument("--kv-chunk-size", type=_positive_int, default=None, metavar="TOKENS",
                       help="Prefill chunk of evicting requests (default 512): a request "
                            "never holds more than budget + one chunk.")
    group.add_argument("--kv-prompt-mode", choices=PROMPT_MODES, default=None,
                       help="When the budget holds: 'stream' (default) from the first "
                            "prompt chunk, an event after each; 'end' keeps the prompt "
                            "(up to --kv-prefill-budget) until its last chunk, then one "
                            "event, with the question in its window, evicts to the budget; "
                            "'keep' never evicts the prompt (the budget counts generated "
                            "tokens). Per request: vllm_xargs kv_prompt_mode.")
    group.add_argument("--kv-prefill-budget", type=_positive_int, default=None,
                       metavar="TOKENS",
                       help="With --kv-prompt-mode end: tokens a request may keep while its "
                            "prompt is computed (default: the whole prompt); at least the "
                            "budget. Per request: vllm_xargs kv_prefill_budget.")
    return parser


def _flags_from_namespace(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for flag, field in CLI_FLAGS.items():
        out[field] = getattr(args, flag[2:].replace("-", "_"), None)
    return out


def _apply_cli_config(engine_args: Any, args: argparse.Namespace) -> None:
    flags = _flags_from_namespace(args)
    file = getattr(args, "kv_eviction_config", None)
    additional = dict(getattr(engine_args, "additional_config", None) or {})
    nexus = additional.get(ADDITIONAL_CONFIG_KEY)
    # ``nexus`` of 0, "" or [] is an error (resolve_config), not a silent "off".
    if not file and nexus in (None, {}) and all(v is None for v in flags.values()):
        return
    # vLLM's --block-size sets the block size (translate_engine_args), hence the budget
    # floor: check the budget against it here, where the error can name the flags.
    if getattr(engine_args, "block_size", None) is not None:
        flags["block_size"] = engine_args.block_size
    try:
        cfg = resolve_config(file=file, additional=nexus, flags=flags)
    except ValueError as exc:
        # A clean one-line startup error naming the flag, like argparse's.
        raise SystemExit(f"vllm serve: error: {exc}") from None
    if cfg.method == "none" and not nexus:
        return
    additional[ADDITIONAL_CONFIG_KEY] = cfg.to_dict()
    engine_args.additional_config = additional


def _refuse(cfg: Any, what: str, instead: str) -> ValueError:
    return ValueError(f"--kv-eviction {cfg.method}: {what} is not supported with eviction; "
                      f"{instead}")


def check_engine_args(engine_args: Any, cfg: Any) -> None:
    """Refuse engine settings eviction cannot run with, each with what to do instead.

    Raises
    ------
    ValueError
        Naming the flag.
    """
    for name in ("pipeline_parallel_size", "data_parallel_size",
                 "decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(engine_args, name, 1) or 1) > 1:
            flag = "--" + name.replace("_", "-")
            raise _refuse(cfg, f"{flag} > 1", "use --tensor-parallel-size to shard a model "
                          "(every rank then applies the same evictions)")
    if getattr(engine_args, "long_prefill_token_threshold_adaptive", False):
        raise _refuse(cfg, "--long-prefill-token-threshold-adaptive",
                      "drop the flag: it raises the per-request prefill cap above "
                      "--kv-chunk-size, and a request may then hold more than budget + chunk")
    if getattr(engine_args, "enable_dbo", False):
        raise _refuse(cfg, "--enable-dbo (dual-batch overlap)", "drop the flag")
    if getattr(engine_args, "speculative_config", None):
        raise _refuse(cfg, "--speculative-config (speculative decoding)",
                      "serve without a draft model")
    kv_dtype = str(getattr(engine_args, "kv_cache_dtype", "auto") or "auto")
    if kv_dtype not in ("auto", "float16", "bfloat16", "float32"):
        raise _refuse(cfg, f"--kv-cache-dtype {kv_dtype} (a quantized KV cache)",
                      "use --kv-cache-dtype auto")
    if getattr(engine_args, "async_scheduling", None):
        raise _refuse(cfg, "--async-scheduling", "drop the flag: evictions decided after a "
                      "step must reach the workers before the next step is scheduled")
    if getattr(engine_args, "kv_transfer_config", None) is not None:
        raise _refuse(cfg, "--kv-transfer-config (a KV connector)",
                      "serve without a KV connector")
    if engine_args.scheduler_cls not in _DEFAULT_SCHEDULERS:
        raise _refuse(cfg, f"--scheduler-cls {engine_args.scheduler_cls}",
                      "eviction replaces the scheduler; drop the flag")
    if engine_args.worker_cls not in ("auto", WORKER_CLS):
        raise _refuse(cfg, f"--worker-cls {engine_args.worker_cls}",
                      "eviction replaces the worker; drop the flag")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        mode = _cudagraph_mode(engine_args)
        if mode is not None and mode.has_full_cudagraphs():
            raise _refuse(
                cfg, f"cudagraph_mode {mode.name}",
                "eviction reads each step's queries inside attention, which a FULL CUDA "
                "graph replays without running Python; use -cc "
                "'{\"cudagraph_mode\": \"PIECEWISE\"}' (the default with eviction on) or "
                "--enforce-eager")


def _cudagraph_mode(engine_args: Any) -> Any:
    cc = getattr(engine_args, "compilation_config", None)
    if cc is None:
        return None
    mode = cc.get("cudagraph_mode") if isinstance(cc, dict) else getattr(
        cc, "cudagraph_mode", None)
    if isinstance(mode, str):
        from vllm.config.compilation import CUDAGraphMode

        mode = CUDAGraphMode[mode.upper()]
    return mode


def check_model_config(vllm_config: Any, cfg: Any) -> None:
    """Refuse models eviction cannot run on (after vLLM has built its config)."""
    model = vllm_config.model_config
    reasons = []
    if model.get_sliding_window() is not None:
        reasons.append("sliding-window attention")
    if model.uses_alibi:
        reasons.append("ALiBi position biases")
    if model.use_mla:
        reasons.append("multi-head latent attention (MLA)")
    if model.is_hybrid:
        reasons.append("hybrid attention/state-space layers")
    if model.is_encoder_decoder:
        reasons.append("an encoder-decoder architecture")
    # Both hand builders logical positions that compacted lengths would misplace.
    if model.is_mm_prefix_lm:
        reasons.append("bidirectional multimodal prefixes")
    if model.rswa_window is not None:
        reasons.append("reference sliding-window attention")
    if reasons:
        raise ValueError(
            f"--kv-eviction {cfg.method}: model {model.model} uses {' and '.join(reasons)}; "
            "eviction supports decoder-only models with full attention and one KV cache "
            "group (serve this model with --kv-eviction none)")
    # Only now is max_model_len known (vLLM derives it from the model when not given).
    layers = getattr(model.hf_text_config, "num_hidden_layers", None)
    try:
        check_max_model_len(cfg, int(model.max_model_len),
                            layers if isinstance(layers, int) else None)
    except ValueError as exc:
        # The "--kv-eviction" prefix makes the CLI path exit with this one line.
        raise ValueError(f"--kv-eviction {cfg.method}: {exc}") from None


def explain_vllm_refusal(cfg: Any, exc: ValueError) -> ValueError | None:
    """vLLM's refusal of a value the plugin derived from a ``--kv-*`` flag, restated as
    one line naming that flag (None when ``exc`` is not one)."""
    if cfg is None:
        return None
    # translate_engine_args passes --kv-chunk-size as long_prefill_token_threshold, which
    # vLLM's SchedulerConfig refuses above max_model_len (a multi-line pydantic error).
    m = re.search(r"long_prefill_token_threshold \((\d+)\) cannot be greater than the "
                  r"max_model_len \((\d+)\)", str(exc))
    if m is None:
        return None
    return ValueError(f"--kv-eviction {cfg.method}: --kv-chunk-size {m.group(1)} is above "
                      f"--max-model-len {m.group(2)}; allowed: 1..{m.group(2)} tokens")


def translate_engine_args(engine_args: Any) -> Any | None:
    """Rewrite ``engine_args`` in place for an evicting config; return the config."""
    try:
        cfg = config_from_additional(engine_args.additional_config)
    except ValueError as exc:
        raise ValueError(f"--additional-config nexus: {exc}") from exc
    if cfg is None:
        return None
    check_engine_args(engine_args, cfg)
    from vllm.platforms import current_platform

    engine_args.scheduler_cls = SCHEDULER_CLS
    engine_args.worker_cls = WORKER_CLS
    if engine_args.block_size is None:
        engine_args.block_size = cfg.block_size
    elif engine_args.block_size != cfg.block_size:
        cfg = cfg.replace(block_size=int(engine_args.block_size))
    # Prefix caching stays as the user set it: an evicting request publishes only the
    # blocks it computed before its first eviction (prefix_cache.py, the clean watermark).
    engine_args.enable_chunked_prefill = True
    # Each evicting request prefills at most one chunk per step; an eviction event
    # follows each chunk, so a request never holds more than budget + one chunk.
    engine_args.long_prefill_token_threshold = int(cfg.chunk_size)
    # The block list of a request is bounded by the budget, not the prompt.
    engine_args.scheduler_reserve_full_isl = False
    # Evictions decided after step N must reach the worker before step N+1 is built
    # (with async scheduling, step N+1 is scheduled before step N's scores return).
    engine_args.async_scheduling = False
    if not current_platform.is_cpu() and _cudagraph_mode(engine_args) is None:
        from vllm.config.compilation import CUDAGraphMode

        # Attention runs eagerly between piecewise graphs, so the query hook runs on
        # every step, decode included.
        cc = engine_args.compilation_config
        if isinstance(cc, dict):
            cc["cudagraph_mode"] = CUDAGraphMode.PIECEWISE
        else:
            cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    additional = dict(engine_args.additional_config)
    additional[ADDITIONAL_CONFIG_KEY] = cfg.to_dict()
    engine_args.additional_config = additional
    logger.info("nexus-vllm: KV eviction %s, budget %s tokens / keep ratio %s, block %d, "
                "chunk %d, prompt mode %s (prefill budget %s)", cfg.method, cfg.max_tokens,
                cfg.keep_ratio, cfg.block_size, cfg.chunk_size, cfg.prompt_mode,
                cfg.prefill_budget)
    return cfg


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.add_cli_args, "_nexus_patched", False):
        return
    orig_add = EngineArgs.add_cli_args
    orig_from = EngineArgs.from_cli_args.__func__  # type: ignore[attr-defined]
    orig_create = EngineArgs.create_engine_config

    @functools.wraps(orig_add)
    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = orig_add(parser, *args, **kwargs)
        return add_nexus_args(parser)

    @functools.wraps(orig_from)
    def from_cli_args(cls: Any, args: argparse.Namespace) -> Any:
        engine_args = orig_from(cls, args)
        _apply_cli_config(engine_args, args)
        engine_args._nexus_from_cli = True
        return engine_args

    @functools.wraps(orig_create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            cfg = translate_engine_args(self)
            try:
                vllm_config = orig_create(self, *args, **kwargs)
            except ValueError as exc:
                ours = explain_vllm_refusal(cfg, exc)
                if ours is None:
                    raise
                raise ours from exc
            if cfg is not None:
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
