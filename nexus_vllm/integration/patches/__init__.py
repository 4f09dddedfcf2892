"""Monkey-patches of vLLM internals, one module per patch (pinned to vLLM 0.32.0).

Every module documents **Why** it exists, **How** it works and the **Plan** to drop it.
``apply_all()`` is idempotent; each patch keeps the original callable on the wrapper as
``__wrapped__`` and is checked by ``tests/integration/test_vllm_hooks.py`` so that a
signature change in a new vLLM release fails loudly instead of silently.

| module            | target                                              | process    |
|-------------------|-----------------------------------------------------|------------|
| engine_args       | ``EngineArgs.add_cli_args`` / ``from_cli_args`` /   | API server |
|                   | ``create_engine_config``                            |            |
| input_processor   | ``InputProcessor._validate_params``                 | API server |
| stat_logger       | ``StatLoggerManager.record``                        | API server |

Scheduler, worker and attention backend are *subclasses* selected through vLLM's own
``scheduler_cls`` / ``worker_cls`` / backend registry (``CPU_ATTN`` re-registered by the
worker), not patches. Two of their overrides lean on vLLM 0.32 internals and are tested
in ``test_vllm_hooks.py`` too:

* ``NexusScheduler.get_request_counts``: vLLM drops the per-request prefill cap
  (``long_prefill_token_threshold``) when a single request is eligible; the override keeps
  it for the first count inside ``schedule()`` so evicting prompts are always chunked.
* ``NexusWorker.sample_tokens``: vLLM rewinds seeded generators of partial-prefill rows
  with ``Generator.set_offset``, which CPU generators reject (the engine dies on the first
  seeded request with a chunked prompt); the override parks those generators for the
  sampling step and restores their state, which is what the rewind means.
"""

from __future__ import annotations

__all__ = ["apply_all"]

_APPLIED = False


def apply_all() -> None:
    """Install every patch once per process."""
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    from nexus_vllm.integration.patches import engine_args, input_processor, stat_logger

    engine_args.apply()
    input_processor.apply()
    stat_logger.apply()
