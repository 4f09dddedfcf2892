"""k steps in flight: the scheduler and worker sides in vLLM's batch-queue order.

A fake engine loop drives the real ``EvictionManager`` (over vLLM's real block pool and
full-attention manager) and the real ``WorkerEvictionState`` (over ``fakes.FakeRunner``)
in the order of vLLM's ``EngineCore.step_with_batch_queue``: it schedules step N+1 (and
up to N+k-1) before it hands step N's output to the scheduler. Its running loop is
vLLM's where eviction meets it: a request is skipped while ``current_step <
next_decode_eligible_step``; a prefill chunk is scheduled whatever is in flight; a
decoding request is scheduled again only once its last token is back (``pp``: pipeline
parallelism without async scheduling) or at once, on a placeholder (``async``). The worker
runs each step when it is scheduled (workers run steps in order), and every block a
row's attention reads must then belong to that row's request.

What must hold for k = 1, 2 and 4: the same events, the same evicted blocks and the same
per-request peaks as with one step in flight, each peak equal to
``budget.bound_blocks``; every plan acknowledged; every block back at the end.
With lost and repeated plans: no read of a freed block (the masking covers the last k
applied plans) and no block lost. A request preempted between its event's plan and the
reply: the reply is dropped and its new block list is left alone.
"""

from __future__ import annotations

import random
import zlib
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from nexus_vllm.core import evidence_kind
from nexus_vllm.integration.protocol import attach_plan, read_plan
from tests.integration.conftest import HAS_VLLM
from tests.integration.fakes import (
    BS,
    FakeRunner,
    common_metadata,
    engine_request,
    make_state,
    scheduler_side,
)

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

STEPS_IN_FLIGHT = [1, 2, 4]
MODES = ["pp", "async"]
CHUNK = 128
# (prompt tokens, answer tokens): a long prompt streamed over its budget (its peak is a
# prefill chunk over the budget), a short prompt with a long answer (its peak is the
# decode limit), and one that never reaches its budget.
WORKLOAD = {"long": (700, 40), "chatty": (100, 400), "small": (150, 20)}


@dataclass
class _Queued:
    """A scheduled step in the batch queue."""

    output: SimpleNamespace
    plan: Any  # the plan made for it (what the scheduler pairs the reply with)
    reply: Any
    sampled: dict[str, int]  # request -> its preemption count, for requests that sample


