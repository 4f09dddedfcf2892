"""Per-request eviction fields: a request's ``vllm_xargs`` checked against the server's
config in the API server, before the request reaches the engine.

:func:`validate_request_args` is called by ``patches/openai_serving`` and
``patches/input_processor``; a bad field is an HTTP 400 naming ``vllm_xargs.<key>``. It
builds the request's ``EvictionConfig`` with the scheduler's own decoding
(``integration/config.py``: :func:`~nexus_vllm.integration.config.request_config`), so
``EvictionConfig`` is the one validator of the rules between fields; this module adds
what only a request has (unknown keys, the JSON types, a server without eviction, the
model's length) and says which field to fix. The server's own config comes from
:mod:`.server_config`.

This module imports no vLLM code: it is unit-testable on its own.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence

from nexus_vllm.argtypes import describe_value
from nexus_vllm.core import EvictionConfig
from nexus_vllm.core.config import PROMPT_MODES
from nexus_vllm.integration.config import CONFIG_FIELD_OF, REQUEST_FIELDS, request_config
from nexus_vllm.integration.frontend.engine_policy import LatentAttention
from nexus_vllm.integration.frontend.server_config import METHODS, SERVER_FLAGS

__all__ = ["REQUEST_FIELD_OF", "RequestArgError", "validate_request_args"]

# EvictionConfig field -> the request field that sets it.
REQUEST_FIELD_OF = {field: key for key, field in CONFIG_FIELD_OF.items()}
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


def _check_unknown_keys(extra_args: Mapping[str, object]) -> None:
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


def _tokens(key: str, value: object) -> int:
    """A per-request token count: a positive integer (an integral float passes)."""
    if isinstance(value, bool) or not (
            isinstance(value, int)
            or (isinstance(value, float) and math.isfinite(value) and value.is_integer())) \
            or value <= 0:
        raise RequestArgError(
            key, f"must be a positive integer number of tokens; got {describe_value(value)}")
    return int(value)


def _choice(key: str, value: object, choices: Sequence[str]) -> str:
    """A per-request value that must be one of ``choices`` (a close match is suggested)."""
    if not isinstance(value, str) or value not in choices:
        match = difflib.get_close_matches(str(value).strip().lower(), choices, n=1)
        hint = f" (did you mean {match[0]!r}?)" if match else ""
        raise RequestArgError(
            key, f"must be one of {', '.join(choices)}; got {describe_value(value)}{hint}")
    return value


def _needs_eviction(key: str, server_cfg: EvictionConfig | None, opt_out: bool,
                    what: str = "needs", allowed: str = "") -> None:
    """Refuse ``key`` on a server started without eviction (unless the request opts out
    with ``kv_eviction: none``, which makes the other fields moot)."""
    if server_cfg is None and not opt_out:
        raise RequestArgError(key, f"{what} a server started with eviction on; this server "
                                   f"was started with --kv-eviction none{allowed}")


def _check_budget_fits(extra_args: Mapping[str, object], server_cfg: EvictionConfig,
                       max_model_len: int | None) -> None:
    """A budget above the server's ``max_model_len`` could never evict (a limit of the
    server's model, which ``EvictionConfig`` does not know)."""
    if max_model_len is not None and _tokens("kv_budget", extra_args["kv_budget"]) > max_model_len:
        raise RequestArgError(
            "kv_budget", f"{describe_value(extra_args['kv_budget'])} is above this server's "
            f"max model length ({max_model_len} tokens): no request holds more, so "
            f"nothing would ever be evicted; allowed: {_budget_span(server_cfg, max_model_len)}"
            ", or send \"kv_eviction\": \"none\" to serve this request without eviction")


def _check_question_fits(rows: int, server_cfg: EvictionConfig) -> None:
    """The workers keep the newest ``max(window, prompt_window)`` queries of each request
    (the server's, fixed at start-up): a question longer than that cannot be scored."""
    most = max(server_cfg.window, server_cfg.prompt_window)
    if rows > most:
        raise RequestArgError(
            "kv_question_tokens", f"{rows} is above the {most} query rows this server keeps "
            f"per request (its prompt_window; start it with a larger one in "
            f"--kv-eviction-config to score longer questions); allowed: 1..{most}")


def _budget_span(server_cfg: EvictionConfig, max_model_len: int | None) -> str:
    floor = server_cfg.forced_tokens
    return f"{floor}..{max_model_len}" if max_model_len else f">= {floor}"


def _budget(extra_args: Mapping[str, object], server_cfg: EvictionConfig) -> tuple[int, str]:
    """The request's budget in tokens, and where it comes from (the always-kept blocks
    when neither the request nor the server gives one: a keep-ratio server)."""
    if "kv_budget" in extra_args:
        return _tokens("kv_budget", extra_args["kv_budget"]), "this request's kv_budget"
    if server_cfg.max_tokens is not None:
        return int(server_cfg.max_tokens), "this server's --kv-budget"
    return server_cfg.forced_tokens, "the always-kept blocks"


def _blamed_key(field: str, reads: tuple[str, ...], extra_args: Mapping[str, object]) -> str:
    """The request field to blame for a bad config ``field`` whose rule read ``reads``
    (``ConfigError.field`` and ``.reads``): the first of them the request set
    (:data:`REQUEST_FIELD_OF`), else the first request field it set."""
    for name in (field, *reads):
        key = REQUEST_FIELD_OF.get(name)
        if key is not None and key in extra_args:
            return key
    return next((k for k in REQUEST_FIELDS if k in extra_args), "kv_eviction")


