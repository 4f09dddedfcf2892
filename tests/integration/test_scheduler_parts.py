"""The scheduler side's parts on their own: the plan channel, the prefix-cache rules, each
request's state and trigger, admission, and the evictor (``EvictionManager`` coordinates
them; ``test_manager.py`` runs them together). What a part keeps per request lives in the
request's ``RequestEvictionState``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nexus_vllm.core.budget import (
    bound_blocks,
    evicts_mid_prompt,
    hard_limit,
    peak_from,
    target_blocks,
)
from tests.integration.conftest import HAS_VLLM
from tests.integration.fakes import BS, engine_request, live_count, scheduler_side

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")


def _cfg(**flags):  # noqa: ANN003, ANN202
    """A streaming server's config (an event after every prompt chunk) unless ``flags``
    say otherwise."""
    from nexus_vllm.integration.frontend.server_config import resolve_config

    return resolve_config(flags={"method": "nexus", "seed": 3, "max_tokens": 256,
                                 "chunk_size": 128, "prompt_mode": "stream", **flags})


def _request(req_id: str, prompt: int, **extra):  # noqa: ANN003, ANN202
    return engine_request(req_id, prompt, **extra)


# -- plan channel ------------------------------------------------------------------------
def _channel(*req_ids: str):  # noqa: ANN202
    """A channel over the states of evicting requests ``req_ids``, and its faults."""
    from nexus_vllm.integration.scheduler.plan_channel import PlanChannel
    from nexus_vllm.integration.scheduler.request_state import RequestStates

    states = RequestStates(_cfg())
    for req_id in req_ids:
        states.resolve(_request(req_id, 600))
    seen: list[str] = []
    return PlanChannel(states, lambda kind, message, **kw: seen.append(kind)), states, seen


def test_channel_resends_nulls_until_a_reply_acknowledges_the_plan_that_carried_them(
) -> None:
    from nexus_vllm.integration.protocol import StepPlan, WorkerReply

    channel, states, faults = _channel("r")
    r = states.get("r")
    assert r is not None
    channel.record(r, [5, 2])
    step1, evict1 = channel.open_step()
    assert (step1, evict1) == (1, {"r": (2, 5)})
    step2, evict2 = channel.open_step()  # plan 1 unanswered: sent again
    assert (step2, evict2) == (2, {"r": (2, 5)})
    channel.record(r, [7])  # nulled after plan 2 was sent
    assert not channel.acknowledge(StepPlan(step_id=2), WorkerReply(step_id=1))
    assert not channel.acknowledge(StepPlan(step_id=2), None)
    assert faults == ["plan_unacknowledged"] * 2 and channel.unacked == {"r": {2: 1, 5: 1,
                                                                               7: 0}}
    assert channel.acknowledge(StepPlan(step_id=2), WorkerReply(step_id=2))
    assert channel.unacked == {"r": {7: 0}}  # 7 rides on the next plan
    step3, evict3 = channel.open_step()
    assert (step3, evict3) == (3, {"r": (7,)})
    assert channel.acknowledge(StepPlan(step_id=3), WorkerReply(step_id=3))
    assert channel.unacked == {} and channel.open_step() == (4, {})


def test_channel_drops_the_nulls_of_a_request_whose_block_list_went() -> None:
    """Its nulls are part of the request's state: gone when it finishes, cleared when
    it restarts with a fresh block list."""
    channel, states, _ = _channel("a", "b", "c")
    for req_id, j in (("a", 1), ("b", 3), ("c", 4)):
        st = states.get(req_id)
        assert st is not None
        channel.record(st, [j])
    states.finish("a")
    states.restart("c")
    states.finish("gone")  # unknown: nothing to do
    assert channel.open_step() == (1, {"b": (3,)})


# -- prefix cache ------------------------------------------------------------------------
@pytest.mark.parametrize("flags, prompt, want", [
    # stream, budget 8 blocks: the chunk ending at 384 (12 blocks) has the first event;
    # a hit may end at its start, 256 (a multiple of lcm(chunk 128, block 32) = 128).
    ({}, 1000, (256, 128)),
    # ... and early enough that the event's window (the newest prompt_window = 32
    # queries) is computed in this run: a 14-token last chunk (256..270) needs rows of
    # the chunk before it, so the hit ends a chunk earlier.
    ({}, 270, (128, 128)),
    ({"prompt_mode": "keep"}, 1000, None),   # no event during the prompt
    ({}, 200, None),                         # the prompt fits the budget
    ({"chunk_size": 96}, 1000, (192, 96)),   # 9 blocks > 8 after the chunk 192..288
    # end (the default): only the prompt's end fires, so any block boundary before its
    # 32-row window will do, whatever the chunking.
    ({"prompt_mode": "end"}, 1000, (960, 32)),
])
def test_prefix_hit_cap_ends_before_the_first_event(flags, prompt, want) -> None:  # noqa: ANN001
    from nexus_vllm.core import cdiv
    from nexus_vllm.integration.scheduler.prefix_cache import prefix_hit_cap

    cfg = _cfg(**flags)
    rule = prefix_hit_cap(cfg, prompt, BS)
    assert rule == want
    if rule is not None:
        # The chunk after the cap never leaves the request over its target; the cap's
        # chunk boundary is at most the first event's chunk start.
        limit, multiple = rule
        assert limit % BS == 0 and limit % multiple == 0
        assert cdiv(limit, BS) <= int(target_blocks(cfg, limit, prompt))
        if evicts_mid_prompt(cfg):
            assert limit % int(cfg.chunk_size) == 0


def test_clean_watermark_is_the_first_eviction_until_a_restart() -> None:
    from nexus_vllm.integration.scheduler.prefix_cache import mark_first_eviction
    from nexus_vllm.integration.scheduler.request_state import RequestEvictionState

    st = RequestEvictionState(req_id="r", cfg=_cfg(), seed=0, prompt_tokens=1000)
    assert st.clean_watermark is None
    mark_first_eviction(st, 384)
    mark_first_eviction(st, 512)  # later evictions do not move it
    assert st.clean_watermark == 384
    st.restart()
    assert st.clean_watermark is None


# -- request state -----------------------------------------------------------------------
def test_request_states_resolve_once_with_overrides_opt_out_and_fallback() -> None:
    from nexus_vllm.integration.scheduler.request_state import RequestStates

    states = RequestStates(_cfg())
    assert states.get("a") is None  # never seen
    a = states.resolve(_request("a", 600, kv_eviction="h2o", kv_budget=192))
    assert a is not None and a.cfg.method == "h2o" and a.cfg.max_tokens == 192
    assert states.resolve(_request("a", 600)) is a  # resolved once, on first sight
    assert states.resolve(_request("off", 600, kv_eviction="none")) is None
    # Bad values from a request built outside the API server: the server's config.
    bad = states.resolve(_request("bad", 600, kv_budget="lots"))
    assert bad is not None and bad.cfg is states.server_cfg
    assert sorted(r for r, _ in states.items()) == ["a", "bad"]
    states.finish("a")
    assert states.get("a") is None


def test_request_peaks_and_admission_survive_a_restart_and_the_rest_does_not() -> None:
    from nexus_vllm.integration.scheduler.request_state import RequestStates

    states = RequestStates(_cfg())
    st = states.resolve(_request("r", 1000, kv_prompt_mode="end"))
    assert st is not None
    st.plan_event(128, 128, list(range(4)), BS)
    st.plan_event(256, 128, list(range(8)), BS)
    st.admitted_total, st.clean_watermark, st.unacked = 1064, 256, {3: 1}
    st.policy_state["seen"] = 1
    draw = torch.rand(4, generator=st.generator)
    states.restart("r")  # preempted: recomputes from token 0, keeps its peak
    assert st.tokens == 0 and st.peak_live_blocks == 8 and st.admitted_total == 1064
    assert st.clean_watermark is None and st.unacked == {} and st.policy_state == {}
    assert torch.equal(torch.rand(4, generator=st.generator), draw)  # the same draws
    assert states.take_peaks(["r", "unknown"]) == [("end", 8)]
    assert states.take_peaks(["r"]) == []


def test_trigger_fires_after_the_chunk_that_goes_over_budget() -> None:
    """Stream mode, budget 8 blocks, chunk 128: the event follows the chunk ending at 384
    (12 live blocks); it scores the newest prefill window and may evict up to the newest
    ``recent_blocks + 1`` live blocks."""
    from nexus_vllm.integration.scheduler.request_state import RequestEvictionState

    cfg = _cfg()
    st = RequestEvictionState(req_id="r", cfg=cfg, seed=0, prompt_tokens=1000)
    assert st.plan_event(128, 128, list(range(4)), BS) is None
    assert st.plan_event(256, 128, list(range(8)), BS) is None
    live = list(range(12))
    sreq = st.plan_event(384, 128, live, BS)
    assert sreq is not None and sreq.prefill and sreq.num_logical_blocks == 12
    assert sreq.window == cfg.event_policies(1000).prefill.window(int(cfg.prompt_window))
    assert sreq.evictable_below == live[-(int(cfg.recent_blocks) + 1)]
    assert st.tokens == 384 and st.peak_live_blocks == 12


def test_a_recompute_chunk_past_the_prompt_is_bounded_and_counted_as_decode() -> None:
    """A resumed request's chunk that runs past its prompt's end: its hard limit is the
    prompt's, and the generated tokens in it count toward the decode interval."""
    from nexus_vllm.integration.scheduler.request_state import RequestEvictionState

    cfg = _cfg(prompt_mode="end")
    st = RequestEvictionState(req_id="r", cfg=cfg, seed=0, prompt_tokens=1000)
    assert st.hard_limit(1024, 128) == hard_limit(cfg, 1000, 1000)
    assert st.hard_limit(1025, 1) == hard_limit(cfg, 1025, 1000)
    for end in range(128, 1024, 128):
        st.plan_event(end, 128, list(range(end // BS)), BS)
    sreq = st.plan_event(1024, 128, list(range(32)), BS)
    assert sreq is not None and sreq.prefill  # the prompt-end event
    assert st.trigger.decode_tokens == 24


# -- live blocks ---------------------------------------------------------------------------
def _read_live(single, req_id: str, num_blocks: int | None = None) -> list[int]:  # noqa: ANN001
    """The live entries as a read of the whole list finds them (the reference)."""
    blocks = single.req_to_blocks.get(req_id, [])[:num_blocks]
    return [j for j, b in enumerate(blocks) if not b.is_null]


def test_live_blocks_answer_what_reading_the_whole_list_answers() -> None:
    """After every change (vLLM appending blocks, evictions, a request preempted and
    resumed on a new list), the kept live blocks equal a read of the list."""
    import random

    mgr, single, _ = scheduler_side(600, max_tokens=256, chunk_size=128)
    rng = random.Random(0)
    tokens = {f"r{i}": 0 for i in range(4)}
    for req_id in tokens:
        mgr.states.resolve(_request(req_id, 1000))
    for _ in range(300):
        req_id = rng.choice(sorted(tokens))
        st = mgr.states.get(req_id)
        assert st is not None
        action = rng.random()
        if action < 0.05 and tokens[req_id]:  # preempted: vLLM frees the whole list
            single.free(req_id)
            tokens[req_id] = 0
        elif action < 0.1 and not tokens[req_id]:  # resumed on a new list
            mgr.states.restart(req_id)
        elif action < 0.6:
            tokens[req_id] += rng.randint(1, 3 * BS)
            single.allocate_new_blocks(req_id, tokens[req_id], tokens[req_id])
        elif tokens[req_id]:
            live = list(mgr.blocks.live_indices(st))
            drop = rng.sample(live, k=min(len(live), rng.randint(0, 3)))
            mgr.blocks.evict(st, sorted(drop))
        cut = rng.choice([None, rng.randint(0, 40)])
        assert list(mgr.blocks.live_indices(st, cut)) == _read_live(single, req_id, cut)
        assert mgr.blocks.live_count(st, cut) == len(_read_live(single, req_id, cut))
    for req_id in tokens:
        single.free(req_id)


def test_live_blocks_read_only_the_entries_appended_since_the_last_step(
        monkeypatch) -> None:  # noqa: ANN001
    """A long list is read once; after that each step reads the entries vLLM appended,
    however long the request is (a full read would take the whole list every step)."""
    from nexus_vllm.integration.compat.vllm_compat import BlockPoolView

    mgr, single, _ = scheduler_side(600, max_tokens=256, chunk_size=128)
    st = mgr.states.resolve(_request("r", 16_000))
    assert st is not None
    single.allocate_new_blocks("r", 400 * BS, 400 * BS)
    mgr.blocks.evict(st, list(range(1, 380)))  # mostly null, as a long request is
    reads: list[int] = []
    is_null = BlockPoolView.is_null
    monkeypatch.setattr(BlockPoolView, "is_null",
                        staticmethod(lambda b: reads.append(1) or is_null(b)))
    assert mgr.blocks.live_count(st) == 21 and len(reads) == 0  # read at the eviction
    for step in range(1, 11):
        single.allocate_new_blocks("r", (400 + step) * BS, (400 + step) * BS)
        assert mgr.blocks.live_count(st) == 21 + step
        assert list(mgr.blocks.live_indices(st))[-1] == 399 + step
    assert len(reads) == 10
    single.free("r")


# -- admission -----------------------------------------------------------------------------
class _Blocks:
    """A stand-in for ``LiveBlocks``: live blocks per request, and a free count."""

    def __init__(self, live: dict[str, int], free: int) -> None:
        self.live = live
        self.pool = SimpleNamespace(num_free=lambda: free)

    def of(self, req_id: str) -> list[int]:
        return list(range(self.live.get(req_id, 0)))

    def live_count(self, st, num_blocks: int | None = None) -> int:  # noqa: ANN001
        return self.live.get(st.req_id, 0)


@pytest.mark.parametrize("spare, admitted", [(0, True), (-1, False)])
def test_admission_reserves_what_admitted_requests_may_still_grow_to(spare, admitted
                                                                     ) -> None:  # noqa: ANN001
    from nexus_vllm.integration.metrics import SchedulerCounters
    from nexus_vllm.integration.scheduler.admission import AdmissionGate
    from nexus_vllm.integration.scheduler.request_state import RequestStates

    states, counters = RequestStates(_cfg()), SchedulerCounters()
    first, second = _request("a", 1000), _request("b", 1000)
    # "a" was admitted and has run to 256 tokens, holding 8 blocks.
    gate = AdmissionGate(states, _Blocks({"a": 8}, free=100), counters)
    assert gate.may_admit(first)
    st = states.get("a")
    assert st is not None
    st.tokens = 256
    outstanding = int(peak_from(st.cfg, 256, 1000, 1064)) - 8
    need = gate.bound_blocks(second)
    assert need is not None and outstanding > 0
    gate.blocks = _Blocks({"a": 8}, free=need + outstanding + spare)
    assert gate.may_admit(second) is admitted
    assert counters.admission_waits == (0 if admitted else 1)
    b = states.get("b")
    assert b is not None and (b.admitted_total is not None) is admitted


def test_admission_bound_stops_at_max_model_len() -> None:
    from nexus_vllm.integration.metrics import SchedulerCounters
    from nexus_vllm.integration.scheduler.admission import AdmissionGate
    from nexus_vllm.integration.scheduler.request_state import RequestStates

    states = RequestStates(_cfg(prompt_mode="keep"))
    gate = AdmissionGate(states, _Blocks({}, free=0), SchedulerCounters(), max_model_len=1010)
    r = _request("r", 1000)
    st = states.resolve(r)
    assert st is not None and gate.total_tokens(st, r) == 1010
    assert gate.bound_blocks(r) == bound_blocks(st.cfg, 1000, 1010)
    assert gate.bound_blocks(_request("off", 1000, kv_eviction="none")) is None


# -- evictor ---------------------------------------------------------------------------
def _scored(method: str, **flags):  # noqa: ANN003, ANN202
    """A manager whose request "r" (600-token prompt) was just scored at 512 tokens."""
    mgr, single, pool = scheduler_side(64, max_tokens=256, chunk_size=128, method=method,
                                       **flags)
    r = _request("r", 600)
    single.allocate_new_blocks("r", 512, 512)
    r.num_computed_tokens = 512
    out = SimpleNamespace(finished_req_ids=set(), num_scheduled_tokens={"r": 512},
                          scheduled_new_reqs=[SimpleNamespace(req_id="r")],
                          scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()))
    plan = mgr.plan_step(out, {"r": r})
    assert "r" in plan.score
    return mgr, pool, plan, {"r": r}


def test_evictor_runs_a_scoreless_policy_without_masses() -> None:
    """Streaming reads no mass: the worker sends none and the policy still evicts down to
    the budget, the nulls going to the channel and the watermark set."""
    from nexus_vllm.integration.protocol import WorkerReply

    mgr, pool, plan, reqs = _scored("streaming")
    assert not plan.score["r"].kinds
    free = pool.get_num_free_blocks()
    mgr.evictor.apply(plan, WorkerReply(step_id=plan.step_id), reqs)
    assert live_count(mgr, "r") == 8
    nulled = sorted(mgr.channel.unacked["r"])
    assert pool.get_num_free_blocks() - free == len(nulled) == 16 - 8
    # Streaming keeps the sinks and the newest blocks: the oldest non-sinks go.
    sinks = int(mgr.server_cfg.sink_blocks)
    assert nulled == list(range(sinks, sinks + 8))
    assert mgr.caching_limit(reqs["r"]) == 512
    assert mgr.counters.eviction_events == 1 and mgr.counters.evicted_blocks == 8


def test_evictor_frees_nothing_when_the_policy_fails(monkeypatch) -> None:  # noqa: ANN001
    from nexus_vllm.core.policies import StreamingPolicy
    from nexus_vllm.integration.protocol import WorkerReply

    def fail(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("policy bug")

    mgr, pool, plan, reqs = _scored("streaming")
    monkeypatch.setattr(StreamingPolicy, "select", fail)
    free = pool.get_num_free_blocks()
    mgr.evictor.apply(plan, WorkerReply(step_id=plan.step_id), reqs)
    assert pool.get_num_free_blocks() == free and live_count(mgr, "r") == 16
    assert mgr.channel.unacked == {} and mgr.caching_limit(reqs["r"]) is None
    assert mgr.counters.faults["policy_error"] == 1


def test_failing_evictor_is_absorbed_as_a_policy_error() -> None:
    """``scheduler_doubles.FailingEvictor`` (``NEXUS_VLLM_FAULTS=policy_error``): a firing
    event raises before anything is freed and the evictor counts it; otherwise the real
    event runs."""
    from nexus_vllm.integration.protocol import WorkerReply
    from nexus_vllm.integration.testing.scheduler_doubles import FailingEvictor

    mgr, pool, plan, reqs = _scored("streaming")
    fire = [True, False]
    double = FailingEvictor(states=mgr.states, blocks=mgr.blocks, channel=mgr.channel,
                            counters=mgr.counters, fault=mgr.fault,
                            fires=lambda: fire.pop(0))
    free = pool.get_num_free_blocks()
    double.apply(plan, WorkerReply(step_id=plan.step_id), reqs)
    assert pool.get_num_free_blocks() == free and mgr.channel.unacked == {}
    assert mgr.counters.faults["policy_error"] == 1
    double.apply(plan, WorkerReply(step_id=plan.step_id), reqs)
    assert live_count(mgr, "r") == 8 and mgr.counters.eviction_events == 1


def test_duplicating_sender_sends_the_previous_plan() -> None:
    """``scheduler_doubles.DuplicatingSender`` (``NEXUS_VLLM_FAULTS=plan_duplicate``): a
    firing step carries the previous plan, stamped with its own step id (which is how
    the worker tells it is not the step's plan)."""
    from nexus_vllm.integration.protocol import StepPlan, read_plan, read_step
    from nexus_vllm.integration.testing.scheduler_doubles import DuplicatingSender

    fire = iter([True, False, True])  # not asked for the first plan: none before it
    sender = DuplicatingSender(fires=lambda: next(fire))
    outs = [SimpleNamespace() for _ in range(4)]
    for i, out in enumerate(outs, start=1):
        sender.send(out, StepPlan(step_id=i))
    assert [read_plan(o).step_id for o in outs] == [1, 1, 3, 3]  # type: ignore[union-attr]
    assert [read_step(o) for o in outs] == [1, 2, 3, 4]


def test_evictor_skips_a_request_whose_evidence_the_worker_dropped() -> None:
    from nexus_vllm.integration.protocol import WorkerReply

    mgr, pool, plan, reqs = _scored("knorm")
    assert "key_norms" in plan.score["r"].kinds
    free = pool.get_num_free_blocks()
    mgr.evictor.apply(plan, WorkerReply(step_id=plan.step_id), reqs)  # no key norms
    assert pool.get_num_free_blocks() == free and mgr.channel.unacked == {}
    norms = torch.linspace(1.0, 2.0, 16).numpy()
    mgr.evictor.apply(plan, WorkerReply(step_id=plan.step_id, evidence={"key_norms": {"r": norms}}), reqs)
    assert live_count(mgr, "r") == 8


def test_evictor_reads_rows_of_maxima_as_softmax_gave_them() -> None:
    """Under attention_reduce max the worker sends rows of maxima over heads and layers; the
    evictor keeps their totals, so a block's best share is the one softmax gave (blocks
    1-4) and not the share after its row was renormalised (which would keep 5-8)."""
    from nexus_vllm.integration.protocol import WorkerReply

    # The window's attention alone (not the stream defaults' mix): this is about the mass.
    mgr, _, plan, reqs = _scored(
        "nexus", attention_reduce="max", carry=0, policy_args={"expected": 0, "knorm_prior": 0},
        prefill_args={"direct": "max", "indirect": "none", "sampler": "topk"})
    rows = torch.zeros(plan.score["r"].window, 16)
    # Row 0's heads disagree (its maxima sum past 3): one reads blocks 1-4 at 0.30 each.
    rows[0, 1:5], rows[0, 5:13] = 0.30, 0.25
    # Row 1's heads agree on blocks 5-8 at 0.20 each: its 0.20 beats row 0's 0.30 only
    # once row 0 is divided by its total.
    rows[1, 5:9], rows[1, 0] = 0.20, 0.20
    mgr.evictor.apply(plan, WorkerReply(step_id=plan.step_id,
                                        evidence={"mass": {"r": rows.numpy()}}), reqs)
    sinks, forced_recent = int(mgr.server_cfg.sink_blocks), [13, 14, 15]
    assert live_count(mgr, "r") == 8
    kept = sorted(set(range(16)) - set(mgr.channel.unacked["r"]))
    assert kept == [*range(sinks), 1, 2, 3, 4, *forced_recent]
