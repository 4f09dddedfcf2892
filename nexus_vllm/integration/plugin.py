"""``register()`` body: runs in every vLLM process (API server, engine core, workers).

Only patches that live in the API server are installed here (CLI flags, request
validation, metrics export); they are cheap and inert without ``--kv-eviction``. The
scheduler, worker and attention backend are selected per configuration through vLLM's
``scheduler_cls`` / ``worker_cls`` settings, so a server started without eviction runs
stock vLLM code.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    from nexus_vllm.integration.patches import apply_all

    apply_all()
