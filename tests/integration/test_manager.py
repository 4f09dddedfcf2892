"""Scheduler-side eviction against vLLM's real block pool and full-attention manager."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.integration.conftest import HAS_VLLM
from tests.integration.fakes import scheduler_side

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")



def _setup(num_blocks: int = 64, budget: int = 256, chunk: int = 128):  # noqa: ANN202
    return scheduler_side(num_blocks, max_tokens=budget, chunk_size=chunk)


def _request(req_id: str, prompt: int, **extra):  # noqa: ANN003, ANN202
    params = SimpleNamespace(extra_args=extra or None, seed=None)
    return SimpleNamespace(request_id=req_id, num_prompt_tokens=prompt, num_computed_tokens=0,
                           sampling_params=params)


def _output(sched: dict[str, int], new: tuple[str, ...] = (), resumed: tuple[str, ...] = (),
            finished: tuple[str, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(
        finished_req_ids=set(finished), num_scheduled_tokens=dict(sched),
        scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)))


def _step(mgr, single, requests, sched, new=()):  # noqa: ANN001, ANN202
    """Allocate like vLLM's scheduler, advance computed tokens, plan the step."""
    for req_id, n in sched.items():
        r = requests[req_id]
        single.allocate_new_blocks(req_id, r.num_computed_tokens + n, r.num_computed_tokens + n)
        r.num_computed_tokens += n
    return mgr.plan_step(_output(sched, new=tuple(new)), requests)


def _reply(plan, mgr, req_ids=None, seed: int = 0, ack: int | None = -1):  # noqa: ANN001, ANN202
    """The worker's reply to ``plan``: random row-normalised masses over live blocks."""
    from nexus_vllm.integration.step_plan import WorkerReply

    masses = {}
    for req_id in req_ids if req_ids is not None else plan.score:
        sreq = plan.score[req_id]
        live = mgr.live_indices(req_id)[: sreq.num_logical_blocks]
        live = [j for j in live if j < sreq.num_logical_blocks]
        g = torch.Generator().manual_seed(seed)
        masses[req_id] = torch.softmax(torch.randn(sreq.window, len(live), generator=g),
                                       dim=-1).numpy().astype(np.float32)
    return WorkerReply(step_id=plan.step_id if ack == -1 else ack, masses=masses,
                       scoring_seconds=0.001)


def test_chunked_prefill_stays_within_budget_plus_chunk_and_frees_blocks() -> None:
    mgr, single, pool = _setup()
    free0 = pool.get_num_free_blocks()
    reqs = {"r": _request("r", prompt=1000)}
    budget_blocks, chunk_blocks = 8, 4
    evicted_total = 0
    first = True
    while reqs["r"].num_computed_tokens < 1000:
        plan = _step(mgr, single, reqs,
                     {"r": min(128, 1000 - reqs["r"].num_computed_tokens)},
                     new=("r",) if first else ())
        first = False
        live = mgr.live_count("r")
        assert live <= budget_blocks + chunk_blocks
        if "r" in plan.score:
            sreq = plan.score["r"]
            assert sreq.prefill
            before = pool.get_num_free_blocks()
            mgr.apply_reply(plan, _reply(plan, mgr), reqs)
            assert mgr.live_count("r") == budget_blocks
            freed = pool.get_num_free_blocks() - before
            evicted = sorted(mgr.unacked["r"])
            assert freed == len(evicted) > 0
            evicted_total += freed
            blocks = mgr.blocks("r")
            assert all(blocks[j].is_null for j in evicted)
            # Sink block and the newest recent_blocks + 1 live blocks are never evicted,
            # which is what the plan told the worker (evictable_below).
            assert 0 not in evicted and all(j < sreq.evictable_below for j in evicted)
    assert mgr.counters.over_budget_peak <= 0
    # The next plan ships the evictions to the worker; its acknowledgement retires them.
    plan = _step(mgr, single, reqs, {"r": 1})
    assert sum(len(v) for v in plan.evict.values()) > 0
    assert not plan.score  # decode: interval not reached yet
    mgr.apply_reply(plan, _reply(plan, mgr), reqs)
    assert mgr.unacked == {}
    # Request end: vLLM frees the rest; every block is back.
    single.free("r")
    assert pool.get_num_free_blocks() == free0
    stats = mgr.stats({})
    assert stats["nexus:evicted_blocks"] == evicted_total
    assert stats["nexus:free_blocks"] == stats["nexus:total_blocks"] == free0


