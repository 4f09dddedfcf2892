"""Scheduler-side eviction against vLLM's real block pool and full-attention manager."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from nexus_vllm.core.budget import bound_blocks, evicts_mid_prompt, hard_limit
from tests.integration.conftest import HAS_VLLM
from tests.integration.fakes import engine_request, live_count, live_indices, scheduler_side

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")



def _setup(num_blocks: int = 64, budget: int = 256, chunk: int = 128):  # noqa: ANN202
    return scheduler_side(num_blocks, max_tokens=budget, chunk_size=chunk)


def _request(req_id: str, prompt: int, **extra):  # noqa: ANN003, ANN202
    return engine_request(req_id, prompt, **extra)


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
    """The worker's reply to ``plan``: random evidence of every kind each request's policy
    reads (row-normalised masses) over its live blocks."""
    from nexus_vllm.integration.protocol import WorkerReply
    from tests.integration.fakes import fake_evidence

    evidence: dict[str, dict[str, np.ndarray]] = {}
    for req_id in req_ids if req_ids is not None else plan.score:
        sreq = plan.score[req_id]
        live = [j for j in live_indices(mgr, req_id) if j < sreq.num_logical_blocks]
        g = torch.Generator().manual_seed(seed)
        for kind, values in fake_evidence(sorted(sreq.kinds), sreq.window, len(live),
                                          g).items():
            evidence.setdefault(kind, {})[req_id] = values
    return WorkerReply(step_id=plan.step_id if ack == -1 else ack, evidence=evidence,
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
        live = live_count(mgr, "r")
        assert live <= budget_blocks + chunk_blocks
        if "r" in plan.score:
            sreq = plan.score["r"]
            assert sreq.prefill
            before = pool.get_num_free_blocks()
            mgr.apply_reply(plan, _reply(plan, mgr), reqs)
            assert live_count(mgr, "r") == budget_blocks
            freed = pool.get_num_free_blocks() - before
            evicted = sorted(mgr.channel.unacked["r"])
            assert freed == len(evicted) > 0
            evicted_total += freed
            blocks = mgr.blocks.of("r")
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
    assert mgr.channel.unacked == {}
    # Request end: vLLM frees the rest; every block is back.
    single.free("r")
    assert pool.get_num_free_blocks() == free0
    stats = mgr.stats({})
    assert stats.counters["evicted_blocks"] == evicted_total
    assert stats.gauges["free_blocks"] == stats.gauges["total_blocks"] == free0


def test_plan_ids_and_resend_until_acknowledged() -> None:
    """A lost or stale plan is repaired by the next: its nulls are resent until the
    worker acknowledges them, and scores from an unacknowledged step are dropped."""
    mgr, single, pool = _setup()
    reqs = {"r": _request("r", prompt=600)}
    plan1 = _step(mgr, single, reqs, {"r": 512}, new=("r",))
    assert plan1.step_id == 1 and "r" in plan1.score
    mgr.apply_reply(plan1, _reply(plan1, mgr), reqs)
    evicted = tuple(sorted(mgr.channel.unacked["r"]))
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
    unacked = mgr.channel.unacked
    assert "r" not in unacked or not set(evicted) & set(unacked["r"])


def test_decode_interval_and_restart_reset() -> None:
    mgr, single, pool = _setup()
    reqs = {"r": _request("r", prompt=300)}
    plan = _step(mgr, single, reqs, {"r": 300}, new=("r",))
    mgr.apply_reply(plan, _reply(plan, mgr), reqs)
    first = sorted(mgr.channel.unacked["r"])
    events = 0
    for _ in range(64):
        plan = _step(mgr, single, reqs, {"r": 1})
        # Between events a decoding request may hold one block over its budget.
        assert live_count(mgr, "r") <= 8 + 1
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
    assert sorted(mgr.channel.unacked["r"]) == first


def test_per_request_overrides_and_opt_out() -> None:
    mgr, single, pool = _setup()
    reqs = {"big": _request("big", 600, kv_budget=100_000),
            "off": _request("off", 600, kv_eviction="none"),
            "h2o": _request("h2o", 600, kv_eviction="h2o", kv_budget=192)}
    plan = _step(mgr, single, reqs, {"big": 256, "off": 256, "h2o": 256},
                 new=("big", "off", "h2o"))
    assert sorted(plan.track) == ["big", "h2o"]
    assert list(plan.score) == ["h2o"]  # 8 live blocks > 192 // 32; "big" is far below
    h2o = mgr.states.get("h2o")
    assert h2o is not None and h2o.cfg.method == "h2o"


def test_stale_scores_are_skipped() -> None:
    mgr, single, pool = _setup()
    reqs = {"r": _request("r", prompt=600)}
    plan = _step(mgr, single, reqs, {"r": 512}, new=("r",))
    reply = _reply(plan, mgr)
    reply.of("mass")["r"] = reply.of("mass")["r"][:, :-1]  # one column short
    free = pool.get_num_free_blocks()
    mgr.apply_reply(plan, reply, reqs)
    assert pool.get_num_free_blocks() == free and mgr.counters.faults["stale_scores"] == 1


def test_a_reply_that_cannot_be_applied_is_a_counted_fault() -> None:
    """A failure while applying a reply (here masses that are not an array) skips the
    step's events, frees nothing and counts the fault ``reply_error``."""
    mgr, single, pool = _setup()
    reqs = {"r": _request("r", prompt=600)}
    plan = _step(mgr, single, reqs, {"r": 512}, new=("r",))
    reply = _reply(plan, mgr)
    reply.of("mass")["r"] = reply.of("mass")["r"].tolist()
    free = pool.get_num_free_blocks()
    mgr.apply_reply(plan, reply, reqs)
    assert pool.get_num_free_blocks() == free and mgr.counters.faults["reply_error"] == 1
    assert mgr.channel.unacked == {}


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
    rule = mgr.hit_cap(_request("r", prompt))
    if want is None:
        assert rule is None
    else:
        limit, multiple = rule
        assert (min(hit, limit) // multiple) * multiple == want


def test_caching_is_capped_at_the_clean_watermark() -> None:
    """After its first eviction a request publishes no more blocks to the prefix cache."""
    mgr, single, pool = _setup()
    from nexus_vllm.integration.compat.vllm_compat import cap_prefix_caching

    assert hasattr(single.cache_blocks, "__wrapped__")  # the manager capped vLLM's
    seen: list[int] = []

    fake = SimpleNamespace(cache_blocks=lambda request, n, *a, **k: seen.append(n))
    cap_prefix_caching(fake, mgr.caching_limit)
    reqs = {"r": _request("r", prompt=1000)}
    plan = _step(mgr, single, reqs, {"r": 384}, new=("r",))
    fake.cache_blocks(reqs["r"], 384)
    mgr.apply_reply(plan, _reply(plan, mgr), reqs)
    assert mgr.states.get("r").clean_watermark == 384
    _step(mgr, single, reqs, {"r": 128})
    fake.cache_blocks(reqs["r"], 512)
    assert seen == [384, 384]
    # Preempted and resumed: the watermark goes with the old block list.
    mgr.plan_step(_output({"r": 128}, resumed=("r",)), reqs)
    assert mgr.states.get("r").clean_watermark is None


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


# -- prompt_mode (per request; the server streams) -------------------------------------
def _drive(mgr, single, reqs, rid, decode: int, chunk: int = 128):  # noqa: ANN001, ANN202
    """Prefill ``rid``'s prompt in ``chunk``-token steps, then decode ``decode`` tokens,
    answering every plan. Returns the events ``(tokens, ScoreRequest, live before, live
    after)`` and the most live blocks held, checking the hard limit at every step."""
    r = reqs[rid]
    prompt = r.num_prompt_tokens
    events, peak, first = [], 0, True
    while r.num_computed_tokens < prompt + decode:
        done = r.num_computed_tokens
        n = min(chunk, prompt - done) if done < prompt else 1
        plan = _step(mgr, single, reqs, {rid: n}, new=(rid,) if first else ())
        first = False
        cfg = mgr.states.get(rid).cfg
        live = live_count(mgr, rid)
        peak = max(peak, live)
        assert live <= hard_limit(cfg, r.num_computed_tokens, prompt)
        mgr.apply_reply(plan, _reply(plan, mgr, seed=len(events)), reqs)
        if rid in plan.score:
            events.append((r.num_computed_tokens, plan.score[rid], live, live_count(mgr, rid)))
    assert mgr.counters.over_budget_peak <= 0
    return events, peak


def test_end_mode_one_event_at_the_prompt_end() -> None:
    """``end`` without a prefill budget: the prompt is kept whole until its last chunk
    (a short one: its window takes rows of the chunk before), then one prefill event
    evicts down to the budget; decoding evicts as in ``stream``."""
    mgr, single, pool = _setup()
    prompt = 7 * 128 + 10
    reqs = {"r": _request("r", prompt, kv_prompt_mode="end")}
    events, peak = _drive(mgr, single, reqs, "r", decode=64)
    prefill = [e for e in events if e[1].prefill]
    assert [e[0] for e in prefill] == [prompt]
    tokens, sreq, before, after = prefill[0]
    assert sreq.window == 32 and before == peak == -(-prompt // 32) and after == 8
    decode = [e for e in events if not e[1].prefill]
    assert decode and all(e[1].window == 16 and e[3] == 8 for e in decode)
    cfg = mgr.states.get("r").cfg
    assert peak <= bound_blocks(cfg, prompt, prompt + 64)


def test_end_mode_prefill_budget_streams_under_the_cap() -> None:
    """``end`` with a prefill budget: mid-prompt events keep the prefill budget, the
    prompt-end event the budget."""
    mgr, single, pool = _setup()
    prompt = 1000
    reqs = {"r": _request("r", prompt, kv_prompt_mode="end", kv_prefill_budget=384)}
    events, peak = _drive(mgr, single, reqs, "r", decode=0)
    assert [e[0] for e in events] == [512, 640, 768, 896, 1000]
    assert all(e[1].prefill for e in events)
    assert [e[3] for e in events] == [12, 12, 12, 12, 8]  # 384 // 32, then 256 // 32
    assert peak == 12 + 4  # the cap plus one chunk
    assert peak <= bound_blocks(mgr.states.get("r").cfg, prompt, prompt)


def test_keep_mode_never_evicts_a_prompt_block() -> None:
    """``keep``: no event during the prompt; decode events evict generated blocks only,
    down to the prompt's blocks plus the budget."""
    mgr, single, pool = _setup(num_blocks=80)
    prompt = 1000  # 32 blocks, the last one shared with the first generated tokens
    reqs = {"r": _request("r", prompt, kv_prompt_mode="keep")}
    events, peak = _drive(mgr, single, reqs, "r", decode=400)
    assert events and not any(e[1].prefill for e in events)
    assert events[0][0] > prompt + 256  # the budget counts generated tokens only
    evicted = [j for j, b in enumerate(mgr.blocks.of("r")) if b.is_null]
    assert evicted and min(evicted) >= 32
    assert all(e[3] == 32 + 8 for e in events)
    assert peak <= bound_blocks(mgr.states.get("r").cfg, prompt, prompt + 400)


def test_stream_mode_per_request_on_an_end_server() -> None:
    """A server started in ``end`` mode serves a request that asks for ``stream``: it
    evicts after every chunk once over budget."""
    mgr, single, pool = scheduler_side(64, max_tokens=256, chunk_size=128, prompt_mode="end")
    reqs = {"s": _request("s", 1000, kv_prompt_mode="stream"), "e": _request("e", 1000)}
    s_events, _ = _drive(mgr, single, reqs, "s", decode=0)
    e_events, _ = _drive(mgr, single, reqs, "e", decode=0)
    assert [e[0] for e in s_events] == [384, 512, 640, 768, 896, 1000]
    assert [e[0] for e in e_events] == [1000]


@pytest.mark.parametrize("xargs, want", [
    ({}, 8 + 4),                                           # stream: budget + chunk
    ({"kv_prompt_mode": "end"}, 32),                       # the whole prompt
    ({"kv_prompt_mode": "end", "kv_prefill_budget": 512}, 16 + 4),  # its cap + a chunk
    ({"kv_prompt_mode": "keep"}, 34),                      # prompt + budget + chunk > seq
])
def test_admission_reserves_the_config_bound(xargs, want) -> None:  # noqa: ANN001
    mgr, single, pool = _setup()
    r = _request("r", 1000, **xargs)
    r.max_tokens = 64
    assert mgr.bound_blocks(r) == want == bound_blocks(mgr.states.resolve(r).cfg, 1000, 1064)
    mgr.admission.max_model_len = 1010  # the sequence cannot grow past it
    r2 = _request("r2", 1000, **xargs)
    r2.max_tokens = 64
    cfg2 = mgr.states.resolve(r2).cfg
    assert mgr.bound_blocks(r2) == min(want, 32) == bound_blocks(cfg2, 1000, 1010)


@pytest.mark.parametrize("prompt, xargs, want", [
    # end: only the prompt's end fires, so chunk boundaries do not matter; the hit stops
    # on a block boundary before the prompt-end event's 32-row window.
    (2000, {"kv_prompt_mode": "end"}, 1952),
    (1930, {"kv_prompt_mode": "end"}, 1888),
    (2000, {"kv_prompt_mode": "end", "kv_prefill_budget": 1024}, 1024),  # first cap event
    (2000, {"kv_prompt_mode": "keep"}, None),  # no event during the prompt
    (520, {}, 384),                            # stream, the first event's chunk is short
])
def test_prefix_hit_cap_per_prompt_mode(prompt, xargs, want) -> None:  # noqa: ANN001
    mgr, single, pool = _setup(budget=512)
    rule = mgr.hit_cap(_request("r", prompt, **xargs))
    if want is None:
        assert rule is None
    else:
        limit, multiple = rule
        assert (min(prompt - 1, limit) // multiple) * multiple == want


def test_finished_requests_report_their_peak_live_blocks() -> None:
    """Each finished request's peak live blocks, by prompt mode, reach the stats once
    (and the Prometheus histogram ``vllm:nexus_request_peak_live_blocks``)."""
    from prometheus_client import REGISTRY

    from nexus_vllm.integration import metrics

    mgr, single, pool = _setup()
    reqs = {"e": _request("e", 1000, kv_prompt_mode="end"), "s": _request("s", 1000)}
    _, peak_e = _drive(mgr, single, reqs, "e", decode=8)
    _, peak_s = _drive(mgr, single, reqs, "s", decode=8)
    assert (peak_e, peak_s) == (32, 12)
    mgr.record_finished({"e"})  # the scheduler's make_stats, in the step "e" ends in
    mgr.plan_step(_output({}, finished=("e", "s")), reqs)  # the next plan retires both
    mgr.plan_step(_output({}, finished=("e", "s")), reqs)  # (never twice)
    stats = mgr.stats({})
    assert stats.peaks == {("end", 32): 1, ("stream", 12): 1}
    assert not mgr.stats({}).peaks  # drained

    def sample(name: str, mode: str) -> float:
        return REGISTRY.get_sample_value(f"vllm:nexus_request_peak_live_blocks_{name}",
                                         {"engine": "9", "prompt_mode": mode}) or 0.0

    metrics.export(stats, engine_idx=9)
    assert sample("count", "end") == 1 and sample("sum", "end") == 32
    assert sample("sum", "stream") == 12


def test_admission_releases_an_end_request_prompt_peak_after_its_event() -> None:
    """An admitted ``end`` request reserves its prompt's peak only until the prompt-end
    event: then what it may still grow to is its decode hard limit
    (``budget.peak_from``), and the pool admits the next one."""
    from vllm.v1.request import RequestStatus

    mgr, single, pool = _setup(num_blocks=64)  # 63 usable
    reqs = {}
    for rid in ("a", "b"):
        r = _request(rid, 1000, kv_prompt_mode="end")
        r.max_tokens, r.status = 64, RequestStatus.WAITING
        reqs[rid] = r
    assert mgr.bound_blocks(reqs["a"]) == 32 and mgr.may_admit(reqs["a"])
    a = {"a": reqs["a"]}
    for i in range(7):  # all but the last chunk: a holds 28 of its 32
        plan = _step(mgr, single, a, {"a": 128}, new=("a",) if i == 0 else ())
        assert not plan.score
    assert not mgr.may_admit(reqs["b"])  # 35 free - 4 outstanding < 32
    plan = _step(mgr, single, a, {"a": 1000 - 7 * 128})
    assert "a" in plan.score and plan.score["a"].prefill
    mgr.apply_reply(plan, _reply(plan, mgr), a)
    assert live_count(mgr, "a") == 8
    # a may still grow to 8 + 4 blocks: 55 free - 4 outstanding >= 32.
    assert mgr.may_admit(reqs["b"])


def test_end_mode_resumed_request_recomputes_within_its_bound() -> None:
    """Preempted after decoding, an ``end`` request recomputes its prompt and generated
    tokens in chunks: the chunk that runs past the prompt's end fires the prompt-end event
    (its window then ends on generated tokens), and no step passes the hard limit."""
    mgr, single, pool = _setup()
    prompt = 1000
    reqs = {"r": _request("r", prompt, kv_prompt_mode="end")}
    _drive(mgr, single, reqs, "r", decode=40)
    single.free("r")
    r = reqs["r"]
    r.num_computed_tokens = 0
    events, first = [], True
    while r.num_computed_tokens < prompt + 40:
        n = min(128, prompt + 40 - r.num_computed_tokens)
        single.allocate_new_blocks("r", r.num_computed_tokens + n, r.num_computed_tokens + n)
        r.num_computed_tokens += n
        plan = mgr.plan_step(_output({"r": n}, resumed=("r",) if first else ()), reqs)
        first = False
        if "r" in plan.score:
            events.append((r.num_computed_tokens, plan.score["r"].prefill))
        mgr.apply_reply(plan, _reply(plan, mgr), reqs)
    assert events == [(1024, True), (1040, False)]
    assert mgr.counters.over_budget_peak <= 0


# -- hybrid sliding-window models ----------------------------------------------------------
WINDOW = 64  # tokens: two 32-token blocks


def _hybrid(num_blocks: int = 64, budget: int = 256, chunk: int = 128):  # noqa: ANN202
    return scheduler_side(num_blocks, window=WINDOW, step_tokens=chunk, max_tokens=budget,
                          chunk_size=chunk)


def _step_hybrid(mgr, single, requests, sched, new=()):  # noqa: ANN001, ANN202
    """:func:`_step` plus what vLLM does in the sliding group: free what left the window,
    then allocate the step's tokens."""
    sliding = mgr.windows.groups[0].manager
    for req_id, n in sched.items():
        r = requests[req_id]
        sliding.remove_skipped_blocks(req_id, r.num_computed_tokens)
        sliding.allocate_new_blocks(req_id, r.num_computed_tokens + n,
                                    r.num_computed_tokens + n)
    return _step(mgr, single, requests, sched, new)


def test_groups_are_classified_by_spec_not_index() -> None:
    """Gemma 3's layout (a sliding group first): eviction works on the full-attention
    group; a group of any other kind, a full group holding sliding layers (the hybrid
    manager off) and two full groups are refused, naming why."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    from nexus_vllm.integration.compat.vllm_compat import (
        UnsupportedKVCacheGroup,
        group_role,
        kv_cache_groups,
    )

    mgr, single, _ = _hybrid()
    assert mgr.blocks.kv_group is single and single.kv_cache_group_id == 1
    (w,) = mgr.windows.groups
    assert (w.index, w.window, w.block_size) == (0, WINDOW, 32)
    shape = {"block_size": 32, "num_kv_heads": 1, "head_size": 32, "dtype": torch.float32}
    with pytest.raises(UnsupportedKVCacheGroup, match="hybrid KV cache manager is off"):
        group_role(FullAttentionSpec(sliding_window=WINDOW, **shape))
    with pytest.raises(UnsupportedKVCacheGroup, match="MLAAttentionSpec"):
        group_role(MLAAttentionSpec(**shape))
    twice = SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=(single, single)))
    with pytest.raises(UnsupportedKVCacheGroup, match="exactly one full-attention"):
        kv_cache_groups(twice)


def test_window_groups_are_counted_never_evicted() -> None:
    """A long prompt in chunks: the full group stays within budget + one chunk while
    vLLM's sliding group holds its window plus a step; eviction never nulls a sliding
    entry (vLLM's backward free stops at the first null)."""
    mgr, single, pool = _hybrid(num_blocks=200)
    sliding = mgr.windows.groups[0].manager
    reqs = {"r": _request("r", prompt=1500)}
    first = True
    while reqs["r"].num_computed_tokens < 1500:
        n = min(128, 1500 - reqs["r"].num_computed_tokens)
        plan = _step_hybrid(mgr, single, reqs, {"r": n}, new=("r",) if first else ())
        first = False
        held = mgr.windows.held("r")
        computed = reqs["r"].num_computed_tokens
        blocks = sliding.req_to_blocks["r"]
        # What vLLM's sliding manager keeps (the tokens from computed - n - W + 1 on).
        assert held == sum(1 for b in blocks if not b.is_null)
        assert held <= mgr.windows.allowance(computed)
        mgr.apply_reply(plan, _reply(plan, mgr), reqs)
        assert live_count(mgr, "r") <= 12
    assert mgr.counters.evicted_blocks > 0 and mgr.counters.over_budget_peak <= 0
    assert mgr.windows.allowance(1500) == 7  # cdiv(64 - 1 + 128, 32) + 1
    assert mgr.windows.allowance(40) == 2  # never more than the sequence's blocks
    single.free("r")
    sliding.free("r")
    assert pool.get_num_free_blocks() == 199


def test_hybrid_admission_reserves_the_window_groups() -> None:
    """Admission reserves each request's full-group bound plus its sliding allowance,
    against what the admitted requests hold in both groups."""
    from vllm.v1.request import RequestStatus

    mgr, single, _ = _hybrid(num_blocks=40)  # 39 usable
    reqs = {}
    for rid in ("a", "b", "c"):
        r = _request(rid, prompt=1000)
        r.max_tokens, r.status = 64, RequestStatus.WAITING
        reqs[rid] = r
    need = mgr.bound_blocks(reqs["a"]) + mgr.windows.allowance(1064)
    assert need == 12 + 7
    assert mgr.may_admit(reqs["a"])
    _step_hybrid(mgr, single, {"a": reqs["a"]}, {"a": 128}, new=("a",))  # 4 + 4 held
    assert mgr.may_admit(reqs["b"])  # 31 free - (19 - 8) outstanding >= 19
    _step_hybrid(mgr, single, {"b": reqs["b"]}, {"b": 128}, new=("b",))
    assert not mgr.may_admit(reqs["c"])  # 23 free - 22 outstanding < 19
    assert mgr.counters.admission_waits == 1


def test_window_allowance_follows_the_phase() -> None:
    """A sliding group holds its window plus the tokens in flight: k whole steps while the
    prompt (or a recompute) is computed, k tokens once k decode steps follow it (one
    token a step); never more than the sequence's blocks."""
    mgr, _, _ = _hybrid(chunk=128)  # 128-token steps, 32-token blocks, window 64
    w = mgr.windows
    assert w.steps_in_flight == 1
    # A new request, and one whose last prompt step may still be in flight: 63 + 128.
    assert w.allowance(1500) == w.allowance(1500, 1500, 1500) == 7
    assert w.allowance(1500, 1501, 1500) == 3  # decoding: cdiv(63 + 1, 32) + 1
    assert w.allowance(2000, 1600, 1700) == 7 and w.allowance(2000, 1701, 1700) == 3
    assert w.allowance(40) == w.allowance(40, 41, 40) == 2  # its sequence's 2 blocks
    w.steps_in_flight = 2  # async scheduling: two steps in flight
    assert w.allowance(1500) == w.allowance(1500, 1501, 1500) == 11  # cdiv(63 + 256, 32) + 1
    assert w.allowance(1500, 1502, 1500) == 4  # cdiv(63 + 2, 32) + 1
    assert w.allowance(40) == w.allowance(40, 42, 40) == 2


def _window_steps(mgr: Any, steps: list[int], k: int, prompt: int, total: int
                  ) -> Iterator[tuple[int, int]]:
    """Drive vLLM's sliding manager of ``mgr`` through ``steps`` (tokens per step) with
    ``k`` steps in flight (it frees on the processed tokens: the computed ones less those
    in flight); yield ``(tokens done, blocks held)`` after each step, having checked the
    blocks held against the allowance admission kept before the step."""
    sliding = mgr.windows.groups[0].manager
    in_flight: list[int] = []
    done, reserve = 0, mgr.windows.allowance(total)  # a new request's
    for n in steps:
        sliding.remove_skipped_blocks("r", done - sum(in_flight[len(in_flight) - k + 1:]))
        sliding.allocate_new_blocks("r", done + n, done + n)
        done += n
        in_flight.append(n)
        held = mgr.windows.held("r")
        assert held <= reserve, done
        reserve = mgr.windows.allowance(total, done, prompt)  # for the next step on
        yield done, held


@pytest.mark.parametrize("k", [1, 2, 3])
def test_window_group_holds_within_the_phases_allowance(k: int) -> None:
    """vLLM's sliding manager with k steps in flight (it frees on the processed tokens:
    the computed ones less those in flight): what a request holds after each step is
    within the allowance admission kept for it before the step, and with k > 1 the
    prompt steps in flight take more than one step's allowance (the rule before)."""
    mgr, _, _ = _hybrid(num_blocks=200)
    mgr.windows.steps_in_flight = k
    prompt, total = 1500, 1540
    most = {"prompt": 0, "decode": 0}
    for done, held in _window_steps(mgr, [128] * 11 + [92] + [1] * 40, k, prompt, total):
        # Decoding: held within the decode allowance at once.
        assert held <= mgr.windows.allowance(total, done, prompt) or done < prompt + k, done
        most["decode" if done >= prompt + k else "prompt"] = max(
            held, most["decode" if done >= prompt + k else "prompt"])
    old = 7  # cdiv(64 - 1 + 128, 32) + 1: one step, whatever the phase and k
    assert most["decode"] <= mgr.windows.allowance(total, done, prompt) < old
    assert (most["prompt"] > old) == (k > 1)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_window_group_holds_within_the_chunked_allowance(k: int) -> None:
    """A server that evicts mid-prompt caps each request's prompt step at its chunk
    (vLLM's ``long_prefill_token_threshold``, and ``lone_request_prefill_cap`` for a lone
    request): vLLM's sliding manager, freeing on the processed tokens with k steps in
    flight, then holds at most the window plus k chunks while the prompt is computed,
    what admission reserves; k whole steps (the rule before) is far more."""
    from nexus_vllm.core.budget import window_blocks

    step, chunk = 512, 48
    mgr, _, _ = scheduler_side(400, window=WINDOW, step_tokens=step, max_tokens=256,
                               chunk_size=chunk)
    mgr.windows.steps_in_flight = k
    prompt, total = 1500, 1540
    # cdiv(64 - 1 + k x 48, 32) + 1: 5, 6, 8 blocks; k steps of 512 tokens: 19, 35, 49.
    assert mgr.windows.allowance(total) == window_blocks(WINDOW, 32, total, k * chunk) \
        == [5, 6, 8][k - 1]
    old = window_blocks(WINDOW, 32, total, k * step)
    most = 0
    steps = [chunk] * (prompt // chunk) + [prompt % chunk] + [1] * 40
    for done, held in _window_steps(mgr, steps, k, prompt, total):
        if done < prompt + k:
            most = max(most, held)
    # Within a block of the allowance (the window's start in a block decides the last).
    assert mgr.windows.allowance(total) - 1 <= most <= mgr.windows.allowance(total) < old


@pytest.mark.parametrize("xargs", [{}, {"kv_prompt_mode": "end"}, {"kv_prompt_mode": "keep"},
                                   {"kv_prompt_mode": "end", "kv_prefill_budget": 512}])
def test_admission_reserves_chunks_in_flight_where_the_server_caps_prompt_steps(
        xargs) -> None:  # noqa: ANN001
    """On a server that evicts mid-prompt every request's prompt step is capped at the
    chunk, whatever its own ``kv_prompt_mode``: admission reserves the window plus k
    chunks in each sliding group, so a pool of exactly the bound plus that admits it (the
    rule before, k whole steps, refused it) and one block less does not."""
    from nexus_vllm.core.budget import window_blocks

    step, chunk, k = 512, 64, 2
    r = _request("r", 1000, max_tokens=64, **xargs)
    probe, _, _ = scheduler_side(10, window=WINDOW, step_tokens=step, max_tokens=256,
                                 chunk_size=chunk)
    window = window_blocks(WINDOW, 32, 1064, k * chunk)  # cdiv(63 + 128, 32) + 1 = 7
    assert window == 7 < window_blocks(WINDOW, 32, 1064, k * step)
    need = probe.bound_blocks(r) + window
    for usable, admitted in ((need, True), (need - 1, False)):
        mgr, _, _ = scheduler_side(usable + 1, window=WINDOW, step_tokens=step,
                                   max_tokens=256, chunk_size=chunk)
        mgr.windows.steps_in_flight = k
        assert mgr.may_admit(_request("r", 1000, max_tokens=64, **xargs)) == admitted


def test_a_server_that_chunks_no_prompt_reserves_whole_steps() -> None:
    """A server in ``end`` mode sets no per-request cap (vLLM chunks prompts at its step
    budget, and lifts even a cap of its own for a lone request): a request that asks for
    ``stream`` there still has k whole steps in flight in each sliding group."""
    from nexus_vllm.core.budget import window_blocks

    mgr, _, _ = scheduler_side(64, window=WINDOW, step_tokens=256, max_tokens=256,
                               chunk_size=64, prompt_mode="end")
    mgr.windows.steps_in_flight = 2
    r = _request("r", 1000, max_tokens=64, kv_prompt_mode="stream")
    assert evicts_mid_prompt(mgr.states.resolve(r).cfg)
    # cdiv(63 + 2 x 256, 32) + 1, not the 7 of two 64-token chunks.
    assert mgr.windows.allowance(1064) == window_blocks(WINDOW, 32, 1064, 2 * 256) == 19


def test_a_decoding_request_frees_admission_room_in_the_window_group() -> None:
    """Once a request decodes, its window reserve drops from k steps to k tokens: a
    request refused while the other's prompt steps may be in flight is admitted then."""
    from vllm.v1.request import RequestStatus

    mgr, single, _ = _hybrid(num_blocks=40)  # 39 usable
    mgr.windows.steps_in_flight = 2
    reqs = {}
    for rid in ("a", "b"):
        r = _request(rid, prompt=1000)
        r.max_tokens, r.status = 64, RequestStatus.WAITING
        reqs[rid] = r
    # Full group: 256 tokens of budget (8 blocks) + one 128-token chunk (4); window:
    # cdiv(63 + 2 x 128, 32) + 1 = 11 while the prompt is computed, 4 decoding.
    assert mgr.bound_blocks(reqs["a"]) + mgr.windows.allowance(1064) == 12 + 11
    assert mgr.may_admit(reqs["a"])
    running = {"a": reqs["a"]}
    for i, n in enumerate([128] * 7 + [104, 1, 1]):
        plan = _step_hybrid(mgr, single, running, {"a": n}, new=("a",) if i == 0 else ())
        mgr.apply_reply(plan, _reply(plan, mgr), running)
        if i < 9:  # 39 - a's 12 + 11 (past its prompt: 9 + 11) < 23
            assert not mgr.may_admit(reqs["b"]), i
    st = mgr.states.get("a")
    assert st.tokens == 1002  # two decode steps: its last prompt step is processed
    assert mgr.windows.allowance(st.admitted_total, st.tokens, st.prompt_tokens) == 4
    assert mgr.windows.held("a") <= 4
    assert mgr.may_admit(reqs["b"])  # 39 - (9 + 4) >= 23
    assert mgr.counters.admission_waits == 9


def test_the_self_check_reads_the_window_groups(monkeypatch) -> None:  # noqa: ANN001
    """With the self-check on, what a request holds in its sliding groups is read against
    its allowance after each step: within it while vLLM frees what leaves the window,
    reported once when it holds more."""
    from nexus_vllm.integration.scheduler import admission

    monkeypatch.setenv("NEXUS_VLLM_SELF_CHECK", "1")
    warnings: list[str] = []
    monkeypatch.setattr(admission.logger, "warning",
                        lambda msg, *args: warnings.append(msg % args))
    mgr, single, _ = _hybrid(num_blocks=200)
    sliding = mgr.windows.groups[0].manager
    reqs = {"r": _request("r", prompt=1500)}
    for i, n in enumerate([128] * 11 + [92, 1, 1]):
        plan = _step_hybrid(mgr, single, reqs, {"r": n}, new=("r",) if i == 0 else ())
        mgr.admission.check_pool(reqs)
        mgr.apply_reply(plan, _reply(plan, mgr), reqs)
    assert warnings == [] and mgr.windows.held("r") <= 3  # decoding: cdiv(63 + 1, 32) + 1
    sliding.allocate_new_blocks("r", 1502 + 96, 1502 + 96)  # held past the window
    mgr.admission.check_pool(reqs)
    mgr.admission.check_pool(reqs)
    assert len(warnings) == 1 and "sliding-window groups against an allowance of 3" in \
        warnings[0]


def _burst_through_the_gate(k: int, mode: str, usable: int, gate_k: int | None = None,
                            requests: int = 8, prompt: int = 600, output: int = 40,
                            chunk: int = 64, step: int | None = None) -> int:
    """Most requests running at once when a burst of identical ones goes through the
    plugin's admission over vLLM's real pool and managers, scheduled as the sizer's
    :func:`~nexus_vllm.sizing.simulate_burst` schedules them, each step allocated the
    way vLLM allocates it (the sliding group freed on the processed tokens, with k steps
    in flight), the reply applied before the next step. ``gate_k``: the steps in flight
    admission counts (default k). A step that finds no free block raises ValueError."""
    from collections import deque

    from vllm.v1.request import RequestStatus

    step = step or (128 if mode == "stream" else 256)  # --max-num-batched-tokens
    mgr, single, _ = scheduler_side(usable + 1, window=WINDOW, step_tokens=step,
                                    max_tokens=256, chunk_size=chunk, prompt_mode=mode)
    mgr.windows.steps_in_flight = k if gate_k is None else gate_k
    sliding = mgr.windows.groups[0].manager
    per_step = chunk if evicts_mid_prompt(mgr.server_cfg) else prompt
    waiting = deque(_request(f"r{i}", prompt, max_tokens=output) for i in range(requests))
    for r in waiting:
        r.status, r.outputs = RequestStatus.WAITING, 0
    reqs: dict = {}
    running: list = []
    in_flight: dict[str, list[int]] = {}
    peak, finished = 0, []

    def allocate(r, n: int) -> None:  # noqa: ANN001 - vLLM's allocate_slots, both groups
        rid, done = r.request_id, r.num_computed_tokens
        sliding.remove_skipped_blocks(rid, done - sum(in_flight[rid][len(in_flight[rid]) - k + 1:]))
        sliding.allocate_new_blocks(rid, done + n, done + n)
        single.allocate_new_blocks(rid, done + n, done + n)

    while waiting:
        budget, sched, new = step, {}, []
        for r in running:  # running first, then the waiting ones in order
            if budget <= 0:
                break
            done = r.num_computed_tokens
            n = min(prompt - done, per_step, budget) if done < prompt else 1
            allocate(r, n)
            budget -= n
            sched[r.request_id] = n
        while waiting and budget > 0 and mgr.may_admit(waiting[0]):
            r = waiting.popleft()
            reqs[r.request_id], in_flight[r.request_id] = r, []
            n = min(prompt, per_step, budget)
            allocate(r, n)
            running.append(r)
            budget -= n
            sched[r.request_id] = n
            new.append(r.request_id)
        peak = max(peak, len(running))
        if not sched:
            break  # the first waiting request never fits
        for rid, n in sched.items():
            reqs[rid].num_computed_tokens += n
            in_flight[rid].append(n)
        plan = mgr.plan_step(_output(sched, new=tuple(new), finished=tuple(finished)), reqs)
        mgr.apply_reply(plan, _reply(plan, mgr), reqs)
        finished = []
        for rid in sched:
            r = reqs[rid]
            r.outputs += r.num_computed_tokens >= prompt
            if r.outputs >= output:
                single.free(rid)
                sliding.free(rid)
                finished.append(rid)
        running = [r for r in running if r.request_id not in finished]
    assert mgr.counters.over_budget_peak <= 0
    return peak


# (k, prompt_mode, usable blocks, prompt, output, --max-num-batched-tokens): 8 requests of
# 600 + 40 tokens, and 10 shorter ones whose first decode step may be a step where nobody
# else is admitted (the sizer must not jump past the window reserve's drop there).
BURSTS = [(k, mode, usable, 600, 40, None) for k in (1, 2, 3) for mode in ("stream", "end")
          for usable in (40, 80)] + [(1, "stream", 72, 200, 40, 256),
                                     (1, "end", 75, 200, 20, 512)]


@pytest.mark.parametrize("k, mode, usable, prompt, output, step", BURSTS)
def test_the_sizer_predicts_the_admission_of_a_hybrid_burst(
        k: int, mode: str, usable: int, prompt: int, output: int, step: int | None) -> None:
    """``nexus-vllm size``'s burst (:func:`~nexus_vllm.sizing.simulate_burst`, the window
    groups' allowance by phase and steps in flight) runs as many requests at once as the
    plugin's admission over vLLM's pool, and no step runs out of blocks."""
    from nexus_vllm.core import EvictionConfig
    from nexus_vllm.sizing import simulate_burst

    cfg = EvictionConfig(method="nexus", max_tokens=256, chunk_size=64, prompt_mode=mode,
                         block_size=32)
    requests = 8 if prompt == 600 else 10
    step = step or (128 if mode == "stream" else 256)
    sim = simulate_burst(cfg, usable_blocks=usable, block_size=32, prompt_tokens=prompt,
                         output_tokens=output, requests=requests, max_num_seqs=requests,
                         max_num_batched_tokens=step, windows=[WINDOW], steps_in_flight=k)
    assert _burst_through_the_gate(k, mode, usable, requests=requests, prompt=prompt,
                                   output=output, step=step) == sim.peak_running


def test_a_gate_blind_to_the_steps_in_flight_runs_out_of_blocks() -> None:
    """With two steps in flight, an allowance of one step (the rule before) admits a
    request whose blocks the pool then lacks; counting both, two run and none lacks any."""
    with pytest.raises(ValueError, match="Cannot get .* free blocks"):
        _burst_through_the_gate(2, "end", 54, gate_k=1)
    assert _burst_through_the_gate(2, "end", 54) == 2


@pytest.mark.parametrize("windows, want", [(False, 512), (True, 0)])
def test_a_cut_prefix_hit_is_dropped_whole_with_window_groups(windows, want) -> None:  # noqa: ANN001
    """vLLM 0.32 caps a hit after its lookup: a sliding group's hit holds nulls below
    its window, so a hit cut short is dropped whole there (0 tokens) and cut on the
    multiple elsewhere."""
    from nexus_vllm.integration.compat.vllm_compat import cap_prefix_hits

    kvm = SimpleNamespace(get_computed_blocks=lambda request: ("blocks", 1024, 0),
                          truncate_computed_blocks=lambda blocks, n: ("cut", n))
    cap_prefix_hits(kvm, lambda request: (600, 128), windows=windows)
    _, hit, _ = kvm.get_computed_blocks(_request("r", prompt=2000))
    assert hit == want
