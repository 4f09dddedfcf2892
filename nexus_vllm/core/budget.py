"""A request's budget over its life, as functions of its config and token counts: the
one rule that the vLLM plugin's trigger and admission, the transformers path, the
simulator and the capacity planner read.

* What a sequence may keep: :func:`budget_blocks` (the budget over the tokens seen),
  :func:`target_blocks` (the budget at a moment of the request, by ``prompt_mode``) and
  :func:`prompt_blocks` (``keep`` mode's prompt).
* What it may hold before the event that follows: :func:`hard_limit`, with
  :func:`chunk_blocks` and :func:`decode_blocks` (what a prompt chunk or ``interval``
  decode tokens add); :func:`evicts_mid_prompt` says whether the prompt's chunking bounds
  it.
* What admission reserves: :func:`bound_blocks` (a new request), :func:`peak_from` (one
  under way) and :func:`decode_peak_blocks` (one past its prompt); the admission rule
  itself is :mod:`nexus_vllm.core.admission`.
* What a sliding-window group holds besides: :func:`window_in_flight_tokens`,
  :func:`window_max_blocks` and :func:`window_blocks`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ._validate import check_int
from .scoring import cdiv

if TYPE_CHECKING:
    from .config import EvictionConfig

__all__ = ["bound_blocks", "budget_blocks", "chunk_blocks", "decode_blocks",
           "decode_peak_blocks", "evicts_mid_prompt", "hard_limit", "peak_from",
           "prompt_blocks", "target_blocks", "window_blocks", "window_in_flight_tokens",
           "window_max_blocks"]


def budget_blocks(cfg: EvictionConfig, num_tokens_seen: int) -> int:
    """Blocks a sequence that has seen ``num_tokens_seen`` tokens may keep.

    ``max_tokens // block_size`` for a fixed budget, ``ceil(keep_ratio * blocks seen)``
    for a ratio; never below the forced set. Without a budget, every block.
    """
    check_int("num_tokens_seen", num_tokens_seen, low=0)
    seen_blocks = cdiv(num_tokens_seen, cfg.block_size)
    if cfg.max_tokens is not None:
        allowed = cfg.max_tokens // cfg.block_size
    elif cfg.keep_ratio is not None:
        allowed = math.ceil(cfg.keep_ratio * seen_blocks - 1e-9)
    else:
        return seen_blocks
    return max(allowed, cfg.num_forced)


def target_blocks(cfg: EvictionConfig, tokens: int, prompt_tokens: int) -> int:
    """Blocks a sequence may keep once ``tokens`` of its tokens are computed, its prompt
    being ``prompt_tokens`` long (``tokens < prompt_tokens``: mid-prefill).

    ``stream``: :func:`budget_blocks` throughout. ``end``: ``prefill_budget`` (none:
    every block) until the prompt is computed, then the budget. ``keep``: every prompt
    block plus the budget over the generated tokens.
    """
    if cfg.prompt_mode == "stream":
        return budget_blocks(cfg, tokens)
    if tokens < prompt_tokens:
        if cfg.prompt_mode == "end" and cfg.prefill_budget is not None:
            return max(cfg.prefill_budget // cfg.block_size, cfg.num_forced)
        return cdiv(tokens, cfg.block_size)
    if cfg.prompt_mode == "end":
        return budget_blocks(cfg, tokens)
    return prompt_blocks(cfg, prompt_tokens) + budget_blocks(cfg, tokens - prompt_tokens)


def prompt_blocks(cfg: EvictionConfig, prompt_tokens: int) -> int:
    """Blocks forced to stay besides the forced set: the prompt's, in ``keep`` mode."""
    return cdiv(prompt_tokens, cfg.block_size) if cfg.prompt_mode == "keep" else 0


