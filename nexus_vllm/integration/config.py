"""Server-side configuration: CLI flags, config files, ``--additional-config`` and
per-request ``vllm_xargs``, all parsed into :class:`nexus_vllm.core.EvictionConfig`.

Layering (later wins): ``EvictionConfig`` defaults < ``--kv-eviction-config FILE`` <
``--additional-config '{"nexus": {...}}'`` < the ``--kv-*`` flags. The resolved config is
stored back into ``additional_config["nexus"]`` as a plain dict so every vLLM process
(API server, engine core, workers) rebuilds the same frozen object from the VllmConfig.

This module imports no vLLM code: it is unit-testable on its own.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "CLI_FLAGS",
    "METHODS",
    "config_from_additional",
    "load_config_file",
    "request_config",
    "resolve_config",
    "validate_request_args",
]

ADDITIONAL_CONFIG_KEY = "nexus"
# Methods a server can be started with (knorm needs per-token key norms that the plugin
# does not gather yet).
METHODS = ("none", "nexus", "h2o", "snapkv", "tova", "streaming", "random")
# CLI flag -> EvictionConfig field.
CLI_FLAGS = {
    "--kv-eviction": "method",
    "--kv-budget": "max_tokens",
    "--kv-keep-ratio": "keep_ratio",
    "--kv-eviction-seed": "seed",
    "--kv-chunk-size": "chunk_size",
}


def _flag_for(field: str) -> str:
    for flag, name in CLI_FLAGS.items():
        if name == field:
            return flag
    return f"--additional-config nexus.{field}"


def load_config_file(path: str | pathlib.Path) -> dict[str, Any]:
    """Read a YAML or JSON eviction preset.

    The file holds either the knobs at top level or under a ``nexus:`` key.

    Raises
    ------
    ValueError
        Naming ``--kv-eviction-config`` when the file is missing, unparsable or not a
        mapping.
    """
    p = pathlib.Path(path)
    if not p.is_file():
        raise ValueError(f"--kv-eviction-config: no such file {str(p)!r}")
    text = p.read_text()
    try:
        if p.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # yaml and json raise different types
        raise ValueError(f"--kv-eviction-config: cannot parse {str(p)!r}: {exc}") from exc
    if data is None:
        data = {}
    if isinstance(data, dict) and ADDITIONAL_CONFIG_KEY in data:
        data = data[ADDITIONAL_CONFIG_KEY]
    if not isinstance(data, dict):
        raise ValueError(f"--kv-eviction-config: {str(p)!r} must hold a mapping of knobs")
    return dict(data)


def _build(knobs: dict[str, Any], source: str) -> Any:
    from nexus_vllm.core import EvictionConfig

    try:
        return EvictionConfig.from_dict(knobs)
    except (TypeError, ValueError) as exc:
        # Name the flag the user typed when the bad key maps to one.
        msg = str(exc)
        for flag, field in CLI_FLAGS.items():
            if field in msg and field in knobs and source == "flags":
                raise ValueError(f"{flag}: {msg}") from exc
        raise ValueError(f"{source}: {msg}") from exc


def resolve_config(
    *,
    file: str | None = None,
    additional: dict[str, Any] | None = None,
    flags: dict[str, Any] | None = None,
) -> Any:
    """Merge the three sources into one validated ``EvictionConfig``.

    Parameters
    ----------
    file : str, optional
        ``--kv-eviction-config`` path.
    additional : dict, optional
        ``additional_config["nexus"]``.
    flags : dict, optional
        ``EvictionConfig`` field -> value from the ``--kv-*`` flags (None = not given).

    Raises
    ------
    ValueError
        Naming the flag or source that holds the bad value.
    """
    knobs: dict[str, Any] = {}
    if file:
        knobs.update(load_config_file(file))
        _build(knobs, "--kv-eviction-config")
    if additional:
        if not isinstance(additional, dict):
            raise ValueError("--additional-config: 'nexus' must be a JSON object")
        knobs.update(additional)
        _build(knobs, "--additional-config nexus")
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    # A budget flag replaces the other budget form coming from a file/additional config.
    if "max_tokens" in given:
        knobs.pop("keep_ratio", None)
    if "keep_ratio" in given:
        knobs.pop("max_tokens", None)
    knobs.update(given)
    cfg = _build(knobs, "flags")
    if cfg.method not in METHODS:
        raise ValueError(
            f"--kv-eviction: {cfg.method!r} is not served; choose from {', '.join(METHODS)}"
        )
    if cfg.method != "none" and cfg.max_tokens is None and cfg.keep_ratio is None:
        raise ValueError(
            f"--kv-eviction {cfg.method} needs a budget: pass --kv-budget TOKENS "
            "or --kv-keep-ratio R"
        )
    return cfg


def config_from_additional(additional_config: Any) -> Any | None:
    """The server's ``EvictionConfig`` from ``VllmConfig.additional_config``.

    Returns None when the plugin is off (no ``nexus`` entry, or method ``none``).
    """
    if not isinstance(additional_config, dict):
        return None
    knobs = additional_config.get(ADDITIONAL_CONFIG_KEY)
    if not knobs:
        return None
    from nexus_vllm.core import EvictionConfig

    cfg = EvictionConfig.from_dict(dict(knobs))
    return None if cfg.method == "none" else cfg


def validate_request_args(extra_args: dict[str, Any] | None, server_cfg: Any | None) -> None:
    """Check the ``vllm_xargs`` eviction fields of one request.

    Raises
    ------
    ValueError
        Naming ``vllm_xargs.<field>`` and what is allowed.
    """
    if not extra_args:
        return
    if "kv_eviction" in extra_args:
        method = extra_args["kv_eviction"]
        if not isinstance(method, str) or method not in METHODS:
            raise ValueError(
                f"vllm_xargs.kv_eviction: {method!r} is not a method; choose from "
                f"{', '.join(METHODS)}"
            )
        if server_cfg is None and method != "none":
            raise ValueError(
                "vllm_xargs.kv_eviction: this server was started with --kv-eviction none; "
                "per-request eviction needs a server started with eviction on"
            )
    if "kv_budget" in extra_args:
        budget = extra_args["kv_budget"]
        ok = (
            isinstance(budget, int) and not isinstance(budget, bool) and budget > 0
        ) or (isinstance(budget, float) and math.isfinite(budget) and budget.is_integer()
              and budget > 0)
        if not ok:
            raise ValueError(
                f"vllm_xargs.kv_budget: must be a positive integer number of tokens, "
                f"got {budget!r}"
            )
        if server_cfg is None:
            raise ValueError(
                "vllm_xargs.kv_budget: this server was started with --kv-eviction none; "
                "per-request budgets need a server started with eviction on"
            )
    if server_cfg is not None:
        try:
            request_config(server_cfg, extra_args)
        except ValueError as exc:
            name = "kv_budget" if "kv_budget" in extra_args else "kv_eviction"
            raise ValueError(f"vllm_xargs.{name}: {exc}") from None


def request_config(server_cfg: Any, extra_args: dict[str, Any] | None) -> Any | None:
    """The ``EvictionConfig`` one request runs with (None = no eviction for it).

    ``extra_args`` was validated by :func:`validate_request_args` in the API server.
    """
    if server_cfg is None:
        return None
    cfg = server_cfg
    if extra_args:
        changes: dict[str, Any] = {}
        if "kv_eviction" in extra_args:
            changes["method"] = extra_args["kv_eviction"]
        if "kv_budget" in extra_args:
            changes["max_tokens"] = int(extra_args["kv_budget"])
            changes["keep_ratio"] = None
        if changes:
            cfg = cfg.replace(**changes)
    return None if cfg.method == "none" else cfg
