"""A burst of identical requests through the server's admission, step by step.

Concurrent requests come from the rules the server runs, not a formula of their own:
:meth:`EvictionConfig.bound_blocks` (what admission reserves for a new request) and
:meth:`EvictionConfig.peak_from` (what an admitted one may still grow to), applied step by
step as the plugin's admission (``AdmissionGate.may_admit`` in
``integration/scheduler/admission.py``, both through :mod:`nexus_vllm.core.admission`)
applies them to a burst of identical requests arriving at once (the capacity benchmark's
workload). The reserve of a running request shrinks as it progresses: an ``end`` request
past its prompt keeps only its decode hard limit, so a burst runs more of them than
``pool // bound``. Stock vLLM 0.32 admits a request when its whole prompt fits in the free
blocks (``scheduler_reserve_full_isl``) and keeps no other reserve (its ``--watermark``
defaults to 0, and so does this plan); it preempts when decode runs out of blocks. Each
request prefills at most ``chunk_size`` tokens a step when its prompt mode evicts during
the prompt (the plugin sets vLLM's ``long_prefill_token_threshold``) and at most the
step's token budget (``--max-num-batched-tokens``) otherwise, as on stock vLLM; decode
adds one token a step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nexus_vllm.core import EvictionConfig, cdiv
from nexus_vllm.core.admission import admission_room

__all__ = ["OUTPUT_PER_PROMPT", "SimResult", "simulate_burst", "split_context",
           "stock_admission_blocks", "stock_bound_blocks"]

# The capacity benchmark's request shape (benchmarks/serving/capacity.py defaults): an
# output of 1/64 of the prompt (2048 + 32), and --max-model-len one block past them.
OUTPUT_PER_PROMPT = 64


def stock_admission_blocks(prompt_tokens: int, block_size: int) -> int:
    """Free blocks stock vLLM 0.32 needs to admit a request: its whole prompt
    (``scheduler_reserve_full_isl``, on by default)."""
    return cdiv(prompt_tokens, block_size)


def stock_bound_blocks(total_tokens: int, block_size: int) -> int:
    """Blocks a stock vLLM request holds at its end: its whole sequence."""
    return cdiv(total_tokens, block_size)


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
    blocks: int = 0        # blocks held (stock only: evicting requests hold <= reserve)
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
                   max_num_batched_tokens: int | None = None) -> SimResult:
    """``requests`` identical requests arrive at once; run the scheduler's admission until
    no request waits (stock vLLM: until all finish, since it may preempt later).

    Each step, as vLLM 0.32's scheduler with the plugin: running requests first (a prompt
    chunk, or one decode token), then waiting ones in arrival order while the token
    budget and ``max_num_seqs`` allow, stopping at the first one refused. Evicting
    (``cfg`` given): admitted only if the usable blocks, less each running request's
    :meth:`EvictionConfig.peak_from` its progress, cover :meth:`EvictionConfig.bound_blocks`
    (``AdmissionGate.may_admit``). Stock (``cfg`` None): admitted only if the free
    blocks cover its whole prompt; a running request that finds no free block is a
    preemption. ``max_num_batched_tokens`` None: no token budget a step (the pool alone
    limits).
    """
    total = prompt_tokens + output_tokens
    # The plugin caps a request's prompt chunk where events fire mid-prompt; otherwise
    # vLLM's step budget alone does (engine_policy.forced_engine_args).
    chunk = cfg.chunk_size if cfg is not None and cfg.evicts_mid_prompt else prompt_tokens
    bound = (cfg.bound_blocks(prompt_tokens, total) if cfg is not None
             else stock_admission_blocks(prompt_tokens, block_size))
    waiting: deque[_Request] = deque(_Request() for _ in range(requests))
    running: list[_Request] = []
    peak, steps = 0, 0

    def reserve(r: _Request) -> int:
        assert cfg is not None
        return cfg.peak_from(r.tokens_seen, prompt_tokens, total)

    while waiting or running:
        if cfg is not None and not waiting:
            break  # admission never fails a running evicting request: the peak is in
        steps += 1
        budget = max_num_batched_tokens or requests * prompt_tokens  # None: no step limit
        scheduled: list[tuple[_Request, int]] = []
        free = usable_blocks - sum(r.blocks for r in running)
        for r in running:
            if budget <= 0:
                break
            n = min(prompt_tokens - r.computed, chunk, budget) if r.computed < prompt_tokens \
                else 1
            if cfg is None:
                need = cdiv(r.computed + n, block_size) - r.blocks
                if need > free:
                    return SimResult(peak, True, steps)
                free -= need
                r.blocks += need
            budget -= n
            scheduled.append((r, n))
        admitted = False
        while waiting and budget > 0 and len(running) < max_num_seqs:
            # Evicting requests' held blocks are within their reserve: the room is the
            # pool less every reserve (the plugin's rule, core.admission).
            room = admission_room(usable_blocks, ((reserve(r), 0) for r in running)) \
                if cfg is not None else free
            if room < bound:
                break
            r = waiting.popleft()
            n = min(prompt_tokens, chunk, budget)
            if cfg is None:
                r.blocks = cdiv(n, block_size)
                free -= r.blocks
            running.append(r)
            budget -= n
            scheduled.append((r, n))
            admitted = True
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
            # Pure decode and nobody admitted: nothing changes admission until the next
            # request finishes, so jump there (stock: its growth is checked at the end).
            skip = min(output_tokens - r.outputs for r in running) - 1
            if skip > 0:
                steps += skip
                for r in running:
                    r.computed += skip
                    r.tokens_seen = r.computed
                    r.outputs += skip
                if cfg is None:
                    for r in running:
                        r.blocks = max(r.blocks, cdiv(r.computed, block_size))
                    if sum(r.blocks for r in running) > usable_blocks:
                        return SimResult(peak, True, steps)
    return SimResult(peak, False, steps)
