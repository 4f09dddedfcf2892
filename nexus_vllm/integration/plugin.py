"""``register()`` body: runs in every vLLM process (API server, engine core, workers).

Only patches that live in the API server are installed here (CLI flags, request
validation, metrics export); they are cheap and inert without ``--kv-eviction``. The
scheduler, worker and attention backends are selected per configuration through vLLM's
``scheduler_cls`` / ``worker_cls`` settings (the worker re-registers the attention
backends), so a server started without eviction runs stock vLLM code.
"""

from __future__ import annotations

import logging

__all__ = ["register"]


def _share_vllm_logging() -> None:
    """Log ``nexus_vllm.*`` through vLLM's handler, level and format (vLLM configures
    only its own ``vllm`` logger)."""
    ours = logging.getLogger("nexus_vllm")
    if ours.handlers:
        return
    theirs = logging.getLogger("vllm")
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = not theirs.handlers


def register() -> None:
    import vllm.logger  # noqa: F401 - configures vLLM's logging first

    from nexus_vllm.integration.patches import apply_all

    _share_vllm_logging()
    apply_all()
