"""Server-side configuration: CLI flags, config files, ``--additional-config`` and
per-request ``vllm_xargs``, all parsed into :class:`nexus_vllm.core.EvictionConfig`.

Layering (later wins): ``EvictionConfig`` defaults < ``--kv-eviction-config FILE|NAME`` <
``--additional-config '{"nexus": {...}}'`` < the ``--kv-*`` flags. The resolved config is
stored back into ``additional_config["nexus"]`` as a plain dict so every vLLM process
(API server, engine core, workers) rebuilds the same frozen object from the VllmConfig.

This module imports no vLLM code: it is unit-testable on its own.
"""

from __future__ import annotations

import difflib
import json
import math
import pathlib
from typing import Any

from nexus_vllm.core.policies import POLICIES

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "CLI_FLAGS",
    "METHODS",
    "REQUEST_FIELDS",
    "RequestArgError",
    "check_max_model_len",
    "config_from_additional",
    "load_config_file",
    "request_config",
    "resolve_config",
    "validate_request_args",
]

ADDITIONAL_CONFIG_KEY = "nexus"
# Methods a server can be started with: the policies whose evidence the plugin gathers.
METHODS = ("none", *(name for name, cls in POLICIES.items() if cls.servable))
# CLI flag -> EvictionConfig field.
CLI_FLAGS = {
    "--kv-eviction": "method",
    "--kv-budget": "max_tokens",
    "--kv-keep-ratio": "keep_ratio",
    "--kv-eviction-seed": "seed",
    "--kv-chunk-size": "chunk_size",
    "--kv-prompt-mode": "prompt_mode",
    "--kv-prefill-budget": "prefill_budget",
}
SERVER_FLAGS = (*CLI_FLAGS, "--kv-eviction-config")
# Flags whose values reach EvictionConfig: ours, and vLLM's --block-size (it sets the
# block size, hence the budget floor).
FLAG_FIELDS = {**CLI_FLAGS, "--block-size": "block_size"}
# The per-request fields of ``vllm_xargs`` (-> EvictionConfig field).
REQUEST_FIELDS = ("kv_budget", "kv_eviction", "kv_prompt_mode", "kv_prefill_budget")
_REQUEST_FIELD_OF = {"max_tokens": "kv_budget", "method": "kv_eviction",
                     "prompt_mode": "kv_prompt_mode", "prefill_budget": "kv_prefill_budget"}
# ``vllm_xargs`` keys that start with these (after lower-casing, ``-`` -> ``_``) are ours:
# one that is not a field is a typo and is refused; every other key passes untouched.
RESERVED_PREFIXES = ("kv_", "nexus")
# Keys vLLM itself adds to ``SamplingParams.extra_args`` (seen by the engine-side check).
FOREIGN_XARGS = frozenset({"kv_transfer_params"})


class RequestArgError(ValueError):
    """A bad per-request field; ``field`` is ``"vllm_xargs.<key>"`` (the HTTP 400's
    ``param``) and the message starts with it."""

    def __init__(self, key: str, message: str) -> None:
        self.field = f"vllm_xargs.{key}"
        super().__init__(f"{self.field}: {message}")


def _flag_for(field: str) -> str:
    for flag, name in CLI_FLAGS.items():
        if name == field:
            return flag
    return f"--additional-config nexus.{field}"


def load_config_file(path: str | pathlib.Path) -> dict[str, Any]:
    """Read a YAML or JSON eviction preset: a file, or a shipped preset by name.

    The file holds either the knobs at top level or under a ``nexus:`` key. An existing
    file wins; else a bare name (``nexus-fast`` or ``nexus-fast.yaml``) is looked up among
    the shipped presets (``nexus_vllm.presets``, ``nexus-vllm presets``).

    Raises
    ------
    ValueError
        Naming ``--kv-eviction-config`` when the file is missing (listing the presets when
        a name was given), unparsable or not a mapping.
    """
    from nexus_vllm import presets

    p = pathlib.Path(path)
    source: Any = p
    if not p.is_file():
        source = presets.find(str(path))
        if source is None:
            if presets.is_name(str(path)):
                raise ValueError(presets.unknown_message(str(path)))
            raise ValueError(f"--kv-eviction-config: no such file {str(p)!r}")
    text = source.read_text()
    try:
        if source.name.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # yaml and json raise different types
        raise ValueError(f"--kv-eviction-config: cannot parse {str(source)!r}: {exc}") from exc
    if data is None:
        data = {}
    if isinstance(data, dict) and ADDITIONAL_CONFIG_KEY in data:
        data = data[ADDITIONAL_CONFIG_KEY]
    if not isinstance(data, dict):
        raise ValueError(f"--kv-eviction-config: {str(source)!r} must hold a mapping of knobs")
    return dict(data)