@dataclass
class FakeEngine:
    """vLLM's engine core, reduced to what eviction meets (see the module docstring).

    Parameters
    ----------
    k : int
        The batch queue's size (vLLM's ``max_concurrent_batches``).
    mode : {"pp", "async"}
    worker_k : int, optional
        The worker's ``steps_in_flight`` (default ``k``; a wrong one shows what the
        masking needs).
    deliver : callable, optional
        ``(step number, plan, previous plan) -> plan the worker gets`` (lost or repeated
        plans).
    """

    k: int
    mode: str
    worker_k: int | None = None
    deliver: Any = None
    num_blocks: int = 400
    flags: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        flags = {"max_tokens": 256, "chunk_size": CHUNK, **self.flags}
        self.mgr, self.single, self.pool = scheduler_side(self.num_blocks, **flags)
        self.free_at_start = self.pool.get_num_free_blocks()
        self.runner = FakeRunner({}, max_blocks=64, max_rows=8)
        self.state = make_state(self.runner, max_requests=8,
                                steps_in_flight=self.worker_k or self.k)
        self.requests: dict[str, SimpleNamespace] = {}
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.finished: set[str] = set()  # finished since the last schedule
        self.seen: set[str] = set()
        self.queue: deque[_Queued] = deque()
        self.current_step = 0
        self.steps = 0
        self.previous_plan: Any = None
        self.peaks: dict[str, int] = {}
        self.bounds: dict[str, int] = {}
        self.events: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
        self.held_steps = 0
        self._record_events()

    # -- requests ----------------------------------------------------------------------
    def add(self, req_id: str, prompt: int, answer: int) -> SimpleNamespace:
        req = engine_request(req_id, prompt, max_tokens=answer)
        req.sampled = req.returned = req.sampling = 0
        self.requests[req_id] = req
        self.waiting.append(req_id)
        return req

    def preempt(self, req_id: str) -> None:
        """vLLM's ``_preempt_request``: blocks freed, progress reset, counted; back to the
        waiting queue (its hold, if any, stays on the request)."""
        req = self.requests[req_id]
        self.single.free(req_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.sampled = req.returned
        req.sampling = 0
        self.running.remove(req_id)
        self.waiting.insert(0, req_id)

    def has_requests(self) -> bool:
        return bool(self.running or self.waiting)

    # -- one engine step, in step_with_batch_queue's order ------------------------------
    def engine_step(self) -> None:
        if self.has_requests():
            entry = self.schedule()
            self.queue.appendleft(entry)
            executed = bool(entry.output.num_scheduled_tokens)
            if len(self.queue) < self.k and (executed or self.has_requests()):
                return
        elif not self.queue:
            return
        self.update(self.queue.pop())

    def run(self, max_steps: int = 5000) -> None:
        while self.has_requests() or self.queue:
            self.engine_step()
            assert self.steps < max_steps, "the engine made no progress"

    def schedule(self) -> _Queued:
        self.current_step += 1
        self.steps += 1
        sched: dict[str, int] = {}
        sampled: dict[str, int] = {}
        new: list[str] = []
        resumed: set[str] = set()
        # vLLM's running loop first: it skips a held request.
        for req_id in self.running:
            req = self.requests[req_id]
            if self.current_step < req.next_decode_eligible_step:
                self.held_steps += 1
                continue
            self._schedule(req, sched, sampled)
        # Then the waiting queue (room for every request: admission is not tested here),
        # which reads no hold: a resumed request restarts from a fresh block list.
        while self.waiting:
            req_id = self.waiting.pop(0)
            self.running.append(req_id)
            (resumed.add if req_id in self.seen else new.append)(req_id)
            self.seen.add(req_id)
            req = self.requests[req_id]
            self.bounds.setdefault(req_id, int(self.mgr.bound_blocks(req)))
            self._schedule(req, sched, sampled)
        output = SimpleNamespace(
            finished_req_ids=set(self.finished), num_scheduled_tokens=sched,
            scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
            scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=resumed))
        self.finished.clear()
        plan = self.mgr.plan_step(output, self.requests)
        sent = plan if self.deliver is None else self.deliver(self.steps, plan,
                                                              self.previous_plan)
        self.previous_plan = plan
        if sent is not None:  # NexusScheduler.schedule's graft, stamped with the step
            attach_plan(output, sent, step_id=plan.step_id)
        reply = self.execute(output, read_plan(output), plan)
        return _Queued(output, plan, reply, sampled)

    def _schedule(self, req: SimpleNamespace, sched: dict[str, int],
                  sampled: dict[str, int]) -> None:
        """A prefill chunk, or one decode token, for the request (if it has any due)."""
        left = req.num_prompt_tokens - req.num_computed_tokens
        if left > 0:
            n = min(CHUNK, left)
        elif req.sampled >= req.max_tokens or (self.mode == "pp" and req.sampling):
            return
        else:
            n = 1
        total = req.num_computed_tokens + n
        self.single.allocate_new_blocks(req.request_id, total, total)
        req.num_computed_tokens = total
        if total >= req.num_prompt_tokens:  # the step samples a token
            req.sampled += 1
            req.sampling += 1
            sampled[req.request_id] = req.num_preemptions
        sched[req.request_id] = n

    def update(self, entry: _Queued) -> None:
        """vLLM's ``update_from_output``: our reply first, then the sampled tokens."""
        self.mgr.apply_reply(entry.plan, entry.reply, self.requests)
        for req_id, epoch in entry.sampled.items():
            req = self.requests.get(req_id)
            if req is None or req.num_preemptions != epoch:
                continue  # preempted since: a stale token
            req.sampling -= 1
            req.returned += 1
            if req.returned >= req.max_tokens:
                st = self.mgr.states.get(req_id)
                assert st is not None
                self.peaks[req_id] = st.peak_live_blocks
                self.single.free(req_id)
                self.running.remove(req_id)
                self.finished.add(req_id)

    # -- the worker ----------------------------------------------------------------------
    def execute(self, output: SimpleNamespace, sent: Any, plan: Any) -> Any:
        """The worker's step (run when scheduled: workers run steps in order)."""
        from nexus_vllm.integration.protocol import WorkerReply

        self._sync_rows(output)
        state = self.state
        step = state.begin_step(output, sent)
        rows = list(output.num_scheduled_tokens)
        if rows:
            seq = [self.requests[r].num_computed_tokens for r in rows]
            cm = state.compactor.compact(common_metadata(
                self.runner, seq, [output.num_scheduled_tokens[r] for r in rows]))
            self._check_reads(cm, rows, seq)
        # Not scored here (the scores are made up below): the reply's acknowledgement
        # and faults, as NexusWorker takes them after sampling.
        reply = state.reply_token(step, None).reply()
        state.end_step(step)
        if reply.step_id is None:
            return reply
        evidence: dict[str, dict[str, np.ndarray]] = {}
        for r, sreq in plan.score.items():
            rows = self._masses(r, sreq)
            for kind in sreq.kinds:
                # A rows kind gets the rows; a blocks kind one of them (positive values).
                values = rows if evidence_kind(kind).layout == "rows" else rows[0].copy()
                evidence.setdefault(kind, {})[r] = values
        return WorkerReply(step_id=reply.step_id, evidence=evidence, faults=reply.faults)

    def _masses(self, req_id: str, sreq: Any) -> np.ndarray:
        """Scores that depend only on the request, the block and the request's progress
        (so every k sees the same), over the live blocks of the worker's own view."""
        req = self.state.requests.get(req_id)
        done = set() if req is None else req.evicted
        live = [j for j in range(sreq.num_logical_blocks) if j not in done]
        weights = np.array([1.0 + zlib.crc32(f"{req_id}:{j}:{sreq.tokens_after}".encode())
                            % 997 for j in live], dtype=np.float32)
        row = weights / weights.sum()
        return np.repeat(row[None, :], sreq.window, axis=0)

    def _sync_rows(self, output: SimpleNamespace) -> None:
        """vLLM's runner: rows of this step's requests, new block ids appended (a
        resumed request's list anew), finished requests dropped."""
        batch = self.runner.input_batch
        for req_id in output.finished_req_ids:
            self.runner.requests.pop(req_id, None)
        for req_id in output.scheduled_cached_reqs.resumed_req_ids:
            self.runner.requests.pop(req_id, None)
        batch.req_ids = list(output.num_scheduled_tokens)
        batch.req_id_to_index = {r: i for i, r in enumerate(batch.req_ids)}
        batch.num_reqs = len(batch.req_ids)
        table = self.runner.table
        table[:] = 0
        for req_id in batch.req_ids:
            blocks = self.single.req_to_blocks[req_id]
            ids = self.runner.requests.setdefault(
                req_id, SimpleNamespace(block_ids=[[]])).block_ids[0]
            ids.extend(b.block_id for b in blocks[len(ids):])
            table[batch.req_id_to_index[req_id], : len(ids)] = ids

    def _check_reads(self, cm: Any, rows: list[str], seq: list[int]) -> None:
        """Every block a row's attention reads belongs to that request right now."""
        for i, req_id in enumerate(rows):
            n = -(-int(cm.seq_lens[i]) // BS)
            owned = {b.block_id for b in self.single.req_to_blocks[req_id] if not b.is_null}
            read = set(cm.block_table_tensor[i, :n].tolist())
            assert read <= owned, (req_id, sorted(read - owned))
            assert int(cm.seq_lens[i]) <= seq[i]

    def _record_events(self) -> None:
        """Each eviction: (the event's computed tokens, the logical blocks evicted)."""
        evictor, blocks = self.mgr.evictor, self.mgr.blocks
        evict_one, null_and_free = evictor.evict, blocks.evict
        current: list[int] = []

        def evict(st: Any, request: Any, sreq: Any, *args: Any) -> None:
            current[:] = [sreq.tokens_after]
            evict_one(st, request, sreq, *args)

        def null(st: Any, indices: Any) -> None:
            self.events.setdefault(st.req_id, []).append((current[0], tuple(indices)))
            null_and_free(st, indices)

        evictor.evict = evict
        blocks.evict = null

    # -- after the run -------------------------------------------------------------------
    def assert_clean_end(self) -> None:
        mgr = self.mgr
        assert mgr.channel.outstanding() == 0 and mgr.channel.unacked == {}
        assert self.pool.get_num_free_blocks() == self.free_at_start  # every block back
        assert all(st.event_in_flight is None for _, st in mgr.states.items())


def _run(k: int, mode: str, workload: dict[str, tuple[int, int]] | None = None,
         **kwargs: Any) -> FakeEngine:
    engine = FakeEngine(k, mode, **kwargs)
    for req_id, (prompt, answer) in (workload or WORKLOAD).items():
        engine.add(req_id, prompt, answer)
    engine.run()
    return engine


@pytest.fixture(scope="module")
def one_step_in_flight() -> FakeEngine:
    return _run(1, "pp")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", STEPS_IN_FLIGHT)
def test_k_steps_in_flight_evict_as_one_and_peak_at_the_bound(
        k: int, mode: str, one_step_in_flight: FakeEngine) -> None:
    engine = _run(k, mode)
    ref = one_step_in_flight
    assert dict(engine.mgr.counters.faults) == {}  # every plan acknowledged, nothing stale
    assert engine.events == ref.events and engine.events["long"] and engine.events["chatty"]
    assert "small" not in engine.events
    # Exact bounds: the long prompt peaks a chunk over its budget, the chatty answer one
    # block over it, both exactly budget.bound_blocks; the small one holds all.
    assert engine.peaks == ref.peaks == engine.bounds == {"long": 12, "chatty": 9,
                                                          "small": 6}
    assert engine.mgr.counters.over_budget_peak <= 0
    engine.assert_clean_end()
    # The price of k: a request waits out its event's reply (held from vLLM's schedule).
    if k == 1:
        assert engine.held_steps == 0
    else:
        assert engine.held_steps > 0


def test_plans_are_paired_with_their_own_replies_and_retired_in_order() -> None:
    """With k = 4 the scheduler has up to 3 plans out while it applies a reply; each
    reply acknowledges its own plan and retires only the nulls sent up to it."""
    engine = FakeEngine(4, "async")
    for req_id, (prompt, answer) in WORKLOAD.items():
        engine.add(req_id, prompt, answer)
    outstanding = []
    update = engine.update

    def tracked(entry: _Queued) -> None:
        outstanding.append(engine.mgr.channel.outstanding())
        update(entry)

    engine.update = tracked  # type: ignore[method-assign]
    engine.run()
    assert max(outstanding) == 4 and min(outstanding) >= 1
    assert engine.mgr.channel.acknowledged == engine.mgr.channel.step_id
    engine.assert_clean_end()


# -- faults ------------------------------------------------------------------------------
def _lossy(seed: int, rate: float):  # noqa: ANN202
    """A transport that loses a plan (None) or repeats the previous one at ``rate``."""
    rng = random.Random(seed)

    def deliver(step: int, plan: Any, previous: Any) -> Any:
        roll = rng.random()
        if roll >= rate:
            return plan
        return None if roll < rate / 2 else previous

    return deliver


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", STEPS_IN_FLIGHT)
def test_lost_and_repeated_plans_never_expose_a_freed_block(k: int, mode: str,
                                                            seed: int) -> None:
    rng = random.Random(seed)
    workload = {f"r{i}": (rng.randint(100, 900), rng.randint(10, 120)) for i in range(6)}
    engine = _run(k, mode, workload, deliver=_lossy(seed, 0.3))  # reads checked inside
    faults = engine.mgr.counters.faults
    assert faults["plan_unacknowledged"] > 0
    assert engine.mgr.counters.evicted_blocks > 0
    engine.assert_clean_end()


def _lose(steps: set[int]):  # noqa: ANN202
    return lambda step, plan, previous: None if step in steps else plan


def test_a_lost_plan_masks_what_the_last_k_replies_may_have_freed() -> None:
    """k = 2: the reply to plan 3 (the prompt-end event of a 384-token prompt) frees 4
    blocks while plan 4 is out; plan 5 carries the nulls and is lost, while a new request
    is handed the freed blocks (a pool of 13 usable blocks: one spare). The worker masks
    what its last two applied plans scored (plan 3's request among them), so no read
    touches another request's block; a worker that masked only what its last plan
    scored (plan 4: nothing, its request was held) would read one."""
    workload = {"long": (384, 4)}
    late = {"late": (64, 4)}

    def run(worker_k: int) -> FakeEngine:
        engine = FakeEngine(2, "async", worker_k=worker_k, deliver=_lose({5}),
                            num_blocks=14)
        for req_id, (prompt, answer) in workload.items():
            engine.add(req_id, prompt, answer)
        while engine.steps < 4:
            engine.engine_step()
        assert engine.mgr.channel.unacked  # plan 3's event freed blocks
        for req_id, (prompt, answer) in late.items():  # takes the freed blocks next step
            engine.add(req_id, prompt, answer)
        engine.run()
        return engine

    engine = run(worker_k=2)
    assert engine.mgr.counters.faults["plan_unacknowledged"] == 1
    engine.assert_clean_end()
    with pytest.raises(AssertionError, match="long"):
        run(worker_k=1)


def test_a_request_preempted_between_plan_and_reply_drops_the_reply() -> None:
    """k = 2: the long prompt's event is planned in step 3; before the reply, step 4's
    schedule preempts it (its blocks go back, its count moves on) and step 5 resumes it
    from token 0. The reply describes the old block list: it is dropped, the new list is
    left alone, and the request then evicts as it did the first time."""
    engine = FakeEngine(2, "async")
    engine.add("long", 700, 8)
    while engine.steps < 3:
        engine.engine_step()
    st = engine.mgr.states.get("long")
    assert st is not None and st.event_in_flight is not None  # planned in step 3, held
    engine.preempt("long")
    engine.engine_step()  # the reply of step 3 arrives while "long" is preempted
    assert engine.mgr.counters.faults["scores_preempted"] == 1
    assert engine.mgr.counters.evicted_blocks == 0 and not engine.events
    engine.run()
    reference = _run(1, "pp", {"long": (700, 8)})
    assert engine.events == reference.events  # the same seed, the same evictions
    assert engine.peaks == reference.peaks
    engine.assert_clean_end()
