"""When an eviction event fires: the one rule shared by the vLLM plugin and the
transformers path, so both evict at the same moments for the same stream.

* After every prefill chunk, if the sequence holds more blocks than its budget.
* While decoding, once the sequence is over budget and ``interval`` decode tokens have
  passed since the last event, or at once when it reaches ``hard_limit`` blocks (budget
  plus one prefill chunk: the most a sequence may ever hold).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EvictionTrigger"]


@dataclass
class EvictionTrigger:
    """Per-sequence event clock.

    Parameters
    ----------
    interval : int
        Decode tokens between events once over budget.
    """

    interval: int
    decode_tokens: int = 0

    def reset(self) -> None:
        self.decode_tokens = 0

    def prefill_chunk(self, live_blocks: int, budget_blocks: int) -> bool:
        """Whether an event follows the prefill chunk just computed."""
        if live_blocks <= budget_blocks:
            return False
        self.decode_tokens = 0
        return True

    def decode(self, new_tokens: int, live_blocks: int, budget_blocks: int,
               hard_limit: int) -> bool:
        """Count ``new_tokens`` decoded tokens; whether an event follows them."""
        self.decode_tokens += new_tokens
        if live_blocks <= budget_blocks:
            return False
        if self.decode_tokens >= self.interval or live_blocks >= hard_limit:
            self.decode_tokens = 0
            return True
        return False
