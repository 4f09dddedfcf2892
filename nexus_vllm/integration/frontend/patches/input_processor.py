"""Patch: validate the per-request eviction fields of ``vllm_xargs`` in the API server.

Why
    ``vllm_xargs`` reaches ``SamplingParams.extra_args`` unchecked; a bad ``kv_budget``
    would only surface in the engine core, where an exception kills the engine. Requests
    must instead fail alone with HTTP 400 naming the field. OpenAI requests are checked
    earlier, before any stream starts (``openai_serving``); this is the backstop for every
    other way into the engine (``LLM``/``AsyncLLM`` in Python, batch and other endpoints).
How
    Wrap ``InputProcessor._validate_params`` (the API server's request validation, whose
    ``ValueError``/``VLLMValidationError`` become HTTP 400): after vLLM's own checks, run
    :func:`nexus_vllm.integration.frontend.request_args.validate_request_args` against the
    server's config and ``max_model_len``, read once from ``vllm_config``
    (:func:`server_limits`), and, for an MLA model, what it cannot run with
    (:func:`server_latent`).
vLLM version
    0.32 to 0.34 (``vllm/v1/engine/input_processor.py``).
Plan
    Move to a logits-processor ``validate_params`` hook if it becomes cheap to register
    one without adding a per-token processor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from nexus_vllm.integration.compat.catalogue import swap
from nexus_vllm.integration.config import config_from_additional
from nexus_vllm.integration.frontend.request_args import RequestArgError, validate_request_args

if TYPE_CHECKING:
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from nexus_vllm.core import EvictionConfig
    from nexus_vllm.integration.frontend.engine_policy import LatentAttention

__all__ = ["apply", "server_latent", "server_limits"]

# The server's eviction config (None: it does not evict) and its max model length.
Limits = tuple["EvictionConfig | None", "int | None"]


def server_limits(input_processor: InputProcessor) -> Limits:
    """(server ``EvictionConfig`` or None, ``max_model_len``) of the engine behind
    ``input_processor``; computed once and kept on it."""
    limits: Limits | None = getattr(input_processor, "_nexus_limits", None)
    if limits is None:
        vllm_config = input_processor.vllm_config
        max_len = getattr(vllm_config.model_config, "max_model_len", None)
        limits = (config_from_additional(vllm_config.additional_config),
                  int(max_len) if max_len else None)
        input_processor._nexus_limits = limits  # type: ignore[attr-defined]
    return limits


def server_latent(input_processor: InputProcessor) -> LatentAttention | None:
    """The served model's multi-head latent attention as eviction sees it (None: not
    MLA; ``engine_args.latent_attention``); computed once and kept on it."""
    cached: tuple[LatentAttention | None] | None = getattr(
        input_processor, "_nexus_latent", None)
    if cached is None:
        from nexus_vllm.integration.frontend.patches.engine_args import latent_attention

        cached = (latent_attention(input_processor.vllm_config),)
        input_processor._nexus_latent = cached  # type: ignore[attr-defined]
    return cached[0]


Validate = Callable[..., "bool | None"]


def _wrap(orig: Validate) -> Validate:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    @functools.wraps(orig)
    def _validate_params(self: InputProcessor, params: SamplingParams | PoolingParams,
                         *args: object, **kwargs: object) -> bool | None:
        result = orig(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams) and params.extra_args:
            server_cfg, max_len = server_limits(self)
            try:
                validate_request_args(params.extra_args, server_cfg, max_model_len=max_len,
                                      latent=server_latent(self))
            except RequestArgError as exc:
                raise VLLMValidationError(str(exc), parameter=exc.field) from None
        return result

    _validate_params._nexus_patched = True  # type: ignore[attr-defined]
    return _validate_params


def apply() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    orig = InputProcessor._validate_params
    if not getattr(orig, "_nexus_patched", False):
        swap(InputProcessor, "_validate_params", _wrap(orig))
