"""The worker's scores turned into evictions: each scored request's policy, then null + free.

Run on the reply that acknowledges the plan the scores were asked for. Only full,
computed blocks are evicted; the policy always keeps the sink blocks (in ``prompt_mode``
``keep``, every prompt block) and the newest ``recent_blocks + 1`` live blocks
(``ScoreRequest.evictable_below``). Freeing at once is safe because the worker learns
every null before it can read a reused block: the next plan carries it
(:class:`~nexus_vllm.integration.scheduler.plan_channel.PlanChannel`), and with ``k``
steps in flight the steps scheduled before that plan only read the block (workers, and
each pipeline stage, run steps in order; a freed block is written only by a step
scheduled after the free, whose plan carries the null).

An event's counts are its plan's (``ScoreRequest.tokens_after``), not vLLM's when the
reply arrives; a request preempted since its plan (``ScoreRequest.epoch``) lost the block
list the evidence describes, and the event is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from nexus_vllm.core.budget import target_blocks
from nexus_vllm.core.evidence import Evidence
from nexus_vllm.integration.compat.vllm_compat import preemption_count
from nexus_vllm.integration.compat.vllm_types import EngineRequest
from nexus_vllm.integration.metrics import SchedulerCounters
from nexus_vllm.integration.protocol import ScoreRequest, StepPlan, WorkerReply
from nexus_vllm.integration.scheduler.live_blocks import LiveBlocks
from nexus_vllm.integration.scheduler.plan_channel import PlanChannel
from nexus_vllm.integration.scheduler.prefix_cache import mark_first_eviction
from nexus_vllm.integration.scheduler.request_state import RequestEvictionState, RequestStates

__all__ = ["Evictor"]


class Evictor:
    """Runs each scored request's policy on the worker's evidence and evicts the blocks
    it drops.

    Parameters
    ----------
    states : RequestStates
    blocks : LiveBlocks
    channel : PlanChannel
        Records each null, to be sent with the next plan.
    counters : SchedulerCounters
    fault : callable
        ``(kind, message, exc=...)``: count and log a fault.
    """

    def __init__(self, *, states: RequestStates, blocks: LiveBlocks, channel: PlanChannel,
                 counters: SchedulerCounters, fault: Callable[..., None]) -> None:
        self.states = states
        self.blocks = blocks
        self.channel = channel
        self.counters = counters
        self._fault = fault

    def apply(self, plan: StepPlan, reply: WorkerReply,
              requests: Mapping[str, EngineRequest]) -> None:
        """Run the policy of every request ``plan`` scored, on ``reply``'s evidence (a
        reply that acknowledges ``plan``). A request whose evidence the worker dropped
        is skipped (a fault the worker counted)."""
        for req_id, sreq in plan.score.items():
            request = requests.get(req_id)
            st = self.states.get(req_id)
            if request is None or st is None:
                continue
            if preemption_count(request) != sreq.epoch:
                self._fault("scores_preempted", "a request was preempted between its "
                            "eviction plan and the reply; the event is dropped")
                continue
            found = {kind: reply.evidence.get(kind, {}).get(req_id) for kind in sreq.kinds}
            if any(values is None for values in found.values()):
                continue  # dropped by the worker (a fault it counted)
            gathered = {kind: torch.from_numpy(values) for kind, values in found.items()
                        if values is not None}
            try:
                self.evict(st, request, sreq, gathered)
            except Exception:
                # A policy error skips this event: nothing was freed (freeing is the
                # last step of evict), so the worker's view stays consistent.
                self._fault("policy_error", "eviction policy failed; skipping this event",
                            exc=True)

    def evict(self, st: RequestEvictionState, request: EngineRequest, sreq: ScoreRequest,
              gathered: Mapping[str, torch.Tensor]) -> None:
        """One eviction event: the policy keeps ``target_blocks`` of the request's live
        blocks; the others that are full and below ``sreq.evictable_below`` are nulled
        and freed.

        Parameters
        ----------
        gathered : mapping of evidence kind to Tensor
            What the worker gathered for ``sreq.kinds`` over the live blocks among the
            first ``sreq.num_logical_blocks`` (``mass``: ``[rows, live blocks]``,
            combined over heads and layers by the config's ``attention_reduce``; a blocks kind:
            ``[live blocks]``); empty for a policy that reads nothing.
        """
        live = self.blocks.live_indices(st, sreq.num_logical_blocks)
        if any(int(v.shape[-1]) != len(live) for v in gathered.values()):
            self._fault("stale_scores", "scores do not match the request's live blocks; "
                        "skipping this event")
            return
        evidence = Evidence.from_gathered(gathered, attention_reduce=st.cfg.attention_reduce,
                                          num_blocks=len(live))
        tokens = int(sreq.tokens_after)
        budget = int(target_blocks(st.cfg, tokens, st.prompt_tokens))
        if len(live) <= budget:
            return
        policy = st.policies.at(prefill=sreq.prefill, prompt_end=sreq.prompt_end)
        keep = policy.select(evidence, budget, generator=st.generator,
                             state=st.policy_state)
        keep_set = {int(i) for i in keep.tolist()}
        full_blocks = tokens // self.blocks.block_size
        evict = [live[j] for j in range(len(live))
                 if j not in keep_set and live[j] < min(full_blocks, sreq.evictable_below)]
        if not evict:
            return
        mark_first_eviction(st, tokens)
        self.channel.record(st, evict)
        self.blocks.evict(st, evict)
        self.counters.evicted_blocks += len(evict)
        self.counters.eviction_events += 1
