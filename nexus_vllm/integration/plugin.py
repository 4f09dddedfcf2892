"""``register()`` body: runs in every vLLM process (API server, engine core, workers).

vLLM calls ``register()`` without a guard, so nothing here may raise. The installed
vLLM's version is read first, from its distribution metadata: outside the supported range
(``integration/compat/versions.py``) no patch is applied and one line is logged, naming the
range; ``--kv-eviction`` is then an unknown flag and stock serving is unaffected.
Otherwise only patches that live in the API server are installed (CLI flags, request
validation, metrics export), all or nothing; they are cheap and inert without
``--kv-eviction``. The
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


def register() -> bool:
    """Install the plugin in this process; returns whether its patches are in place."""
    from vllm.logger import init_logger  # configures vLLM's logging first

    from nexus_vllm.integration.compat.versions import SUPPORTED_VLLM, installed_vllm_version
    from nexus_vllm.integration.compat.versions import is_supported as supported

    _share_vllm_logging()
    version = installed_vllm_version()
    if version is None or not supported(version):
        init_logger(__name__).warning(
            "nexus-vllm supports vLLM %s; this is vLLM %s: no patch applied, the --kv-* "
            "flags are unavailable and vLLM runs unchanged", SUPPORTED_VLLM, version)
        return False
    from nexus_vllm.integration.frontend.patches import apply_all

    return apply_all()