def evicts_mid_prompt(cfg: EvictionConfig) -> bool:
    """Whether events can fire before the prompt's end (``stream``, or ``end`` under a
    ``prefill_budget``): only then does the prompt's chunking bound what a request
    holds, so only then must a server chunk it at ``chunk_size``."""
    return cfg.prompt_mode == "stream" or (cfg.prompt_mode == "end"
                                            and cfg.prefill_budget is not None)


def chunk_blocks(cfg: EvictionConfig) -> int:
    """Blocks one prefill chunk may add before the event that follows it."""
    return cdiv(cfg.chunk_size, cfg.block_size)


def decode_blocks(cfg: EvictionConfig) -> int:
    """Blocks decoding may add before the event that follows: ``interval`` tokens
    cross at most this many block boundaries."""
    return cdiv(cfg.interval, cfg.block_size)


def hard_limit(cfg: EvictionConfig, tokens: int, prompt_tokens: int) -> int:
    """Most blocks a sequence may hold once ``tokens`` are computed, before the event
    that may follow.

    While the prompt is computed (``tokens <= prompt_tokens``): the target it was
    computed under plus one prefill chunk (an event follows every chunk); in ``end``
    mode the prompt's last chunk is computed under the prefill target, so at the
    prompt's end this is the prompt's peak, not the budget's. Once decoding: the
    target plus :func:`decode_blocks` (an event follows every ``interval`` tokens, and
    fires at once on reaching this).
    """
    if tokens > prompt_tokens:
        return target_blocks(cfg, tokens, prompt_tokens) + decode_blocks(cfg)
    if cfg.prompt_mode == "end":
        return target_blocks(cfg, min(tokens, prompt_tokens - 1), prompt_tokens) \
            + chunk_blocks(cfg)
    return target_blocks(cfg, tokens, prompt_tokens) + chunk_blocks(cfg)


def bound_blocks(cfg: EvictionConfig, prompt_tokens: int, total_tokens: int, *,
                 recompute_tokens: int = 0) -> int:
    """Most blocks a request of ``prompt_tokens`` growing to ``total_tokens`` ever holds
    (what admission reserves for a new request): the larger of its prompt's peak and
    its decode peak (:func:`peak_from` once the prompt is done), never more than the
    whole sequence.

    ``recompute_tokens``: a request that restarts (vLLM resumes a preempted request
    by computing its prompt and the tokens it generated again, as one prefill)
    computes that many tokens before it decodes. A chunk that ends past the prompt
    holds what it was computed under plus the chunk (in ``end`` and ``keep`` mode
    the prompt is not evicted before that chunk's event, so without a chunk cap it
    holds all it recomputed). At most ``prompt_tokens`` (a new request): no change.
    """
    bs = cfg.block_size
    prompt_limit = hard_limit(cfg, prompt_tokens, prompt_tokens)
    prompt_peak = min(cdiv(prompt_tokens, bs), prompt_limit)
    if recompute_tokens > prompt_tokens:
        # Chunks that end in the prompt hold at most prompt_limit; a later chunk adds
        # up to one chunk to a target no larger than the last one's.
        prompt_peak = max(prompt_peak, min(
            cdiv(recompute_tokens, bs),
            max(prompt_limit, target_blocks(cfg, recompute_tokens, prompt_tokens)
                + chunk_blocks(cfg))))
    return min(cdiv(total_tokens, bs),
               max(prompt_peak, _decode_peak(cfg, prompt_tokens, total_tokens)))


def peak_from(cfg: EvictionConfig, tokens: int, prompt_tokens: int, total_tokens: int) -> int:
    """Most blocks a request may still come to hold once ``tokens`` are computed (what
    admission keeps reserved for it). Before the prompt's end, :func:`bound_blocks`;
    after it, the decode peak (the target plus :func:`decode_blocks`): a request
    that has shed its prompt, or its last prefill chunk, no longer needs their
    room."""
    if tokens < prompt_tokens:
        return bound_blocks(cfg, prompt_tokens, total_tokens)
    return decode_peak_blocks(cfg, prompt_tokens, total_tokens)


