"""Patch: validate the per-request eviction fields of ``vllm_xargs`` in the API server.

Why
    ``vllm_xargs`` reaches ``SamplingParams.extra_args`` unchecked; a bad ``kv_budget``
    would only surface in the engine core, where an exception kills the engine. Requests
    must instead fail alone with HTTP 400 naming the field.
How
    Wrap ``InputProcessor._validate_params`` (the API server's request validation, whose
    ``ValueError``/``VLLMValidationError`` become HTTP 400): after vLLM's own checks, run
    :func:`nexus_vllm.integration.config.validate_request_args` against the server's config
    read from ``vllm_config.additional_config``.
vLLM version
    0.32.0 (``vllm/v1/engine/input_processor.py``).
Plan
    Move to a logits-processor ``validate_params`` hook if it becomes cheap to register
    one without adding a per-token processor.
"""

from __future__ import annotations

import functools
from typing import Any

from nexus_vllm.integration.config import config_from_additional, validate_request_args

__all__ = ["apply"]

_UNSET = object()


def apply() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    orig = InputProcessor._validate_params
    if getattr(orig, "_nexus_patched", False):
        return

    @functools.wraps(orig)
    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams) and params.extra_args:
            server_cfg = getattr(self, "_nexus_server_cfg", _UNSET)
            if server_cfg is _UNSET:
                server_cfg = config_from_additional(self.vllm_config.additional_config)
                self._nexus_server_cfg = server_cfg
            try:
                validate_request_args(params.extra_args, server_cfg)
            except ValueError as exc:
                field = str(exc).split(":", 1)[0]
                raise VLLMValidationError(str(exc), parameter=field) from None
        return result

    _validate_params._nexus_patched = True  # type: ignore[attr-defined]
    InputProcessor._validate_params = _validate_params  # type: ignore[method-assign]
