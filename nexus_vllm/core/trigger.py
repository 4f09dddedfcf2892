"""When an eviction event fires: the one rule shared by the vLLM plugin and the
transformers path, so both evict at the same moments for the same stream.

The budget at each moment is :func:`~nexus_vllm.core.budget.target_blocks` (it follows the
config's ``prompt_mode``), the most a sequence may hold :func:`~nexus_vllm.core.budget.hard_limit`.
A step that starts inside the prompt is a prefill step (a prompt chunk); any other is a
decode step.

* After every prefill step, if the sequence holds more blocks than its target. In
  ``stream`` mode that is every chunk once over budget; in ``end`` mode with no
  ``prefill_budget`` it is exactly one event, after the prompt's last chunk (the
  prompt-end event, its window ending with the question); in ``keep`` mode none.
* After a decode step, once the sequence is over its target and ``interval`` decode
  tokens have passed since the last event, or at once when it reaches the hard limit (the
  target plus the blocks ``interval`` tokens can add,
  :func:`~nexus_vllm.core.budget.decode_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .budget import hard_limit, target_blocks
from .scoring import cdiv

if TYPE_CHECKING:
    from .config import EvictionConfig

__all__ = ["EventKind", "EvictionTrigger", "first_prompt_event"]

# The kind of a due event: after a prefill step (the prefill policy and window) or after
# a decode step.
EventKind = Literal["prefill", "decode"]


@dataclass
class EvictionTrigger:
    """Per-sequence event clock; :meth:`advance` is the only thing that moves it.

    Parameters
    ----------
    config : EvictionConfig or None
        The request's config (its budget rule, ``interval`` and chunk size); None: a
        sequence that never evicts (a dense session keeps the clock for its prompt
        length only, and never advances it).
    prompt_tokens : int
        The request's prompt length (where prefill ends and the prompt-end event fires).

    Attributes
    ----------
    tokens : int
        Computed tokens as of the last :meth:`advance`.
    decode_tokens : int
        Decode tokens counted since the last event.
    """

    config: EvictionConfig | None
    prompt_tokens: int
    tokens: int = 0
    decode_tokens: int = 0

    def advance(self, tokens: int, live_blocks: int, new_tokens: int | None = None, *,
                may_fire: bool = True) -> EventKind | None:
        """Move the clock over one step; the event due after it, or None.

        Parameters
        ----------
        tokens : int
            Computed tokens once the step ran.
        live_blocks : int
            Blocks the sequence holds then.
        new_tokens : int, optional
            Tokens the step computed; default ``tokens - self.tokens`` (every token since
            the clock last moved). A step may start past the clock: a prefix-cache hit
            computes nothing for the tokens it found.
        may_fire : bool
            False while the sequence cannot run an event (one is still in flight): a due
            event is not taken and the clock keeps counting, so it fires at the first
            step allowed.

        Returns
        -------
        ``"prefill"`` or ``"decode"`` (the step's kind) when an event follows the step,
        else None.
        """
        cfg = self.config
        assert cfg is not None, "a clock without a config never fires"
        new = tokens - self.tokens if new_tokens is None else int(new_tokens)
        before = tokens - new
        self.tokens = tokens
        over = live_blocks > target_blocks(cfg, tokens, self.prompt_tokens)
        kind: EventKind
        if before < self.prompt_tokens:
            kind = "prefill"
            due = over
            # A request resumed after preemption recomputes its generated tokens inside a
            # prefill chunk: they count as decode tokens, as they did the first time.
            counted = max(0, tokens - max(before, self.prompt_tokens))
        else:
            kind = "decode"
            due = over and (self.decode_tokens + new >= cfg.interval
                            or live_blocks >= hard_limit(cfg, tokens, self.prompt_tokens))
            counted = new
        if due and may_fire:
            # The event restarts the count; a decode step's own tokens are before it.
            self.decode_tokens = counted if kind == "prefill" else 0
            return kind
        self.decode_tokens += counted
        return None

    def ends_prompt(self, prefill: bool) -> bool:
        """Whether an event of that kind after the clock's last :meth:`advance` is the
        prompt-end event: a prefill event once the prompt's last token is computed (in
        ``stream`` the one prompt event that sees the question)."""
        return prefill and self.tokens >= self.prompt_tokens


def first_prompt_event(config: EvictionConfig, prompt_tokens: int) -> tuple[int, int] | None:
    """``(start, end)``: the prompt chunk after which the first eviction event fires, for
    a prompt of ``prompt_tokens`` streamed in ``config.chunk_size`` chunks with nothing
    evicted before it (the trigger's own rule, :meth:`EvictionTrigger.advance`); None when
    no event fires during the prompt (``keep`` mode, or a prompt within its budget)."""
    trigger = EvictionTrigger(config, prompt_tokens)
    end = 0
    while end < prompt_tokens:
        start, end = end, min(end + int(config.chunk_size), prompt_tokens)
        if trigger.advance(end, cdiv(end, config.block_size)) is not None:
            return start, end
    return None
