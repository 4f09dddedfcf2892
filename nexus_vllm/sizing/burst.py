"""A burst of identical requests through the server's admission, step by step.

Concurrent requests come from the rules the server runs, not a formula of their own:
:func:`~nexus_vllm.core.budget.bound_blocks` (what admission reserves for a new request) and
:func:`~nexus_vllm.core.budget.peak_from` (what an admitted one may still grow to), applied step by
step as the plugin's admission (``AdmissionGate.may_admit`` in
``integration/scheduler/admission.py``, both through :mod:`nexus_vllm.core.admission`)
applies them to a burst of identical requests arriving at once (the capacity benchmark's
workload). The reserve of a running request shrinks as it progresses: an ``end`` request
past its prompt keeps only its decode hard limit, so a burst runs more of them than
``pool // bound``. Stock vLLM 0.32 admits a request when its whole prompt fits in the free
blocks (``scheduler_reserve_full_isl``) and keeps no other reserve (its ``--watermark``
defaults to 0, and so does this sizing); it preempts when decode runs out of blocks. Each
request prefills at most ``chunk_size`` tokens a step when its prompt mode evicts during
the prompt (the plugin sets vLLM's ``long_prefill_token_threshold``) and at most the
step's token budget (``--max-num-batched-tokens``) otherwise, as on stock vLLM; decode
adds one token a step.

A hybrid sliding-window model (:mod:`.groups`) has more KV cache groups drawing on the one
pool: ``full_groups`` full-attention groups hold what a one-group model holds, and each
sliding group holds the blocks still in its window and the tokens in flight. The plugin's
admission adds each sliding group's window plus the tokens in flight for the request's
phase (:func:`window_allowance`: ``steps_in_flight`` steps while the prompt is computed,
each of at most ``chunk_size`` tokens where the prompt mode evicts during the prompt,
``steps_in_flight`` tokens once it decodes) to every bound and reserve; stock vLLM's
admission counts the prompt in every group, capped in a sliding group at its window plus
``steps_in_flight`` whole steps (:func:`stock_admission_blocks`), and a running stock
request's sliding groups free what leaves the window before it allocates.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nexus_vllm.core import EvictionConfig, cdiv
from nexus_vllm.core.admission import admission_room
from nexus_vllm.core.budget import (
    bound_blocks,
    evicts_mid_prompt,
    peak_from,
    window_blocks,
    window_in_flight_tokens,
)

from .groups import window_held_blocks, window_max_blocks

__all__ = ["OUTPUT_PER_PROMPT", "SimResult", "simulate_burst", "split_context",
           "stock_admission_blocks", "stock_bound_blocks", "window_allowance"]

# The capacity benchmark's request shape (benchmarks/serving/capacity.py defaults): an
# output of 1/64 of the prompt (2048 + 32), and --max-model-len one block past them.
OUTPUT_PER_PROMPT = 64


def stock_admission_blocks(prompt_tokens: int, block_size: int, *, full_groups: int = 1,
                           windows: Sequence[int] = (), in_flight_tokens: int = 0,
                           max_model_len: int | None = None) -> int:
    """Free blocks stock vLLM 0.32 needs to admit a request (``scheduler_reserve_full_isl``,
    on by default): its whole prompt in each of the ``full_groups`` full-attention groups,
    and in each sliding group of window ``windows[i]`` no more than the window plus
    ``in_flight_tokens`` (:func:`.groups.window_max_blocks`, vLLM's admission cap)."""
    blocks = cdiv(prompt_tokens, block_size)
    return full_groups * blocks + sum(
        min(blocks, window_max_blocks(w, block_size, in_flight_tokens, max_model_len))
        for w in windows)


def stock_bound_blocks(total_tokens: int, block_size: int, *, full_groups: int = 1,
                       windows: Sequence[int] = (), step_tokens: int = 0,
                       steps_in_flight: int = 1) -> int:
    """Most blocks a stock vLLM request holds: its whole sequence in each full-attention
    group, and in each sliding group its window plus ``steps_in_flight`` steps of
    ``step_tokens`` (:func:`window_allowance` of a request yet to start)."""
    return full_groups * cdiv(total_tokens, block_size) + window_allowance(
        total_tokens, block_size, windows, step_tokens, steps_in_flight)


def window_allowance(total_tokens: int, block_size: int, windows: Sequence[int],
                     step_tokens: int, steps_in_flight: int = 1, *, tokens: int = 0,
                     prefill_end: int | None = None,
                     cfg: EvictionConfig | None = None) -> int:
    """Blocks a request of ``total_tokens`` may still hold across sliding groups of windows
    ``windows`` once ``tokens`` are computed, ``prefill_end`` being its prompt (None: it
    has not started): in each, the window plus the tokens in flight, ``steps_in_flight``
    steps of ``step_tokens`` while it computes its prompt (of at most ``cfg.chunk_size``
    where the server's config ``cfg`` evicts mid-prompt: the plugin caps each prompt step
    there) and ``steps_in_flight`` tokens once it decodes, never more than its sequence.
    ``cfg`` None: stock vLLM. The plugin's admission reserves the same
    (``WindowBlocks.allowance``: both are :func:`nexus_vllm.core.budget.window_blocks` of
    :func:`nexus_vllm.core.budget.window_in_flight_tokens`)."""
    in_flight = window_in_flight_tokens(step_tokens, steps_in_flight, tokens=tokens,
                                        prefill_end=prefill_end, server_cfg=cfg)
    return sum(window_blocks(w, block_size, total_tokens, in_flight) for w in windows)


def split_context(context: int, block_size: int) -> tuple[int, int]:
    """``(prompt, output)`` tokens filling ``context`` (vLLM's ``--max-model-len``) as the
    capacity benchmark does: prompt + output + one block = context, output = prompt / 64
    (rounded down; 2048 + 32 for its 2112)."""
    tokens = context - block_size
    output = max(1, tokens // (OUTPUT_PER_PROMPT + 1))
    return tokens - output, output


@dataclass
class _Request:
    computed: int = 0      # tokens whose KV is computed
    outputs: int = 0       # tokens sampled
    blocks: int = 0        # blocks held, all groups (stock only: evicting hold <= reserve)
    tokens_seen: int = 0   # the plugin's st.tokens: computed tokens as of the last plan


@dataclass(frozen=True)
class SimResult:
    """The outcome of :func:`simulate_burst`.

    Attributes
    ----------
    peak_running : int
        Most requests running at once.
    preempted : bool
        Whether a running request ran out of blocks (stock vLLM only; admission by the
        bound never lets an evicting request run out).
    steps : int
        Engine steps simulated.
    """

    peak_running: int
    preempted: bool
    steps: int


def simulate_burst(cfg: EvictionConfig | None, *, usable_blocks: int, block_size: int,
                   prompt_tokens: int, output_tokens: int, requests: int, max_num_seqs: int,
                   max_num_batched_tokens: int | None = None, full_groups: int = 1,
                   windows: Sequence[int] = (), steps_in_flight: int = 1,
                   in_flight_tokens: int | None = None,
                   max_model_len: int | None = None) -> SimResult:
    """``requests`` identical requests arrive at once; run the scheduler's admission until
    no request waits (stock vLLM: until all finish, since it may preempt later).

    Each step, as vLLM 0.32's scheduler with the plugin: running requests first (a prompt
    chunk, or one decode token), then waiting ones in arrival order while the token
    budget and ``max_num_seqs`` allow, stopping at the first one refused. Evicting
    (``cfg`` given): admitted only if the usable blocks, less each running request's
    :func:`~nexus_vllm.core.budget.peak_from` its progress, cover
    :func:`~nexus_vllm.core.budget.bound_blocks` (``AdmissionGate.may_admit``). Stock
    (``cfg`` None): admitted only if the free blocks cover its whole prompt; a running
    request that finds no free block is a preemption. ``max_num_batched_tokens`` None: no
    token budget a step (the pool alone limits).

    A hybrid model has ``full_groups`` full-attention groups and one sliding group per
    entry of ``windows`` (each its window in tokens). Evicting: each bound and reserve adds
    :func:`window_allowance` for the request's progress (``steps_in_flight`` steps of
    ``max_num_batched_tokens``, or of the prompt without a budget, each capped at
    ``chunk_size`` where ``cfg`` evicts mid-prompt, until
    ``steps_in_flight`` decode steps follow its prompt; then ``steps_in_flight`` tokens),
    as the plugin's admission does. Stock: admission needs
    :func:`stock_admission_blocks` with ``in_flight_tokens`` (vLLM's
    ``max_in_flight_tokens``; None: ``steps_in_flight`` steps) and ``max_model_len``; a
    running request first frees what left its windows (:func:`.groups.window_held_blocks`).
    """
    step_tokens = max_num_batched_tokens or prompt_tokens
    # The plugin caps a request's prompt chunk where events fire mid-prompt; otherwise
    # vLLM's step budget alone does (engine_policy.forced_engine_args).
    chunk = cfg.chunk_size if cfg is not None and evicts_mid_prompt(cfg) else prompt_tokens
    burst = _Burst(cfg, usable_blocks, block_size, prompt_tokens, output_tokens, requests,
                   max_num_seqs, max_num_batched_tokens, full_groups, windows,
                   max(1, steps_in_flight), step_tokens, chunk)
    burst.bound = (bound_blocks(cfg, prompt_tokens, burst.total) + burst.allowance()
                   if cfg is not None else stock_admission_blocks(
                       prompt_tokens, block_size, full_groups=full_groups, windows=windows,
                       in_flight_tokens=burst.k * step_tokens if in_flight_tokens is None
                       else in_flight_tokens, max_model_len=max_model_len))
    waiting: deque[_Request] = deque(_Request() for _ in range(requests))
    running: list[_Request] = []
    peak, steps = 0, 0
    while waiting or running:
        if cfg is not None and not waiting:
            break  # admission never fails a running evicting request: the peak is in
        steps += 1
        budget = max_num_batched_tokens or requests * prompt_tokens  # None: no step limit
        free = usable_blocks - sum(r.blocks for r in running)
        scheduled, budget, free = burst.schedule_running(running, budget, free)
        if scheduled is None:
            return SimResult(peak, True, steps)
        admitted = burst.admit(waiting, running, scheduled, budget, free)
        peak = max(peak, len(running))
        if not scheduled:
            break  # nothing runs and the first waiting request can never fit
        pure_decode = not admitted and len(scheduled) == len(running) \
            and all(n == 1 for _, n in scheduled)
        for r, n in scheduled:
            r.computed += n
            r.tokens_seen = r.computed
            if r.computed >= prompt_tokens:
                r.outputs += 1
        running = [r for r in running if r.outputs < output_tokens]
        if pure_decode and running:
            skip, overflows = burst.skip_decode(running, bool(waiting))
            if overflows:
                return SimResult(peak, True, steps + skip)
            steps += max(0, skip)
    return SimResult(peak, False, steps)


@dataclass
class _Burst:
    """What every step of one :func:`simulate_burst` run reads: its arguments, the
    admission bound of a new request (``bound``) and the rules built on them."""

    cfg: EvictionConfig | None
    usable_blocks: int
    bs: int
    prompt_tokens: int
    output_tokens: int
    requests: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    full_groups: int
    windows: Sequence[int]
    k: int
    step_tokens: int
    chunk: int
    bound: int = 0
    window_counts: Counter[int] = field(init=False)

    def __post_init__(self) -> None:
        self.window_counts = Counter(self.windows)

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def allowance(self, tokens_seen: int | None = None) -> int:
        """The window groups' reserve (:func:`window_allowance`; None: a new request)."""
        return window_allowance(self.total, self.bs, self.windows, self.step_tokens, self.k,
                                tokens=tokens_seen or 0,
                                prefill_end=None if tokens_seen is None
                                else self.prompt_tokens, cfg=self.cfg)

    def held(self, done: int, allocated: int) -> int:
        """Blocks a stock request holds in all groups with ``allocated`` slots once
        its windows have moved past ``done`` computed tokens."""
        return self.full_groups * cdiv(allocated, self.bs) + sum(
            count * window_held_blocks(w, self.bs, done, allocated)
            for w, count in self.window_counts.items())

    def reserve(self, r: _Request) -> int:
        assert self.cfg is not None
        return peak_from(self.cfg, r.tokens_seen, self.prompt_tokens, self.total) \
            + self.allowance(r.tokens_seen)

    def schedule_running(self, running: list[_Request], budget: int, free: int
                         ) -> tuple[list[tuple[_Request, int]] | None, int, int]:
        """The running requests' tokens this step (a prompt chunk or one decode token)
        while the token ``budget`` lasts, the budget and free blocks left; None
        scheduled: a stock request found no free block (a preemption)."""
        scheduled: list[tuple[_Request, int]] = []
        for r in running:
            if budget <= 0:
                break
            n = min(self.prompt_tokens - r.computed, self.chunk, budget) \
                if r.computed < self.prompt_tokens else 1
            if self.cfg is None:
                now = self.held(r.computed, r.computed + n)
                if now - r.blocks > free:
                    return None, budget, free
                free -= now - r.blocks
                r.blocks = now
            budget -= n
            scheduled.append((r, n))
        return scheduled, budget, free

    def admit(self, waiting: deque[_Request], running: list[_Request],
              scheduled: list[tuple[_Request, int]], budget: int, free: int) -> bool:
        """Start waiting requests in arrival order while the budget, ``max_num_seqs`` and
        the pool allow (appended to ``running`` and ``scheduled``); whether any started."""
        admitted = False
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            # Evicting requests' held blocks are within their reserve: the room is the
            # pool less every reserve (the plugin's rule, core.admission).
            room = admission_room(self.usable_blocks,
                                  ((self.reserve(r), 0) for r in running)) \
                if self.cfg is not None else free
            if room < self.bound:
                break
            r = waiting.popleft()
            n = min(self.prompt_tokens, self.chunk, budget)
            if self.cfg is None:
                r.blocks = self.held(0, n)
                free -= r.blocks
            running.append(r)
            budget -= n
            scheduled.append((r, n))
            admitted = True
        return admitted

    def skip_decode(self, running: list[_Request], waiting: bool) -> tuple[int, bool]:
        """After a pure-decode step that admitted nobody: nothing changes admission until
        the next request finishes, so jump there (stock: its growth is checked on the way,
        and a sliding group's freed blocks may let a waiting request in sooner).
        ``(steps skipped, whether a stock request overflowed at the last of them)``; the
        requests are advanced unless it overflowed."""
        skip = min(self.output_tokens - r.outputs for r in running) - 1
        if self.windows and self.cfg is not None:
            # Nor past a window reserve's drop to the decode tokens in flight (at
            # prompt + k tokens: none if it dropped this step).
            skip = min([skip, *(self.prompt_tokens + self.k - r.tokens_seen for r in running
                                if r.tokens_seen <= self.prompt_tokens + self.k)])
        if skip > 0 and self.cfg is None:
            may_admit = waiting and len(running) < self.max_num_seqs and len(running) \
                < (self.max_num_batched_tokens or self.requests * self.prompt_tokens)
            skip, overflows = _stock_decode_skip(
                running, skip, self.usable_blocks, self.held, list(self.window_counts),
                self.bs, self.bound if may_admit else None)
            if overflows:
                return skip, True
        if skip > 0:
            for r in running:
                r.computed += skip
                r.tokens_seen = r.computed
                r.outputs += skip
                if self.cfg is None:
                    r.blocks = self.held(r.computed - 1, r.computed)
        return skip, False


def _stock_decode_skip(running: Sequence[_Request], skip: int, usable_blocks: int,
                       held: Callable[[int, int], int], windows: Sequence[int],
                       block_size: int, admit_need: int | None) -> tuple[int, bool]:
    """How far the stock requests ``running`` may jump through ``skip`` pure-decode steps:
    ``(step, True)`` at the first step they hold more than ``usable_blocks``; else
    ``(steps, False)``, all of them, or those before the first step whose free blocks
    cover ``admit_need`` (None: no request may be admitted before one finishes).

    Full-attention groups only grow, so without sliding groups their last step is their
    most and the free blocks never grow. A sliding group frees a block whenever its window
    passes one, so the held blocks are counted at each step where a request's allocation
    or window crosses a block boundary (the only steps where they change).
    """
    if not windows:
        last = sum(max(r.blocks, held(r.computed + skip - 1, r.computed + skip))
                   for r in running)
        return skip, last > usable_blocks
    changes: dict[int, int] = {}
    for r in running:
        c = r.computed
        steps = set(range((1 - c) % block_size or block_size, skip + 1, block_size))
        for w in windows:
            steps.update(range((w - c) % block_size or block_size, skip + 1, block_size))
        before = r.blocks
        for step in sorted(steps):
            now = held(c + step - 1, c + step)
            if now != before:
                changes[step] = changes.get(step, 0) + now - before
                before = now
    total = sum(r.blocks for r in running)
    for step in sorted({1, *changes}):  # the first step, then where the count changes
        total += changes.get(step, 0)
        if total > usable_blocks:
            return step, True
        if admit_need is not None and usable_blocks - total >= admit_need:
            return step - 1, False
    return skip, False
