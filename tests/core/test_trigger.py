"""The event rule of every prompt mode, on random chunkings (``core/trigger.py``).

A simulated sequence is streamed the way both paths stream it: prompt chunks with the
trigger consulted after each, then decode tokens; an event evicts down to the target
(what any policy does). The rule's promises are checked on every chunking hypothesis
draws.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexus_vllm.core import ConfigError, EvictionConfig, EvictionTrigger, cdiv
from nexus_vllm.core.budget import (
    bound_blocks,
    budget_blocks,
    decode_blocks,
    decode_peak_blocks,
    hard_limit,
    peak_from,
    target_blocks,
)

BLOCK = 8


def _config(mode: str, budget: int | float, prefill_budget: int | None = None,
            chunk: int = 32, interval: int = 4) -> EvictionConfig:
    knobs = {"block_size": BLOCK, "recent_blocks": 2, "chunk_size": chunk,
             "interval": interval, "prompt_mode": mode, "prefill_budget": prefill_budget}
    if isinstance(budget, float):
        return EvictionConfig(method="snapkv", keep_ratio=budget, **knobs)
    return EvictionConfig(method="snapkv", max_tokens=budget, **knobs)


def _stream(cfg: EvictionConfig, chunks: list[int], decode: int) -> list[tuple[int, bool, int]]:
    """Events as (tokens, prefill, live blocks before); asserts the hard limit throughout.

    Only full blocks are evicted, so after an event the sequence holds its target plus
    the current partial block at most: the simulation keeps ``target`` full blocks.
    """
    prompt = sum(chunks)
    trigger = EvictionTrigger(cfg, prompt)
    tokens, evicted = 0, 0  # evicted: blocks dropped so far
    events = []
    for n in chunks:
        tokens += n
        live = cdiv(tokens, BLOCK) - evicted
        assert live <= max(hard_limit(cfg, tokens, prompt), cdiv(min(tokens, prompt), BLOCK))
        event = trigger.advance(tokens, live)
        assert event in (None, "prefill")
        if event:
            events.append((tokens, True, live))
            evicted += live - target_blocks(cfg, tokens, prompt)
    for _ in range(decode):
        tokens += 1
        live = cdiv(tokens, BLOCK) - evicted
        assert live <= hard_limit(cfg, tokens, prompt)
        event = trigger.advance(tokens, live)
        assert event in (None, "decode")
        if event:
            events.append((tokens, False, live))
            evicted += live - target_blocks(cfg, tokens, prompt)
    assert cdiv(tokens, BLOCK) - evicted <= bound_blocks(cfg, prompt, tokens)
    return events


chunkings = st.lists(st.integers(min_value=1, max_value=32), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(chunks=chunkings, decode=st.integers(0, 60), budget=st.sampled_from([64, 96, 0.3]))
def test_end_mode_fires_exactly_one_prefill_event_at_the_prompt_end(chunks, decode,
                                                                      budget) -> None:
    cfg = _config("end", budget)
    prompt = sum(chunks)
    events = _stream(cfg, chunks, decode)
    prefill = [e for e in events if e[1]]
    over = cdiv(prompt, BLOCK) > budget_blocks(cfg, prompt)
    assert [e[0] for e in prefill] == ([prompt] if over else [])


@settings(max_examples=200, deadline=None)
@given(chunks=chunkings, decode=st.integers(0, 60))
def test_end_mode_with_prefill_budget_streams_under_it_then_ends_at_budget(chunks,
                                                                         decode) -> None:
    cfg = _config("end", 64, prefill_budget=128)
    prompt = sum(chunks)
    events = _stream(cfg, chunks, decode)
    for tokens, prefill, _ in events:
        if prefill and tokens < prompt:
            assert target_blocks(cfg, tokens, prompt) == 128 // BLOCK
    if cdiv(prompt, BLOCK) > 64 // BLOCK:
        assert any(e[0] == prompt and e[1] for e in events), "the prompt-end event"


@settings(max_examples=200, deadline=None)
@given(chunks=chunkings, decode=st.integers(0, 120), budget=st.sampled_from([48, 0.3]))
def test_keep_mode_never_fires_during_prefill(chunks, decode, budget) -> None:
    cfg = _config("keep", budget)
    events = _stream(cfg, chunks, decode)
    assert not [e for e in events if e[1]]
    if decode > budget_blocks(cfg, decode) * BLOCK + 2 * cfg.interval + BLOCK:
        assert events, "the generated tokens go over their budget, so decode events fire"


@settings(max_examples=200, deadline=None)
@given(chunks=chunkings, decode=st.integers(0, 60))
def test_stream_mode_is_the_budget_from_the_first_chunk(chunks, decode) -> None:
    cfg = _config("stream", 64)
    prompt = sum(chunks)
    tokens = 0
    for n in chunks:
        tokens += n
        assert target_blocks(cfg, tokens, prompt) == budget_blocks(cfg, tokens)
    _stream(cfg, chunks, decode)


def test_bound_is_the_prompt_peak_in_end_mode_and_prompt_plus_budget_in_keep() -> None:
    # 1000-token prompt, 100 generated: 126 / 138 blocks of 8.
    end = _config("end", 64)
    assert bound_blocks(end, 1000, 1100) == 125  # the whole prompt before the event
    capped = _config("end", 64, prefill_budget=256)
    assert bound_blocks(capped, 1000, 1100) == 256 // BLOCK + 4  # cap + one 32-token chunk
    keep = _config("keep", 64)
    # the prompt + the budget + what one decode interval (4 tokens) adds
    assert bound_blocks(keep, 1000, 1100) == 125 + 64 // BLOCK + 1
    stream = _config("stream", 64)
    assert bound_blocks(stream, 1000, 1100) == 64 // BLOCK + 4  # the prompt's chunk peak
    # Never more than the sequence needs.
    assert bound_blocks(keep, 40, 50) == cdiv(50, BLOCK)


def test_peak_from_drops_to_the_decode_bound_after_the_prompt_end() -> None:
    end = _config("end", 64)
    assert peak_from(end, 500, 1000, 1100) == bound_blocks(end, 1000, 1100) == 125
    # Decoding: the budget plus the blocks one decode interval adds, not a prefill chunk.
    assert peak_from(end, 1000, 1000, 1100) == 64 // BLOCK + 1
    stream = _config("stream", 64)
    assert peak_from(stream, 0, 1000, 1100) == 64 // BLOCK + 4
    assert peak_from(stream, 1000, 1000, 1100) == peak_from(stream, 1050, 1000, 1100) == 9
    # An interval longer than a block: the blocks it can cross.
    wide = _config("stream", 64, interval=20)
    assert decode_blocks(wide) == 3 and peak_from(wide, 1050, 1000, 1100) == 64 // BLOCK + 3
    # The decode peak on its own (what the planner's ceiling divides by), capped at the
    # whole sequence.
    assert decode_peak_blocks(end, 1000, 1100) == peak_from(end, 1000, 1000, 1100) == 9
    keep = _config("keep", 64)
    assert decode_peak_blocks(keep, 40, 50) == cdiv(50, BLOCK)


def test_forced_tokens_is_the_least_budget() -> None:
    cfg = _config("end", 64)
    assert cfg.forced_tokens == (1 + 2 + 1) * BLOCK == 32  # sink + recent + current
    assert EvictionConfig().forced_tokens == EvictionConfig().num_forced * 32
    with pytest.raises(ConfigError, match="= 32; got 31"):
        _config("end", 31)


@settings(max_examples=200, deadline=None)
@given(decode=st.integers(40, 200), interval=st.sampled_from([1, 4, 8, 13, 20]),
       budget=st.sampled_from([64, 96]))
def test_the_decode_hard_limit_is_reached(decode, interval, budget) -> None:
    """The decode bound is not loose: some step holds exactly the target plus the blocks
    one interval adds (with a fixed budget, once decoding has run a few intervals)."""
    cfg = _config("stream", budget, interval=interval)
    prompt = 300
    trigger = EvictionTrigger(cfg, prompt)
    tokens, evicted, peak = prompt, cdiv(prompt, BLOCK) - budget_blocks(cfg, prompt), 0
    for _ in range(decode):
        tokens += 1
        live = cdiv(tokens, BLOCK) - evicted
        peak = max(peak, live)
        assert live <= hard_limit(cfg, tokens, prompt)
        if trigger.advance(tokens, live, 1):
            evicted += live - target_blocks(cfg, tokens, prompt)
    assert peak == peak_from(cfg, prompt, prompt, tokens)


def test_a_decode_event_fires_after_interval_tokens_or_at_the_hard_limit() -> None:
    cfg = _config("stream", 64, interval=4)  # target 8 blocks, hard limit 9
    trigger = EvictionTrigger(cfg, 100, tokens=100)
    assert trigger.advance(101, 9) == "decode"  # at the hard limit at once
    assert trigger.decode_tokens == 0
    for tokens in (102, 103, 104):
        assert trigger.advance(tokens, 8) is None  # within the target: only counted
    assert trigger.advance(105, 8) is None and trigger.decode_tokens == 4
    # Over the target with an interval's tokens counted: due.
    assert trigger.advance(106, 9, 1) == "decode" and trigger.decode_tokens == 0


def test_a_due_event_that_may_not_fire_waits_and_the_clock_keeps_counting() -> None:
    cfg = _config("stream", 64, interval=4)
    trigger = EvictionTrigger(cfg, 100, tokens=100)
    for tokens in (101, 102, 103, 104):
        assert trigger.advance(tokens, 8, may_fire=False) is None
    assert trigger.decode_tokens == 4
    assert trigger.advance(105, 8, may_fire=False) is None  # due, held back
    assert trigger.decode_tokens == 5
    assert trigger.advance(106, 8) is None  # within the target again: not due
    assert trigger.advance(107, 9) == "decode"  # the first step allowed once over
    # A prefill event held back likewise fires after the next chunk that is over.
    prefill = EvictionTrigger(cfg, 1000)
    assert prefill.advance(96, 12, may_fire=False) is None
    assert prefill.advance(128, 16) == "prefill"


def test_generated_tokens_recomputed_in_a_prefill_chunk_count_as_decode_tokens() -> None:
    """A request resumed after preemption recomputes its prompt and its generated tokens
    in prefill chunks: the ones past the prompt count toward the next decode event, also
    after an event that follows the chunk."""
    cfg = _config("stream", 64, interval=16)
    trigger = EvictionTrigger(cfg, 100)
    assert trigger.advance(96, 12, 96) == "prefill"
    assert trigger.advance(110, 10, 14) == "prefill"  # 4 tokens before the prompt's end
    assert trigger.decode_tokens == 10
    assert trigger.advance(111, 9, 1) is None and trigger.decode_tokens == 11


def test_the_step_starts_where_new_tokens_says() -> None:
    """``new_tokens`` defaults to every token since the clock last moved; a step that
    starts past the clock (a prefix-cache hit) says how many it computed, which decides
    whether it is a prefill or a decode step."""
    cfg = _config("stream", 64, interval=4)
    trigger = EvictionTrigger(cfg, 100)
    assert trigger.advance(104, 13) == "prefill"  # 0..104 spans the prompt's end
    assert trigger.tokens == 104 and trigger.decode_tokens == 4
    other = EvictionTrigger(cfg, 100)
    assert other.advance(104, 13, 4) == "decode"  # 100..104: a decode step


def test_only_a_prefill_event_after_the_prompts_last_token_ends_the_prompt() -> None:
    """``ends_prompt`` reads the clock's last advance: prefill events before the prompt's
    last token do not end it, the one after it does, and decode events never do."""
    cfg = _config("stream", 32)
    trigger = EvictionTrigger(cfg, 100)
    kinds = [trigger.advance(tokens, cdiv(tokens, BLOCK)) for tokens in (40, 80, 100)]
    assert kinds == ["prefill", "prefill", "prefill"]
    assert [trigger.ends_prompt(True), trigger.ends_prompt(False)] == [True, False]
    trigger = EvictionTrigger(cfg, 100)
    trigger.advance(80, cdiv(80, BLOCK))
    assert not trigger.ends_prompt(True)