def test_plan_ids_and_resend_until_acknowledged() -> None:
    """A lost or stale plan is repaired by the next: its nulls are resent until the
    worker acknowledges them, and scores from an unacknowledged step are dropped."""
    mgr, single, pool = _setup()
    reqs = {"r": _request("r", prompt=600)}
    plan1 = _step(mgr, single, reqs, {"r": 512}, new=("r",))
    assert plan1.step_id == 1 and "r" in plan1.score
    mgr.apply_reply(plan1, _reply(plan1, mgr), reqs)
    evicted = tuple(sorted(mgr.unacked["r"]))
    # Step 2's plan carries the nulls; the worker never acknowledges it (lost).
    plan2 = _step(mgr, single, reqs, {"r": 88})
    assert plan2.step_id == 2 and plan2.evict == {"r": evicted}
    events = mgr.counters.eviction_events
    mgr.apply_reply(plan2, _reply(plan2, mgr, ack=None), reqs)
    assert mgr.counters.faults["plan_unacknowledged"] == 1
    assert mgr.counters.eviction_events == events  # its scores were dropped
    # Step 3 resends them; acknowledged this time.
    plan3 = _step(mgr, single, reqs, {"r": 1})
    assert plan3.step_id == 3 and plan3.evict["r"][: len(evicted)] == evicted
    mgr.apply_reply(plan3, _reply(plan3, mgr), reqs)
    assert "r" not in mgr.unacked or not set(evicted) & set(mgr.unacked["r"])


def test_decode_interval_and_restart_reset() -> None:
    mgr, single, pool = _setup()
    reqs = {"r": _request("r", prompt=300)}
    plan = _step(mgr, single, reqs, {"r": 300}, new=("r",))
    mgr.apply_reply(plan, _reply(plan, mgr), reqs)
    first = sorted(mgr.unacked["r"])
    events = 0
    for _ in range(64):
        plan = _step(mgr, single, reqs, {"r": 1})
        # Between events a decoding request may hold one block over its budget.
        assert mgr.live_count("r") <= 8 + 1
        if "r" in plan.score:
            assert not plan.score["r"].prefill and plan.score["r"].window == 16
            events += 1
        mgr.apply_reply(plan, _reply(plan, mgr, seed=events), reqs)
    # Tokens 301..364 cross two block boundaries (320, 352): an event follows each, once
    # 16 decode tokens (the interval) have passed since the previous one.
    assert events == 2
    assert mgr.counters.over_budget_peak <= 0
    # Preemption: vLLM frees everything; the request comes back as resumed and
    # recomputes from token 0 -> same seed, same evictions.
    single.free("r")
    reqs["r"].num_computed_tokens = 0
    single.allocate_new_blocks("r", 300, 300)
    reqs["r"].num_computed_tokens = 300
    plan = mgr.plan_step(_output({"r": 300}, resumed=("r",)), reqs)
    assert "r" not in plan.evict  # old nulls never reach the fresh block list
    mgr.apply_reply(plan, _reply(plan, mgr), reqs)
    assert sorted(mgr.unacked["r"]) == first


def test_per_request_overrides_and_opt_out() -> None:
    mgr, single, pool = _setup()
    reqs = {"big": _request("big", 600, kv_budget=100_000),
            "off": _request("off", 600, kv_eviction="none"),
            "h2o": _request("h2o", 600, kv_eviction="h2o", kv_budget=192)}
    plan = _step(mgr, single, reqs, {"big": 256, "off": 256, "h2o": 256},
                 new=("big", "off", "h2o"))
    assert sorted(plan.track) == ["big", "h2o"]
    assert list(plan.score) == ["h2o"]  # 8 live blocks > 192 // 32; "big" is far below
    assert mgr.states["h2o"] is not None and mgr.states["h2o"].cfg.method == "h2o"