def decode_peak_blocks(cfg: EvictionConfig, prompt_tokens: int, total_tokens: int) -> int:
    """Most blocks a request holds while decoding (what :func:`peak_from` reserves once
    its prompt is computed): the decode hard limit at its longest sequence, never more
    than the whole sequence."""
    return min(cdiv(total_tokens, cfg.block_size),
               _decode_peak(cfg, prompt_tokens, total_tokens))


def _decode_peak(cfg: EvictionConfig, prompt_tokens: int, total_tokens: int) -> int:
    """The decode hard limit at the request's longest sequence (targets never shrink
    as tokens grow, so this is the most it holds while decoding)."""
    return hard_limit(cfg, max(total_tokens, prompt_tokens + 1), prompt_tokens)


def window_in_flight_tokens(step_tokens: int, steps_in_flight: int = 1, *, tokens: int = 0,
                            prefill_end: int | None = None,
                            server_cfg: EvictionConfig | None = None) -> int:
    """Tokens a request may have scheduled and not yet processed at its next allocation,
    which each sliding-window group holds beyond its window (:func:`window_blocks`).

    ``tokens``: computed as of its last scheduled step; ``prefill_end``: its prompt, or
    what a resumed request recomputes (None: it has not started). ``server_cfg``: the
    server's config (None: a server that does not evict, stock vLLM).

    vLLM 0.32 frees a sliding group's blocks on the processed tokens (computed less in
    flight, ``vllm/v1/core/kv_cache_manager.py:555``) and counts ``max_concurrent_batches``
    full steps in flight in every phase (``max_in_flight_tokens``,
    ``vllm/config/vllm.py:577-598``: the pipeline stages, one more with async
    scheduling). While the prompt is computed a step gives one request at most
    ``step_tokens``, and at most ``server_cfg.chunk_size`` on a server whose config
    evicts mid-prompt (:func:`evicts_mid_prompt`): such a server caps
    every request's prompt tokens per step there, whatever the request's own prompt mode
    (vLLM's ``long_prefill_token_threshold``, ``engine_policy.forced_engine_args``, and
    the plugin's ``lone_request_prefill_cap`` where vLLM lifts it for a lone request). A
    decoding request adds one token a step (speculative decoding is refused): once
    ``steps_in_flight`` decode steps follow its last prompt step, that step is
    processed, so from then on ``steps_in_flight`` tokens.
    """
    k = max(1, int(steps_in_flight))
    decoding = prefill_end is not None and int(tokens) >= int(prefill_end) + k
    if decoding:
        return k
    step = int(step_tokens)
    if server_cfg is not None and evicts_mid_prompt(server_cfg):
        step = min(step, int(server_cfg.chunk_size))
    return k * step


def window_max_blocks(window: int, block_size: int, in_flight_tokens: int,
                      max_len: int | None = None) -> int:
    """Most blocks a request holds in a sliding-window group of ``window`` tokens with
    ``in_flight_tokens`` scheduled and not yet processed: ``ceil(min(window - 1 +
    in_flight_tokens, max_len) / block_size) + 1`` (the window may start mid-block;
    vLLM's ``SlidingWindowSpec.max_admission_blocks_per_request``,
    ``vllm/v1/kv_cache_interface.py:859``, which ``max_memory_usage_bytes`` at :887 sizes
    the pool by)."""
    tokens = int(window) - 1 + int(in_flight_tokens)
    if max_len is not None:
        tokens = min(tokens, int(max_len))
    return cdiv(tokens, block_size) + 1


def window_blocks(window: int, block_size: int, total_tokens: int,
                  in_flight_tokens: int) -> int:
    """Most blocks a request of ``total_tokens`` holds in a sliding-window group:
    :func:`window_max_blocks`, never more than its sequence's blocks."""
    return min(cdiv(int(total_tokens), block_size),
               window_max_blocks(window, block_size, in_flight_tokens))
