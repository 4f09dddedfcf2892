"""nexus-vllm: streaming KV-cache eviction for vLLM with Nexus Sampling."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__", "register"]

_REGISTERED = False


def register() -> None:
    """vLLM general-plugin entry point (``vllm.general_plugins``).

    Idempotent and cheap: vLLM calls it in every process it starts. Heavy imports
    (vLLM, torch) happen here, never at package import time. It never raises: vLLM
    calls plugins without a guard, and a broken plugin must not break stock vLLM.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    try:
        from nexus_vllm.integration.plugin import register as _register

        _register()
    except Exception:
        import logging

        logging.getLogger("vllm").exception(
            "nexus-vllm failed to load; vLLM runs without it (--kv-* flags unavailable)")