def test_stale_scores_are_skipped() -> None:
    mgr, single, pool = _setup()
    reqs = {"r": _request("r", prompt=600)}
    plan = _step(mgr, single, reqs, {"r": 512}, new=("r",))
    reply = _reply(plan, mgr)
    reply.masses["r"] = reply.masses["r"][:, :-1]  # one column short
    free = pool.get_num_free_blocks()
    mgr.apply_reply(plan, reply, reqs)
    assert pool.get_num_free_blocks() == free and mgr.counters.faults["stale_scores"] == 1


@pytest.mark.parametrize("prompt, budget, chunk, hit, want", [
    (2000, 512, 128, 1024, 512),   # first event after the chunk ending at 640
    (2000, 512, 128, 256, 256),    # a shorter hit is kept
    (2000, 512, 128, 320, 256),    # ... rounded down to a chunk boundary
    (300, 512, 128, 288, None),    # the prompt never goes over budget: no cap
    (2000, 512, 96, 1024, 480),    # chunk 96, block 32: first event after 576
])
def test_prefix_hits_stop_before_the_first_eviction(prompt, budget, chunk, hit,
                                                    want) -> None:  # noqa: ANN001
    mgr, single, pool = _setup(budget=budget, chunk=chunk)
    rule = mgr._hit_cap(_request("r", prompt))
    if want is None:
        assert rule is None
    else:
        limit, multiple = rule
        assert (min(hit, limit) // multiple) * multiple == want


def test_caching_is_capped_at_the_clean_watermark() -> None:
    """After its first eviction a request publishes no more blocks to the prefix cache."""
    mgr, single, pool = _setup()
    from nexus_vllm.integration.vllm_compat import cap_prefix_caching

    assert hasattr(single.cache_blocks, "__wrapped__")  # the manager capped vLLM's
    seen: list[int] = []

    fake = SimpleNamespace(cache_blocks=lambda request, n, *a, **k: seen.append(n))
    cap_prefix_caching(fake, lambda r: mgr.clean_tokens.get(r.request_id))
    reqs = {"r": _request("r", prompt=1000)}
    plan = _step(mgr, single, reqs, {"r": 384}, new=("r",))
    fake.cache_blocks(reqs["r"], 384)
    mgr.apply_reply(plan, _reply(plan, mgr), reqs)
    assert mgr.clean_tokens["r"] == 384
    _step(mgr, single, reqs, {"r": 128})
    fake.cache_blocks(reqs["r"], 512)
    assert seen == [384, 384]
    # Preempted and resumed: the watermark goes with the old block list.
    mgr.plan_step(_output({"r": 128}, resumed=("r",)), reqs)
    assert "r" not in mgr.clean_tokens


def test_admission_by_bound() -> None:
    """An evicting request is admitted only if the pool covers its bound (budget + one
    chunk) on top of what admitted evicting requests may still grow to."""
    from vllm.v1.request import RequestStatus

    mgr, single, pool = _setup(num_blocks=30)  # 29 usable; bound = 8 + 4 = 12 blocks
    reqs = {}
    for rid in ("a", "b", "c"):
        r = _request(rid, prompt=1000)
        r.max_tokens, r.status = 64, RequestStatus.WAITING
        reqs[rid] = r
    assert mgr.bound_blocks(reqs["a"]) == 12
    assert mgr.may_admit(reqs["a"])
    _step(mgr, single, {"a": reqs["a"]}, {"a": 128}, new=("a",))  # holds 4 of its 12
    assert mgr.may_admit(reqs["b"])  # 25 free - 8 outstanding >= 12
    _step(mgr, single, {"b": reqs["b"]}, {"b": 128}, new=("b",))
    assert not mgr.may_admit(reqs["c"])  # 21 free - 16 outstanding < 12
    assert mgr.counters.admission_waits == 1
    short = _request("d", prompt=100)
    short.max_tokens = 20  # the whole sequence needs 4 blocks: that is its bound
    assert mgr.bound_blocks(short) == 4 and mgr.may_admit(short)
    off = _request("e", prompt=1000, kv_eviction="none")
    assert mgr.bound_blocks(off) is None and mgr.may_admit(off)
