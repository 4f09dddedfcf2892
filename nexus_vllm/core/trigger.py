"""When an eviction event fires: the one rule shared by the vLLM plugin and the
transformers path, so both evict at the same moments for the same stream.

The budget at each moment is :meth:`EvictionConfig.target_blocks` (it follows the
config's ``prompt_mode``), the most a sequence may hold :meth:`EvictionConfig.hard_limit`.

* After every prefill chunk, if the sequence holds more blocks than its target. In
  ``stream`` mode that is every chunk once over budget; in ``end`` mode with no
  ``prefill_budget`` it is exactly one event, after the prompt's last chunk (the
  prompt-end event, its window ending with the question); in ``keep`` mode none.
* While decoding, once the sequence is over its target and ``interval`` decode tokens have
  passed since the last event, or at once when it reaches the hard limit (the target plus
  the blocks ``interval`` tokens can add, :attr:`EvictionConfig.decode_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .scoring import cdiv

__all__ = ["EvictionTrigger", "first_prompt_event"]


@dataclass
class EvictionTrigger:
    """Per-sequence event clock.

    Parameters
    ----------
    config : EvictionConfig
        The request's config (its budget rule, ``interval`` and chunk size).
    prompt_tokens : int
        The request's prompt length (where prefill ends and the prompt-end event fires).
    """

    config: Any
    prompt_tokens: int
    decode_tokens: int = 0

    def prefill_due(self, tokens: int, live_blocks: int) -> bool:
        """Whether an event would follow the prefill chunk that brought the sequence to
        ``tokens`` computed tokens, holding ``live_blocks`` (no state change)."""
        return live_blocks > self.config.target_blocks(tokens, self.prompt_tokens)

    def prefill_chunk(self, tokens: int, live_blocks: int) -> bool:
        """Whether an event follows the prefill chunk that brought the sequence to
        ``tokens`` computed tokens, holding ``live_blocks``."""
        if not self.prefill_due(tokens, live_blocks):
            return False
        self.decode_tokens = 0
        return True

    def decode_due(self, new_tokens: int, tokens: int, live_blocks: int) -> bool:
        """Whether an event would follow ``new_tokens`` more decoded tokens that bring the
        sequence to ``tokens`` tokens and ``live_blocks`` blocks (no state change)."""
        cfg = self.config
        if live_blocks <= cfg.target_blocks(tokens, self.prompt_tokens):
            return False
        return (self.decode_tokens + new_tokens >= cfg.interval
                or live_blocks >= cfg.hard_limit(tokens, self.prompt_tokens))

    def decode(self, new_tokens: int, tokens: int, live_blocks: int) -> bool:
        """Count ``new_tokens`` decoded tokens; whether an event follows them."""
        due = self.decode_due(new_tokens, tokens, live_blocks)
        self.decode_tokens = 0 if due else self.decode_tokens + new_tokens
        return due


def first_prompt_event(config: Any, prompt_tokens: int) -> tuple[int, int] | None:
    """``(start, end)``: the prompt chunk after which the first eviction event fires, for
    a prompt of ``prompt_tokens`` streamed in ``config.chunk_size`` chunks with nothing
    evicted before it (the trigger's own rule, :meth:`EvictionTrigger.prefill_chunk`);
    None when no event fires during the prompt (``keep`` mode, or a prompt within its
    budget)."""
    trigger = EvictionTrigger(config, prompt_tokens)
    end = 0
    while end < prompt_tokens:
        start, end = end, min(end + int(config.chunk_size), prompt_tokens)
        if trigger.prefill_chunk(end, cdiv(end, config.block_size)):
            return start, end
    return None
