"""The eviction config as every vLLM process reads it: the server's, and each request's.

The API server resolves the ``--kv-*`` flags, files and ``--additional-config`` into one
:class:`~nexus_vllm.core.EvictionConfig` (``frontend/server_config.py``) and stores it in
``VllmConfig.additional_config["nexus"]`` as a plain dict; the engine core's scheduler
and every worker rebuild the same frozen object from there (:func:`config_from_additional`).
A request's ``vllm_xargs`` override a few fields (:data:`REQUEST_FIELDS`); the scheduler
builds the config each request runs with from them (:func:`request_config`), after the API
server has refused bad ones (``frontend/request_args.py``).

Decoding only, no policy: this module sits below the three processes' folders so that the
scheduler and the worker never import the API server's modules. It imports no vLLM code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from nexus_vllm.core import EvictionConfig

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "SELF_CHECK_ENV",
    "CONFIG_FIELD_OF",
    "REQUEST_FIELDS",
    "config_from_additional",
    "request_config",
    "self_check_enabled",
]

# Extra checks on a live server, in the scheduler and in every worker (each a host read):
# debug only. Read in each process from the environment, which vLLM's workers inherit.
SELF_CHECK_ENV = "NEXUS_VLLM_SELF_CHECK"


def self_check_enabled() -> bool:
    """Whether ``NEXUS_VLLM_SELF_CHECK=1`` is set in this process."""
    return os.environ.get(SELF_CHECK_ENV, "0") == "1"

ADDITIONAL_CONFIG_KEY = "nexus"
# The per-request fields of ``vllm_xargs`` -> the EvictionConfig field each sets.
CONFIG_FIELD_OF = {"kv_budget": "max_tokens", "kv_eviction": "method",
                   "kv_prompt_mode": "prompt_mode", "kv_prefill_budget": "prefill_budget",
                   "kv_question_tokens": "prompt_window"}
REQUEST_FIELDS = tuple(CONFIG_FIELD_OF)


def config_from_additional(additional_config: object) -> EvictionConfig | None:
    """The server's ``EvictionConfig`` from ``VllmConfig.additional_config``.

    Returns None when the plugin is off (no ``nexus`` entry, or method ``none``).

    Raises
    ------
    ValueError
        When the ``nexus`` entry is not a mapping of valid eviction knobs.
    """
    if not isinstance(additional_config, dict):
        return None
    knobs = additional_config.get(ADDITIONAL_CONFIG_KEY)
    if knobs is None or knobs == {}:
        return None
    if not isinstance(knobs, dict):
        # A falsy non-mapping (0, "", []) must not turn eviction off silently.
        raise ValueError(f"'nexus' must be a mapping of eviction knobs; got {knobs!r}")
    cfg = EvictionConfig.from_dict(dict(knobs))
    return None if cfg.method == "none" else cfg


def request_config(server_cfg: EvictionConfig | None,
                   extra_args: Mapping[str, Any] | None) -> EvictionConfig | None:
    """The ``EvictionConfig`` one request runs with (None = no eviction for it).

    ``extra_args`` are the request's ``vllm_xargs``; a token count may be an integral
    float. A ``kv_prompt_mode`` other than ``end`` drops the server's ``prefill_budget``
    (it applies to ``end`` only). ``kv_question_tokens`` (the question's length) sets the
    query rows that score the request's prompt events (``prompt_window``).

    Raises
    ------
    ValueError
        A :class:`~nexus_vllm.core.ConfigError` naming the ``EvictionConfig`` field when
        the fields make no valid config (or a ``TypeError``/``ValueError`` for a value
        that is not a number), for the caller to blame on a request field.
    """
    if server_cfg is None:
        return None
    cfg = server_cfg
    if extra_args:
        if extra_args.get("kv_eviction") == "none":
            return None
        changes: dict[str, object] = {}
        if "kv_eviction" in extra_args:
            changes["method"] = extra_args["kv_eviction"]
        if "kv_budget" in extra_args:
            changes["max_tokens"] = int(extra_args["kv_budget"])
            changes["keep_ratio"] = None
        if "kv_prompt_mode" in extra_args:
            changes["prompt_mode"] = extra_args["kv_prompt_mode"]
            if changes["prompt_mode"] != "end":
                changes["prefill_budget"] = None
        if "kv_prefill_budget" in extra_args:
            changes["prefill_budget"] = int(extra_args["kv_prefill_budget"])
        if "kv_question_tokens" in extra_args:
            # The question's length: the prompt's newest rows that score its events.
            changes["prompt_window"] = int(extra_args["kv_question_tokens"])
        if changes:
            cfg = cfg.replace(**changes)
    return None if cfg.method == "none" else cfg