def _blame(error: ValueError, extra_args: Mapping[str, object], server_cfg: EvictionConfig,
           max_model_len: int | None) -> RequestArgError:
    """The request field to blame for the ``EvictionConfig`` the request's fields could
    not make (:func:`_blamed_key`), the budget rules explained in the request's terms:
    which value came from the request and which from the server."""
    field = str(getattr(error, "field", ""))
    reads = tuple(getattr(error, "reads", ()))
    key = _blamed_key(field, reads, extra_args)
    if field == "max_tokens" and key == "kv_budget":  # under the forced set
        return RequestArgError(
            "kv_budget", f"must be at least {server_cfg.forced_tokens} tokens on this "
            f"server (the always-kept sink, recent and current blocks: "
            f"{server_cfg.num_forced} blocks of {server_cfg.block_size} tokens); allowed: "
            f"{_budget_span(server_cfg, max_model_len)}; got "
            f"{_tokens('kv_budget', extra_args['kv_budget'])}")
    if field != "prefill_budget":
        return RequestArgError(key, str(error))
    if "prompt_mode" in reads:  # a prefill budget outside prompt mode end
        whose = ("this request's kv_prompt_mode" if "kv_prompt_mode" in extra_args
                 else "this server's prompt mode (--kv-prompt-mode)")
        return RequestArgError(
            "kv_prefill_budget", f"applies to kv_prompt_mode 'end' only; {whose} is "
            f"{extra_args.get('kv_prompt_mode', server_cfg.prompt_mode)!r}: send "
            "\"kv_prompt_mode\": \"end\" with it")
    budget, whose_budget = _budget(extra_args, server_cfg)
    if "kv_prefill_budget" not in extra_args:  # the server's, under this budget
        return RequestArgError(
            "kv_budget", f"{budget} tokens is above this server's prefill budget "
            f"({server_cfg.prefill_budget} tokens, --kv-prefill-budget); send a "
            "kv_prefill_budget of at least the budget with it")
    return RequestArgError(
        "kv_prefill_budget", f"must be at least the budget ({budget} tokens, "
        f"{whose_budget}); got {_tokens('kv_prefill_budget', extra_args['kv_prefill_budget'])}")


def validate_request_args(extra_args: Mapping[str, object] | None,
                          server_cfg: EvictionConfig | None,
                          *, max_model_len: int | None = None,
                          latent: LatentAttention | None = None) -> None:
    """Check the ``vllm_xargs`` eviction fields of one request.

    Each field is checked on its own first (its type and values, and that the server
    evicts at all); then the request's ``EvictionConfig`` is built from them
    (:func:`~nexus_vllm.integration.config.request_config`, what the scheduler runs), so
    the rules between fields (the budget floor, ``kv_prefill_budget`` in ``end`` mode and
    at least the budget) are ``EvictionConfig``'s own, and its error is blamed on the
    request field it is about.

    Parameters
    ----------
    extra_args : dict, optional
        The request's ``vllm_xargs`` (``SamplingParams.extra_args``).
    server_cfg : EvictionConfig, optional
        The server's config (None = started with ``--kv-eviction none``).
    max_model_len : int, optional
        The server's ``--max-model-len``: a budget above it could never evict (a
        prefill budget above it is allowed: it never binds).
    latent : LatentAttention, optional
        The served model uses multi-head latent attention (MLA): the request's config
        must be one it can run (``LatentAttention.refusal``).

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
    evicts = server_cfg is not None and not opt_out
    if "kv_eviction" in extra_args:
        method = _choice("kv_eviction", extra_args["kv_eviction"], METHODS)
        _needs_eviction("kv_eviction", server_cfg, opt_out, f"{method!r} needs",
                        " (only 'none' is allowed)")
    if "kv_budget" in extra_args:
        _tokens("kv_budget", extra_args["kv_budget"])
        _needs_eviction("kv_budget", server_cfg, opt_out, "per-request budgets need")
        if evicts:
            assert server_cfg is not None
            _check_budget_fits(extra_args, server_cfg, max_model_len)
    if "kv_prompt_mode" in extra_args:
        _choice("kv_prompt_mode", extra_args["kv_prompt_mode"], PROMPT_MODES)
        _needs_eviction("kv_prompt_mode", server_cfg, opt_out)
    if "kv_prefill_budget" in extra_args:
        _tokens("kv_prefill_budget", extra_args["kv_prefill_budget"])
        _needs_eviction("kv_prefill_budget", server_cfg, opt_out)
    if "kv_question_tokens" in extra_args:
        rows = _tokens("kv_question_tokens", extra_args["kv_question_tokens"])
        _needs_eviction("kv_question_tokens", server_cfg, opt_out)
        if evicts:
            assert server_cfg is not None
            _check_question_fits(rows, server_cfg)
    if not evicts:
        return
    assert server_cfg is not None
    try:
        req_cfg = request_config(server_cfg, extra_args)
    except ValueError as exc:
        raise _blame(exc, extra_args, server_cfg, max_model_len) from None
    refusal = None if latent is None or req_cfg is None else latent.refusal(req_cfg)
    if refusal is not None:
        what, why = refusal
        key = REQUEST_FIELD_OF.get(what, "kv_eviction")
        if key not in extra_args:  # the server's value: blame the field the request set
            key = next((k for k in REQUEST_FIELDS if k in extra_args), "kv_eviction")
        assert req_cfg is not None
        raise RequestArgError(str(key), f"{why} (request config: method "
                              f"{req_cfg.method!r}, prompt mode {req_cfg.prompt_mode!r})")