def _build(knobs: dict[str, Any], source: str, given: Any = ()) -> Any:
    from nexus_vllm.core import EvictionConfig

    try:
        return EvictionConfig.from_dict(knobs)
    except (TypeError, ValueError) as exc:
        # Name the flag the user typed when the bad key maps to one: the key the error
        # is about first, else any given flag's key the message names.
        msg = str(exc)
        bad = getattr(exc, "field", None)
        for flag, field in FLAG_FIELDS.items():
            if field == bad and field in given:
                raise ValueError(f"{flag}: {msg}") from exc
        for flag, field in FLAG_FIELDS.items():
            if field in msg and field in given:
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
        ``--kv-eviction-config`` path, or a shipped preset's name.
    additional : dict, optional
        ``additional_config["nexus"]``.
    flags : dict, optional
        ``EvictionConfig`` field -> value from the ``--kv-*`` flags and vLLM's
        ``--block-size`` (None = not given).

    Raises
    ------
    ValueError
        Naming the flag or source that holds the bad value.
    """
    knobs: dict[str, Any] = {}
    if file:
        knobs.update(load_config_file(file))
        _build(knobs, "--kv-eviction-config")
    if additional is not None:
        if not isinstance(additional, dict):
            raise ValueError("--additional-config: 'nexus' must be a JSON object of "
                             f"eviction knobs; got {additional!r}")
        knobs.update(additional)
        _build(knobs, "--additional-config nexus")
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    # A budget flag replaces the other budget form coming from a file/additional config.
    if "max_tokens" in given:
        knobs.pop("keep_ratio", None)
    if "keep_ratio" in given:
        knobs.pop("max_tokens", None)
    knobs.update(given)
    cfg = _build(knobs, "flags", given)
    if cfg.method not in METHODS:
        where = "--kv-eviction" if "method" in given else "nexus.method"
        raise ValueError(
            f"{where}: {cfg.method!r} is not served; choose from {', '.join(METHODS)}"
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
    if knobs is None or knobs == {}:
        return None
    if not isinstance(knobs, dict):
        # A falsy non-mapping (0, "", []) must not turn eviction off silently.
        raise ValueError(f"'nexus' must be a mapping of eviction knobs; got {knobs!r}")
    from nexus_vllm.core import EvictionConfig

    cfg = EvictionConfig.from_dict(dict(knobs))
    return None if cfg.method == "none" else cfg


def check_max_model_len(cfg: Any, max_model_len: int, num_layers: int | None = None) -> None:
    """Refuse a server config that cannot work within the model's ``--max-model-len``.

    Raises
    ------
    ValueError
        Naming the flag (or ``nexus.<key>`` for config-file keys), the allowed range and
        the value given.
    """
    forced = cfg.num_forced * cfg.block_size
    if forced > max_model_len:
        raise ValueError(
            f"the always-kept blocks (nexus.sink_blocks + nexus.recent_blocks + 1 = "
            f"{cfg.num_forced} blocks of nexus.block_size {cfg.block_size} tokens = {forced} "
            f"tokens) exceed --max-model-len {max_model_len}, so nothing could ever be "
            "evicted; lower them")
    if cfg.max_tokens is not None and cfg.max_tokens > max_model_len:
        raise ValueError(
            f"--kv-budget {_given(cfg.max_tokens)} is above --max-model-len "
            f"{max_model_len}: no request can hold more tokens, so nothing would ever be "
            f"evicted; allowed: {forced}..{max_model_len} tokens (or --kv-eviction none to "
            "serve without eviction)")
    if cfg.chunk_size > max_model_len:
        raise ValueError(
            f"--kv-chunk-size {_given(cfg.chunk_size)} is above --max-model-len "
            f"{max_model_len}; allowed: 1..{max_model_len} tokens")
    for key, meaning in (("window", "decode queries scored"),
                         ("prefill_window", "prefill queries scored"),
                         ("interval", "decode tokens between events")):
        value = getattr(cfg, key)
        if value > max_model_len:
            raise ValueError(
                f"nexus.{key} {value} ({meaning}) is above --max-model-len "
                f"{max_model_len}; allowed: 1..{max_model_len}")
    if num_layers is not None and cfg.skip_layers >= num_layers:
        raise ValueError(
            f"nexus.skip_layers {cfg.skip_layers} leaves no layer to score: the model has "
            f"{num_layers} layers; allowed: 0..{num_layers - 1}")


def _given(value: Any) -> str:
    """``value`` as the client sent it, with its JSON type when that is the problem."""
    text = repr(value)
    if len(text) > 40:  # a huge number or string: enough to recognise it
        text = f"{text[:30]}... ({len(text)} characters)"
    kind = {bool: "a boolean", str: "a string", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value))
    return f"{text} ({kind})" if kind else text


def _check_unknown_keys(extra_args: dict[str, Any]) -> None:
    for key in extra_args:
        if not isinstance(key, str) or key in REQUEST_FIELDS or key in FOREIGN_XARGS:
            continue
        norm = key.strip().lower().replace("-", "_")
        if not norm.startswith(RESERVED_PREFIXES):
            continue  # another plugin's or logits processor's key
        flag = "--" + norm.replace("_", "-")
        match = difflib.get_close_matches(norm, REQUEST_FIELDS, n=1, cutoff=0.6)
        if flag in SERVER_FLAGS and norm not in REQUEST_FIELDS:
            hint = f": {norm} is set per server with {flag}, not per request"
        else:
            hint = f" (did you mean {match[0]!r}?)" if match else ""
        raise RequestArgError(
            key, f"unknown per-request field{hint}; per-request fields: "
            f"{', '.join(REQUEST_FIELDS)} (keys starting with kv_ or nexus are reserved "
            "for nexus-vllm)")


def _tokens(key: str, value: Any) -> int:
    """A per-request token count: a positive integer (an integral float passes)."""
    ok = not isinstance(value, bool) and (
        isinstance(value, int)
        or (isinstance(value, float) and math.isfinite(value) and value.is_integer()))
    if not ok or value <= 0:
        raise RequestArgError(
            key, f"must be a positive integer number of tokens; got {_given(value)}")
    return int(value)


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """A per-request value that must be one of ``choices`` (a close match is suggested)."""
    if not isinstance(value, str) or value not in choices:
        match = difflib.get_close_matches(str(value).strip().lower(), choices, n=1)
        hint = f" (did you mean {match[0]!r}?)" if match else ""
        raise RequestArgError(
            key, f"must be one of {', '.join(choices)}; got {_given(value)}{hint}")
    return value


def _check_method(extra_args: dict[str, Any], server_cfg: Any | None, opt_out: bool) -> None:
    method = _choice("kv_eviction", extra_args["kv_eviction"], METHODS)
    if server_cfg is None and not opt_out:
        raise RequestArgError(
            "kv_eviction", f"{method!r} needs a server started with eviction on; this "
            "server was started with --kv-eviction none (only 'none' is allowed)")


def _check_budget(extra_args: dict[str, Any], server_cfg: Any | None, opt_out: bool,
                  max_model_len: int | None) -> None:
    budget = _tokens("kv_budget", extra_args["kv_budget"])
    if server_cfg is None and not opt_out:
        raise RequestArgError(
            "kv_budget", "per-request budgets need a server started with eviction on; "
            "this server was started with --kv-eviction none")
    if server_cfg is None or opt_out:
        return
    floor = server_cfg.num_forced * server_cfg.block_size
    span = f"{floor}..{max_model_len}" if max_model_len else f">= {floor}"
    if budget < floor:
        raise RequestArgError(
            "kv_budget", f"must be at least {floor} tokens on this server (the "
            f"always-kept sink, recent and current blocks: {server_cfg.num_forced} "
            f"blocks of {server_cfg.block_size} tokens); allowed: {span}; got "
            f"{budget}")
    if max_model_len is not None and budget > max_model_len:
        raise RequestArgError(
            "kv_budget", f"{_given(extra_args['kv_budget'])} is above this server's "
            f"max model length ({max_model_len} tokens): no request holds more, so "
            f"nothing would ever be evicted; allowed: {span}, or send "
            "\"kv_eviction\": \"none\" to serve this request without eviction")


def _check_prompt_mode(extra_args: dict[str, Any], server_cfg: Any | None,
                       opt_out: bool) -> None:
    from nexus_vllm.core.config import PROMPT_MODES

    _choice("kv_prompt_mode", extra_args["kv_prompt_mode"], PROMPT_MODES)
    if server_cfg is None and not opt_out:
        raise RequestArgError(
            "kv_prompt_mode", "needs a server started with eviction on; this server was "
            "started with --kv-eviction none")


def _check_prefill_budget(extra_args: dict[str, Any], server_cfg: Any | None,
                          opt_out: bool) -> None:
    """``kv_prefill_budget``: ``end`` mode only, at least the request's budget. One above
    the max model length is allowed: it never binds (the whole prompt is kept until its
    end, as without one)."""
    value = _tokens("kv_prefill_budget", extra_args["kv_prefill_budget"])
    if server_cfg is None and not opt_out:
        raise RequestArgError(
            "kv_prefill_budget", "needs a server started with eviction on; this server "
            "was started with --kv-eviction none")
    if server_cfg is None or opt_out:
        return
    mode = extra_args.get("kv_prompt_mode", server_cfg.prompt_mode)
    if mode != "end":
        whose = ("this request's kv_prompt_mode" if "kv_prompt_mode" in extra_args
                 else "this server's prompt mode (--kv-prompt-mode)")
        raise RequestArgError(
            "kv_prefill_budget", f"applies to kv_prompt_mode 'end' only; {whose} is "
            f"{mode!r}: send \"kv_prompt_mode\": \"end\" with it")
    floor, what = _budget_floor(extra_args, server_cfg)
    if value < floor:
        raise RequestArgError(
            "kv_prefill_budget", f"must be at least the budget ({floor} tokens, {what}); "
            f"got {value}")


def _budget_floor(extra_args: dict[str, Any], server_cfg: Any) -> tuple[int, str]:
    """The least prefill budget for this request, and where it comes from."""
    forced = server_cfg.num_forced * server_cfg.block_size
    if "kv_budget" in extra_args:
        return max(int(extra_args["kv_budget"]), forced), "this request's kv_budget"
    if server_cfg.max_tokens is not None:
        return max(int(server_cfg.max_tokens), forced), "this server's --kv-budget"
    return forced, "the always-kept blocks"


def validate_request_args(extra_args: dict[str, Any] | None, server_cfg: Any | None,
                          *, max_model_len: int | None = None) -> None:
    """Check the ``vllm_xargs`` eviction fields of one request.

    Parameters
    ----------
    extra_args : dict, optional
        The request's ``vllm_xargs`` (``SamplingParams.extra_args``).
    server_cfg : EvictionConfig, optional
        The server's config (None = started with ``--kv-eviction none``).
    max_model_len : int, optional
        The server's ``--max-model-len``: a budget above it could never evict (a
        prefill budget above it is allowed: it never binds).

    Raises
    ------
    RequestArgError
        A ``ValueError`` naming ``vllm_xargs.<field>``, what is allowed and what was
        given. Keys starting with ``kv_`` or ``nexus`` that are not fields are refused
        (a typo must not silently serve without the intended budget); other keys pass.
    """
    if not extra_args:
        return
    _check_unknown_keys(extra_args)
    # An explicit per-request opt-out makes the other fields meaningless: only their
    # types count.
    opt_out = extra_args.get("kv_eviction") == "none"
    if "kv_eviction" in extra_args:
        _check_method(extra_args, server_cfg, opt_out)
    if "kv_budget" in extra_args:
        _check_budget(extra_args, server_cfg, opt_out, max_model_len)
    if "kv_prompt_mode" in extra_args:
        _check_prompt_mode(extra_args, server_cfg, opt_out)
    if "kv_prefill_budget" in extra_args:
        _check_prefill_budget(extra_args, server_cfg, opt_out)
    if server_cfg is None or opt_out:
        return
    if ("kv_budget" in extra_args and "kv_prefill_budget" not in extra_args
            and server_cfg.prefill_budget is not None
            and extra_args.get("kv_prompt_mode", "end") == "end"):
        floor, _ = _budget_floor(extra_args, server_cfg)
        if floor > server_cfg.prefill_budget:
            raise RequestArgError(
                "kv_budget", f"{floor} tokens is above this server's prefill budget "
                f"({server_cfg.prefill_budget} tokens, --kv-prefill-budget); send a "
                "kv_prefill_budget of at least the budget with it")
    # Backstop: the per-request config must build (cross-field rules of EvictionConfig).
    try:
        request_config(server_cfg, extra_args)
    except ValueError as exc:
        key = _REQUEST_FIELD_OF.get(str(getattr(exc, "field", "")))
        if key not in extra_args:
            key = next((k for k in REQUEST_FIELDS if k in extra_args), "kv_eviction")
        raise RequestArgError(str(key), str(exc)) from None


def request_config(server_cfg: Any, extra_args: dict[str, Any] | None) -> Any | None:
    """The ``EvictionConfig`` one request runs with (None = no eviction for it).

    ``extra_args`` was validated by :func:`validate_request_args` in the API server. A
    ``kv_prompt_mode`` other than ``end`` drops the server's ``prefill_budget`` (it
    applies to ``end`` only).
    """
    if server_cfg is None:
        return None
    cfg = server_cfg
    if extra_args:
        if extra_args.get("kv_eviction") == "none":
            return None
        changes: dict[str, Any] = {}
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
        if changes:
            cfg = cfg.replace(**changes)
    return None if cfg.method == "none" else cfg
