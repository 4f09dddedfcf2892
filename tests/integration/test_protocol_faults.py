"""The scheduler <-> worker protocol under lost and repeated plans: the worker never reads
a block that is free or belongs to another request.

Scheduler side: vLLM's real block pool and full-attention manager under
``EvictionManager``. Worker side: ``WorkerEvictionState`` over a stand-in for the V1
runner whose block-table rows receive each step's new block ids as vLLM's runner does.
Between them, a seeded schedule of faults: a plan dropped, or the previous plan sent
again. After compaction each step, every block a request's attention would read must be
one the scheduler currently gives that request.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.integration.conftest import HAS_VLLM
from tests.integration.fakes import (
    BS,
    FakeRunner,
    common_metadata,
    engine_request,
    fake_evidence,
    live_indices,
    make_state,
    scheduler_side,
)

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

SEEDS = [0, 1, 2, 3]
FAULT_RATES = [0.0, 0.3, 0.6]
STEPS = 120


def _scheduler(num_blocks: int = 400):  # noqa: ANN202
    return scheduler_side(num_blocks, max_tokens=256, chunk_size=128, interval=4)


@pytest.mark.parametrize("fault_rate", FAULT_RATES)
@pytest.mark.parametrize("seed", SEEDS)
def test_worker_never_reads_a_freed_block(seed: int, fault_rate: float) -> None:
    from nexus_vllm.integration.protocol import WorkerReply

    rng = random.Random(seed)
    mgr, single, pool = _scheduler()
    free_at_start = pool.get_num_free_blocks()
    runner = FakeRunner({}, max_blocks=64, max_rows=8)
    state = make_state(runner, max_requests=8)
    requests: dict[str, SimpleNamespace] = {}
    finished: set[str] = set()
    previous = None
    counter = 0
    for _ in range(STEPS):
        # New requests arrive; running ones get a prefill chunk or one decode token.
        while len(requests) < 6 and rng.random() < 0.5:
            counter += 1
            rid = f"r{counter}"
            requests[rid] = engine_request(rid, rng.randint(100, 900))
        new = [r for r in requests if r not in runner.requests]
        sched = {}
        for rid, req in requests.items():
            left = req.num_prompt_tokens - req.num_computed_tokens
            n = min(128, left) if left > 0 else 1
            total = req.num_computed_tokens + n
            single.allocate_new_blocks(rid, total, total)
            req.num_computed_tokens = total
            sched[rid] = n
        output = SimpleNamespace(
            finished_req_ids=set(finished), num_scheduled_tokens=sched,
            scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
            scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()))
        plan = mgr.plan_step(output, requests)
        # The worker's runner: rows for new requests, new block ids appended (vLLM's
        # _update_states), finished rows dropped.
        for rid in finished:
            runner.requests.pop(rid, None)
        finished.clear()
        _sync_rows(runner, single, requests)
        roll = rng.random()
        sent = plan if roll >= fault_rate else (None if roll < fault_rate / 2 else previous)
        previous = plan
        step = state.begin_step(output, sent)
        rows = list(runner.input_batch.req_ids)
        seq = [requests[r].num_computed_tokens for r in rows]
        if rows:
            cm = state.compactor.compact(common_metadata(runner, seq,
                                                         [sched[r] for r in rows]))
            _check_reads(cm, rows, seq, single)
        # Not scored here (made-up evidence below): the reply's acknowledgement and faults.
        reply = state.reply_token(step, None).reply()
        if reply.step_id is not None:
            evidence: dict[str, dict[str, np.ndarray]] = {}
            for rid, sreq in plan.score.items():
                live = live_indices(mgr, rid, requests[rid].num_computed_tokens)
                for kind, values in fake_evidence(sorted(sreq.kinds), sreq.window, len(live),
                                                  torch.default_generator).items():
                    evidence.setdefault(kind, {})[rid] = values
            reply = WorkerReply(step_id=reply.step_id, evidence=evidence)
        mgr.apply_reply(plan, reply, requests)
        state.end_step(step)
        # Some requests finish (vLLM frees their blocks at once).
        for rid in list(requests):
            req = requests[rid]
            if req.num_computed_tokens > req.num_prompt_tokens + 40 or rng.random() < 0.02:
                single.free(rid)
                del requests[rid]
                finished.add(rid)
    assert mgr.counters.evicted_blocks > 0
    if fault_rate:
        assert sum(mgr.counters.faults.values()) > 0
    for rid in list(requests):
        single.free(rid)
    assert pool.get_num_free_blocks() == free_at_start


def _sync_rows(runner: FakeRunner, single, requests) -> None:  # noqa: ANN001
    """Mirror vLLM's runner: append each request's newly allocated block ids."""
    batch = runner.input_batch
    batch.req_ids = list(requests)
    batch.req_id_to_index = {r: i for i, r in enumerate(batch.req_ids)}
    table = runner.table
    table[:] = 0
    for rid in batch.req_ids:
        blocks = single.req_to_blocks[rid]
        state = runner.requests.setdefault(rid, SimpleNamespace(block_ids=[[]]))
        ids = state.block_ids[0]
        ids.extend(b.block_id for b in blocks[len(ids):])
        row = batch.req_id_to_index[rid]
        table[row, : len(ids)] = ids
    batch.num_reqs = len(batch.req_ids)


def _check_reads(cm, rows: list[str], seq: list[int], single) -> None:  # noqa: ANN001
    """Every block a row's attention reads belongs to that request right now."""
    table = cm.block_table_tensor
    lens = cm.seq_lens
    for i, rid in enumerate(rows):
        n = -(-int(lens[i]) // BS)
        owned = {b.block_id for b in single.req_to_blocks[rid] if not b.is_null}
        read = set(table[i, :n].tolist())
        assert read <= owned, (rid, sorted(read - owned))
        assert int(lens[i]) <= seq[i]
