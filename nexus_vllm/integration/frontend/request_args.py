"""Per-request eviction fields: ``vllm_xargs`` checked against the server's config, and
the ``EvictionConfig`` each request runs with.

The API server checks a request's fields before it reaches the engine
(:func:`validate_request_args`, called by ``patches/openai_serving`` and
``patches/input_processor``; a bad field is an HTTP 400 naming ``vllm_xargs.<key>``); the
scheduler builds the request's config from the same fields (:func:`request_config`). The
server's own config comes from :mod:`.server_config`.

This module imports no vLLM code: it is unit-testable on its own.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from nexus_vllm.argtypes import describe_value
from nexus_vllm.integration.config import CONFIG_FIELD_OF, REQUEST_FIELDS, request_config
from nexus_vllm.integration.frontend.server_config import METHODS, SERVER_FLAGS

__all__ = [
    "RequestArgError",
    "validate_request_args",
]

_REQUEST_FIELD_OF = {field: key for key, field in CONFIG_FIELD_OF.items()}
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
            key, f"must be a positive integer number of tokens; got {describe_value(value)}")
    return int(value)


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """A per-request value that must be one of ``choices`` (a close match is suggested)."""
    if not isinstance(value, str) or value not in choices:
        match = difflib.get_close_matches(str(value).strip().lower(), choices, n=1)
        hint = f" (did you mean {match[0]!r}?)" if match else ""
        raise RequestArgError(
            key, f"must be one of {', '.join(choices)}; got {describe_value(value)}{hint}")
    return value


def _needs_eviction(key: str, server_cfg: Any | None, opt_out: bool, what: str = "needs",
                    allowed: str = "") -> None:
    """Refuse ``key`` on a server started without eviction (unless the request opts out
    with ``kv_eviction: none``, which makes the other fields moot)."""
    if server_cfg is None and not opt_out:
        raise RequestArgError(key, f"{what} a server started with eviction on; this server "
                                   f"was started with --kv-eviction none{allowed}")


def _check_method(extra_args: dict[str, Any], server_cfg: Any | None, opt_out: bool) -> None:
    method = _choice("kv_eviction", extra_args["kv_eviction"], METHODS)
    _needs_eviction("kv_eviction", server_cfg, opt_out, f"{method!r} needs",
                    " (only 'none' is allowed)")


def _check_budget(extra_args: dict[str, Any], server_cfg: Any | None, opt_out: bool,
                  max_model_len: int | None) -> None:
    budget = _tokens("kv_budget", extra_args["kv_budget"])
    _needs_eviction("kv_budget", server_cfg, opt_out, "per-request budgets need")
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
            "kv_budget", f"{describe_value(extra_args['kv_budget'])} is above this server's "
            f"max model length ({max_model_len} tokens): no request holds more, so "
            f"nothing would ever be evicted; allowed: {span}, or send "
            "\"kv_eviction\": \"none\" to serve this request without eviction")


def _check_prompt_mode(extra_args: dict[str, Any], server_cfg: Any | None,
                       opt_out: bool) -> None:
    from nexus_vllm.core.config import PROMPT_MODES

    _choice("kv_prompt_mode", extra_args["kv_prompt_mode"], PROMPT_MODES)
    _needs_eviction("kv_prompt_mode", server_cfg, opt_out)


def _check_prefill_budget(extra_args: dict[str, Any], server_cfg: Any | None,
                          opt_out: bool) -> None:
    """``kv_prefill_budget``: ``end`` mode only, at least the request's budget. One above
    the max model length is allowed: it never binds (the whole prompt is kept until its
    end, as without one)."""
    value = _tokens("kv_prefill_budget", extra_args["kv_prefill_budget"])
    _needs_eviction("kv_prefill_budget", server_cfg, opt_out)
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
