"""Patch: refuse bad per-request eviction fields with HTTP 400 before a stream starts.

Why
    The engine-side check (``input_processor``) runs inside ``engine_client.generate()``,
    which a streamed request first iterates after the 200 and the event-stream headers
    are sent: a bad ``vllm_xargs.kv_budget`` then arrives as an error event inside a 200
    stream. Stock vLLM answers a bad sampling parameter with a 400 before that
    (``to_sampling_params`` raises inside ``_create_completion``, before the
    ``StreamingResponse`` exists). The check cannot live in ``to_sampling_params``: the
    request model does not know the server's config (eviction on, block size, forced set,
    ``max_model_len``), which the serving object reaches through its ``input_processor``.
How
    Wrap ``OpenAIServingCompletion.render_completion_request``,
    ``OpenAIServingChat.render_chat_request`` and
    ``OpenAIServingResponses._render_resolved_response_inputs``: the serving layer's
    engine-aware checks (model, engine health, prompt rendering) that run before a
    response is started, for streamed and unstreamed requests alike (the Anthropic
    messages endpoint goes through the chat one; ``/v1/responses`` carries
    ``vllm_xargs`` into ``SamplingParams.extra_args`` the same way, through
    ``ResponsesRequest.to_sampling_params``, called after the render and before
    ``request.stream`` picks the stream generator). After vLLM's checks pass, run
    :func:`nexus_vllm.integration.frontend.request_args.validate_request_args` on
    ``request.vllm_xargs``; a bad field returns vLLM's ``ErrorResponse`` (HTTP 400,
    ``param`` = ``vllm_xargs.<field>``). It is returned, not raised, so vLLM logs nothing
    for it.
vLLM version
    0.32 to 0.34 (``vllm/entrypoints/openai/completion/serving.py``,
    ``vllm/entrypoints/openai/chat_completion/serving.py``,
    ``vllm/entrypoints/openai/responses/serving.py``).
Plan
    Drop when vLLM grows a plugin hook for request validation in the serving layer.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from nexus_vllm.integration.compat.catalogue import swap
from nexus_vllm.integration.frontend.patches.input_processor import server_latent, server_limits
from nexus_vllm.integration.frontend.request_args import RequestArgError, validate_request_args

if TYPE_CHECKING:
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.engine.serving import BaseServing

__all__ = ["apply", "check_xargs"]


def check_xargs(serving: BaseServing, request: object) -> ErrorResponse | None:
    """The ``ErrorResponse`` for a request whose ``vllm_xargs`` fail validation, else None.

    ``serving`` is one of vLLM's OpenAI serving objects (it carries the engine's
    ``input_processor``); ``request`` a completion, chat completion or responses request.
    """
    xargs = getattr(request, "vllm_xargs", None)
    input_processor = getattr(serving, "input_processor", None)
    if not xargs or input_processor is None:
        return None
    server_cfg, max_len = server_limits(input_processor)
    try:
        validate_request_args(xargs, server_cfg, max_model_len=max_len,
                              latent=server_latent(input_processor))
    except RequestArgError as exc:
        return serving.create_error_response(str(exc), param=exc.field)
    return None


Render = Callable[..., Awaitable[object]]


def _wrap(orig: Render, error_type: type) -> Render:
    @functools.wraps(orig)
    async def render(self: BaseServing, request: object, *args: object,
                     **kwargs: object) -> object:
        result = await orig(self, request, *args, **kwargs)
        # vLLM's own errors (unknown model, prompt too long) come first, as they would
        # for a bad sampling parameter.
        if isinstance(result, error_type):
            return result
        return check_xargs(self, request) or result

    render._nexus_patched = True  # type: ignore[attr-defined]
    return render


def apply() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    for cls, name in ((OpenAIServingCompletion, "render_completion_request"),
                      (OpenAIServingChat, "render_chat_request"),
                      (OpenAIServingResponses, "_render_resolved_response_inputs")):
        orig = getattr(cls, name)
        if not getattr(orig, "_nexus_patched", False):
            swap(cls, name, _wrap(orig, ErrorResponse))
