"""The worker's eviction path (plan, compaction, capture, scoring) against vLLM's CPU
attention kernels and the ``core`` oracle. This is the code every backend runs."""

from __future__ import annotations

import math

import pytest
import torch

from tests.integration.conftest import HAS_VLLM
from tests.integration.fakes import (
    BS,
    FakeRunner,
    common_metadata,
    make_state,
    scheduler_output,
    write_keys,
)

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

HKV, HQ, D = 2, 4, 64
PHYS = {"a": [3, 7, 8, 2, 5], "b": [9, 10], "c": [11, 12, 13, 14]}


def _plan(step_id: int, **kw):  # noqa: ANN003, ANN202
    from nexus_vllm.integration.protocol import StepPlan

    return StepPlan(step_id=step_id, **kw)


def _reply(state, step):  # noqa: ANN001, ANN202
    """``step``'s reply as ``NexusWorker`` builds it: scored after the forward, then the
    reply token taken after sampling."""
    return state.reply_token(step, state.finish_forward(step)).reply()


def test_plan_nulls_entries_and_compaction_contract() -> None:
    """Rows become live ids then nulls; lengths, CPU upper bound and max shrink by the
    evicted tokens; outputs are persistent buffers; inputs are never written; the step's
    attention groups share one computation."""
    runner = FakeRunner(PHYS)
    state = make_state(runner)
    step = state.begin_step(scheduler_output(), _plan(1, evict={"a": (1, 2), "c": (1,)}))
    assert runner.table[0, :5].tolist() == [3, 0, 0, 2, 5]
    assert runner.requests["a"].block_ids[0] == [3, 0, 0, 2, 5]
    assert runner.requests["c"].block_ids[0] == [11, 0, 13, 14]
    seq = [4 * BS + 5, 2 * BS, 4 * BS]
    cm = common_metadata(runner, seq, [5, 1, 1])
    table_in, lens_in = cm.block_table_tensor.clone(), cm.seq_lens.clone()
    out = state.compactor.compact(cm)
    assert out.block_table_tensor[0, :5].tolist() == [3, 2, 5, 0, 0]
    assert out.block_table_tensor[1, :3].tolist() == [9, 10, 0]
    assert out.block_table_tensor[2, :4].tolist() == [11, 13, 14, 0]
    want = [seq[0] - 2 * BS, seq[1], seq[2] - BS]
    assert out.seq_lens.tolist() == want
    assert out.seq_lens_cpu_upper_bound.tolist() == want
    assert out.seq_lens_cpu_upper_bound.device.type == "cpu"
    assert out.max_seq_len == max(want) and out._num_computed_tokens_cache is None
    assert torch.equal(cm.block_table_tensor, table_in) and torch.equal(cm.seq_lens, lens_in)
    again = state.compactor.compact(cm)  # another attention group, same step
    assert again.block_table_tensor is out.block_table_tensor
    assert again.seq_lens is out.seq_lens
    ptrs = (out.block_table_tensor.data_ptr(), out.seq_lens.data_ptr())
    state.end_step(step)
    # Next step: the same persistent buffers, rewritten in place.
    step = state.begin_step(scheduler_output(), _plan(2))
    seq2 = [seq[0] + 1, seq[1], seq[2]]  # "a" decodes one token into its partial block
    out2 = state.compactor.compact(common_metadata(runner, seq2, [1, 1, 1]))
    assert (out2.block_table_tensor.data_ptr(), out2.seq_lens.data_ptr()) == ptrs
    assert out2.seq_lens.tolist() == [want[0] + 1, want[1], want[2]]
    state.end_step(step)


def test_batch_without_evictions_is_left_alone() -> None:
    runner = FakeRunner(PHYS)
    state = make_state(runner)
    step = state.begin_step(scheduler_output(), _plan(1))
    cm = common_metadata(runner, [4 * BS + 5, 2 * BS, 4 * BS], [5, 1, 1])
    assert state.compactor.compact(cm) is cm
    state.end_step(step)
    # Disarmed (between steps, warm-up, profiling): a pass-through.
    assert state.compactor.compact(cm) is cm


def test_hooks_never_read_device_values() -> None:
    """Compaction and capture with every device tensor on the ``meta`` device: any host
    read (``.item()``, ``.tolist()``, ``bool(t)``, ``.numpy()``) of one fails here."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if (func is torch.ops.aten._local_scalar_dense.default
                    and args[0].device.type != "cpu"):
                raise AssertionError(f"host read of a device value: {func}")
            return func(*args, **(kwargs or {}))

    runner = FakeRunner(PHYS)
    state = make_state(runner, device="meta", layers={0: torch.empty(0)})
    step = state.begin_step(scheduler_output(new=("b",)),
                     _plan(1, evict={"a": (1, 2)}, track=("a", "b", "c")))
    cm = common_metadata(runner, [4 * BS + 5, 2 * BS, 4 * BS], [5, 1, 1], device="meta")
    with NoScalarReads():
        out = state.compactor.compact(cm)
        state.ring.capture(0, torch.empty(7, HQ * D, device="meta"))
    assert out.block_table_tensor.device.type == "meta"
    assert out.seq_lens_cpu_upper_bound.tolist() == [2 * BS + 5, 2 * BS, 4 * BS]
    capture = state.ring.step_capture
    assert capture is not None and capture.dst is not None and not state.ring.capture_failed
    state.end_step(step)


def _cpu_attention(query, kv, table, lens, qsl):  # noqa: ANN001, ANN202
    from tests.integration.fakes import cpu_ops

    ops = cpu_ops()

    nb = kv.shape[0]
    kc, vc = kv.view(nb, HKV, 2 * BS, D).chunk(2, dim=2)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=lens.shape[0], num_heads=HQ, num_kv_heads=HKV, head_dim=D, seq_lens=lens,
        dtype=torch.float32, query_start_loc=qsl, causal=True, sliding_window_size=-1,
        isa="vec", enable_kv_split=False, dynamic_causal=None, kv_cache_dtype="auto",
    )
    out = torch.zeros(query.shape[0], HQ, D)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
        seq_lens=lens, scale=1.0 / math.sqrt(D), causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=table, softcap=0, scheduler_metadata=meta,
        s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
    )
    return out


@pytest.mark.parametrize("q_len", [1, 3, 37], ids=["decode", "short-chunk", "chunk"])
def test_compacted_attention_equals_attention_over_kept_tokens(q_len) -> None:  # noqa: ANN001
    """vLLM's CPU kernel on the compacted metadata == exact attention over the kept keys,
    for a decode step and prefill chunks (queries at the end, causal)."""
    torch.manual_seed(q_len)
    t = 5 * BS - 7  # last block partial
    phys = [11, 4, 9, 2, 6]
    runner = FakeRunner({"r": phys, "s": [1, 3]})
    state = make_state(runner)
    evicted = [1, 2]  # never the newest blocks
    step = state.begin_step(scheduler_output(), _plan(1, evict={"r": tuple(evicted)}))
    kv = torch.zeros(16, HKV, BS, 2 * D)
    key, val = torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    write_keys(kv, key, val, phys)
    s_len = BS + 5
    key_s, val_s = torch.randn(s_len, HKV, D), torch.randn(s_len, HKV, D)
    write_keys(kv, key_s, val_s, [1, 3])
    cm = state.compactor.compact(common_metadata(runner, [t, s_len], [q_len, 1]))
    query = torch.randn(q_len + 1, HQ, D)
    out = _cpu_attention(query, kv, cm.block_table_tensor, cm.seq_lens,
                         cm.query_start_loc_cpu)
    state.end_step(step)
    keep = torch.cat([torch.arange(j * BS, min((j + 1) * BS, t))
                      for j in range(5) if j not in evicted])
    for i in range(q_len + 1):
        if i < q_len:
            pos, vis, k, v = t - q_len + i, keep, key, val
        else:
            pos, vis, k, v = s_len - 1, torch.arange(s_len), key_s, val_s
        vis = vis[vis <= pos]
        for h in range(HQ):
            kh = h // (HQ // HKV)
            w = torch.softmax(k[vis, kh] @ query[i, h] / math.sqrt(D), dim=0)
            torch.testing.assert_close(out[i, h], w @ v[vis, kh], atol=1e-4, rtol=1e-4)


def test_capture_and_scoring_equal_the_oracle() -> None:
    """Plan -> capture over several steps -> one batched score per layer == the core
    oracle on the live keys, averaged over scored layers, for two requests at once."""
    from nexus_vllm.core import block_attention_mass
    from nexus_vllm.integration.protocol import ScoreRequest
    from nexus_vllm.integration.worker.attention import key_view

    torch.manual_seed(2)
    runner = FakeRunner({"a": PHYS["a"], "b": PHYS["c"]})
    kv = torch.zeros(16, HKV, BS, 2 * D)
    keys = key_view("CPU_ATTN", kv, D, "vec")
    # Layer 0 is skipped (skip_layers=1): only layers 1 and 2 are scored.
    state = make_state(runner, window=8, layers={1: keys, 2: keys})
    t_a, t_b = 4 * BS + 5, 3 * BS + 9
    key_a, key_b = torch.randn(t_a, HKV, D), torch.randn(t_b, HKV, D)
    write_keys(kv, key_a, torch.randn(t_a, HKV, D), PHYS["a"])
    write_keys(kv, key_b, torch.randn(t_b, HKV, D), PHYS["c"])
    queries = {li: torch.randn(t_a + t_b, HQ, D) for li in range(3)}

    def run_step(step_id, ends, starts, plan_kw):  # noqa: ANN001, ANN202
        step = state.begin_step(scheduler_output(new=("a", "b") if step_id == 1 else ()),
                         _plan(step_id, track=("a", "b"), **plan_kw))
        qa = torch.arange(starts[0], ends[0])
        qb = torch.arange(starts[1], ends[1])
        cm = state.compactor.compact(common_metadata(runner, list(ends), [len(qa), len(qb)]))
        assert cm is not None
        for li in range(3):
            q = torch.cat([queries[li][qa], queries[li][t_a + qb]])
            state.ring.capture(li, q.reshape(q.shape[0], HQ * D))
        reply = _reply(state, step)
        state.end_step(step)
        return reply

    # Step 1: prefill chunks up to 3 tokens before the end; nothing due.
    r1 = run_step(1, (t_a - 3, t_b - 1), (0, 0), {})
    assert r1.step_id == 1 and not r1.of("mass")
    # Step 2: the last tokens, with block 1 of "a" evicted; both due (windows 6 and 8).
    sreqs = {"a": ScoreRequest(window=6, num_logical_blocks=5, evictable_below=2),
             "b": ScoreRequest(window=8, num_logical_blocks=4, evictable_below=1)}
    r2 = run_step(2, (t_a, t_b), (t_a - 3, t_b - 1), {"evict": {"a": (1,)}, "score": sreqs})
    assert r2.step_id == 2 and set(r2.of("mass")) == {"a", "b"}
    live_a = torch.cat([key_a[:BS], key_a[2 * BS:]])
    want_a = sum(block_attention_mass(queries[li][t_a - 6: t_a], live_a, BS)
                 for li in (1, 2)) / 2
    want_b = sum(block_attention_mass(queries[li][t_a + t_b - 8: t_a + t_b], key_b, BS)
                 for li in (1, 2)) / 2
    torch.testing.assert_close(torch.from_numpy(r2.of("mass")["a"]), want_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.from_numpy(r2.of("mass")["b"]), want_b, atol=1e-5, rtol=1e-5)
    assert r2.scoring_seconds > 0
    # Finished requests release their slots and bookkeeping.
    step = state.begin_step(scheduler_output(finished=("a",)), _plan(3))
    assert "a" not in state.requests
    state.end_step(step)


def test_missing_plan_masks_what_may_have_been_freed() -> None:
    """Without a usable plan the worker hides every block the scheduler may have freed
    since its last applied plan, for that step only, and never acknowledges."""
    from nexus_vllm.integration.protocol import ScoreRequest

    runner = FakeRunner({"a": [3, 7, 8, 2, 5, 6, 4], "b": [9, 10]})
    state = make_state(runner)
    sreq = ScoreRequest(window=4, num_logical_blocks=7, evictable_below=4)
    step = state.begin_step(scheduler_output(), _plan(1, evict={"a": (1,)}, score={"a": sreq},
                                               sink_blocks=1))
    state.end_step(step)
    # Step 2's plan is lost: blocks 2 and 3 of "a" (1 is known evicted) are masked.
    step = state.begin_step(scheduler_output(), None)
    assert runner.table[0, :7].tolist() == [3, 0, 0, 0, 5, 6, 4]
    cm = state.compactor.compact(common_metadata(runner, [7 * BS, 2 * BS], [1, 1]))
    assert cm.block_table_tensor[0, :4].tolist() == [3, 5, 6, 4]
    assert cm.seq_lens.tolist() == [4 * BS, 2 * BS]
    reply = _reply(state, step)
    assert reply.step_id is None and reply.faults == {"plan_missing": 1}
    state.end_step(step)
    assert runner.table[0, :7].tolist() == [3, 0, 8, 2, 5, 6, 4]  # restored
    assert runner.requests["a"].block_ids[0] == [3, 0, 8, 2, 5, 6, 4]
    # A stale plan (an old step id) is treated the same way.
    step = state.begin_step(scheduler_output(), _plan(1, evict={"a": (1,)}))
    assert runner.table[0, 2] == 0
    assert _reply(state, step).faults == {"plan_stale": 1}
    state.end_step(step)
    # Step 4 arrives (2 and 3 were lost): the resent nulls are applied for good.
    step = state.begin_step(scheduler_output(), _plan(4, evict={"a": (1, 2)}))
    assert runner.table[0, :7].tolist() == [3, 0, 0, 2, 5, 6, 4]
    reply = _reply(state, step)
    assert reply.step_id == 4 and reply.faults == {"plan_gap": 1}
    state.end_step(step)
    assert runner.table[0, :7].tolist() == [3, 0, 0, 2, 5, 6, 4]


def test_reset_requests_ignore_old_nulls() -> None:
    """A resumed request has a fresh block list: nulls addressed to its old one are not
    applied, and its eviction bookkeeping starts over."""
    runner = FakeRunner(PHYS)
    state = make_state(runner)
    step = state.begin_step(scheduler_output(), _plan(1, evict={"a": (1,)}, track=("a",)))
    state.end_step(step)
    req = state.requests.get("a")
    assert req is not None and req.evicted == {1} and req.slot is not None
    runner.requests["a"].block_ids[0] = [20, 21, 22, 23, 24]
    runner.table[0, :5] = [20, 21, 22, 23, 24]
    step = state.begin_step(scheduler_output(resumed=("a",)), _plan(2, evict={"a": (2,)}))
    assert runner.table[0, :5].tolist() == [20, 21, 22, 23, 24]
    assert "a" not in state.requests
    state.end_step(step)


def _state_with_parts(runner: FakeRunner, parts: object,  # noqa: ANN202
                      layers: dict[int, torch.Tensor] | None = None):
    """``fakes.make_state`` with the given ``WorkerParts`` (as ``NexusWorker`` passes
    ``faults.with_doubles(WorkerParts())``)."""
    from nexus_vllm.integration.worker.worker_state import LayerKeys, WorkerEvictionState
    from tests.integration.fakes import adapter

    state = WorkerEvictionState(block_size=BS, window=8, max_requests=4,
                                device=torch.device("cpu"), score_backend="torch",
                                parts=parts)
    layers = layers or {}
    state.allocate_ring(max(1, len(layers)), HQ, D, torch.float32)
    state.bind_layers(adapter(runner), {i: LayerKeys(f"model.layers.{i}.self_attn.attn", k)
                                        for i, k in layers.items()})
    return state


def test_fault_doubles_are_built_only_when_the_env_names_a_worker_fault(monkeypatch) -> None:  # noqa: ANN001
    """``NEXUS_VLLM_FAULTS`` picks the worker's parts: the real ones when it names no
    worker fault, a double for each worker fault it names."""
    import functools

    from nexus_vllm.integration.faults import with_doubles
    from nexus_vllm.integration.testing import worker_doubles
    from nexus_vllm.integration.worker.block_scorer import BlockScorer
    from nexus_vllm.integration.worker.worker_state import PlanCheck, WorkerParts

    monkeypatch.delenv("NEXUS_VLLM_FAULTS", raising=False)
    assert with_doubles(WorkerParts()) == WorkerParts()
    monkeypatch.setenv("NEXUS_VLLM_FAULTS", "policy_error/3,plan_duplicate")
    parts = with_doubles(WorkerParts())
    assert parts.scorer is BlockScorer and parts.plan_check is PlanCheck
    monkeypatch.setenv("NEXUS_VLLM_FAULTS", "score_error@1/5,plan_lost/7")
    parts = with_doubles(WorkerParts())
    assert isinstance(parts.scorer, functools.partial)
    assert parts.scorer.func is worker_doubles.FailingScorer
    assert isinstance(parts.plan_check, functools.partial)
    assert parts.plan_check.func is worker_doubles.LosingPlanCheck
    monkeypatch.setenv("NEXUS_VLLM_FAULTS", "score_eror")
    with pytest.raises(ValueError, match="unknown fault"):
        with_doubles(WorkerParts())


def test_scoring_failure_drops_the_event() -> None:
    """A scorer whose gathering raises (the ``score_error`` double, on rank 0): the event
    is dropped, the plan still acknowledged, the failure counted once."""
    import functools

    from nexus_vllm.integration.protocol import ScoreRequest
    from nexus_vllm.integration.testing.worker_doubles import FailingScorer
    from nexus_vllm.integration.worker.attention import key_view
    from nexus_vllm.integration.worker.worker_state import WorkerParts

    ranks: list[int] = []

    def fires(rank: int) -> bool:
        ranks.append(rank)
        return True

    parts = WorkerParts(scorer=functools.partial(FailingScorer, fires=fires))
    runner = FakeRunner({"a": [3, 7, 8, 2, 5]})
    kv = torch.zeros(16, HKV, BS, 2 * D)
    state = _state_with_parts(runner, parts, layers={0: key_view("CPU_ATTN", kv, D, "vec")})
    sreq = ScoreRequest(window=2, num_logical_blocks=5, evictable_below=1)
    step = state.begin_step(scheduler_output(new=("a",)),
                            _plan(1, track=("a",), score={"a": sreq}))
    state.compactor.compact(common_metadata(runner, [5 * BS], [5 * BS]))
    state.ring.capture(0, torch.randn(5 * BS, HQ, D))
    reply = _reply(state, step)
    state.end_step(step)
    assert ranks == [0]
    assert reply.step_id == 1 and reply.of("mass") == {} and reply.faults == {"score_error": 1}


def test_a_lost_plan_is_masked_for_and_not_acknowledged() -> None:
    """The ``plan_lost`` double drops the step's plan: the worker masks what its last
    applied plan scored, for that step only, counts ``plan_lost`` (not ``plan_missing``)
    and does not acknowledge; the next plan applies as a gap."""
    import functools

    from nexus_vllm.integration.protocol import ScoreRequest
    from nexus_vllm.integration.testing.worker_doubles import LosingPlanCheck
    from nexus_vllm.integration.worker.worker_state import WorkerParts

    lose = iter([False, True, False])
    parts = WorkerParts(plan_check=functools.partial(LosingPlanCheck,
                                                     fires=lambda: next(lose)))
    runner = FakeRunner({"a": [3, 7, 8, 2, 5, 6, 4]})
    state = _state_with_parts(runner, parts)
    sreq = ScoreRequest(window=4, num_logical_blocks=7, evictable_below=4)
    step = state.begin_step(scheduler_output(), _plan(1, evict={"a": (1,)}, score={"a": sreq}))
    assert _reply(state, step).faults == {}
    state.end_step(step)
    step = state.begin_step(scheduler_output(), _plan(2, evict={"a": (1, 2)}))
    assert runner.table[0, :7].tolist() == [3, 0, 0, 0, 5, 6, 4]  # masked, not applied
    reply = _reply(state, step)
    assert reply.step_id is None and reply.faults == {"plan_lost": 1}
    state.end_step(step)
    assert runner.table[0, :7].tolist() == [3, 0, 8, 2, 5, 6, 4] and state.last_step == 1
    step = state.begin_step(scheduler_output(), _plan(3, evict={"a": (1, 2)}))
    reply = _reply(state, step)
    assert reply.step_id == 3 and reply.faults == {"plan_gap": 1}
    state.end_step(step)
    assert runner.table[0, :7].tolist() == [3, 0, 0, 2, 5, 6, 4]


def test_self_check_catches_a_wrong_key_view(monkeypatch) -> None:  # noqa: ANN001
    """With NEXUS_VLLM_SELF_CHECK=1 a key view that does not hold what vLLM wrote raises."""
    from nexus_vllm.integration.worker.attention import key_view
    from nexus_vllm.integration.worker.worker_state import SelfCheckError

    monkeypatch.setenv("NEXUS_VLLM_SELF_CHECK", "1")
    runner = FakeRunner({"a": [3, 7]})
    kv = torch.zeros(16, HKV, BS, 2 * D)
    key = torch.randn(BS + 4, HKV, D)
    write_keys(kv, key, torch.randn(BS + 4, HKV, D), [3, 7])
    good = key_view("CPU_ATTN", kv, D, "vec")
    bad = kv.view(16, HKV, 2 * BS, D)[:, :, BS:, :]  # the values half
    for view, ok in ((good, True), (bad, False)):
        state = make_state(runner, layers={0: view})
        step = state.begin_step(scheduler_output(new=("a",)), _plan(1, track=("a",)))
        cm = common_metadata(runner, [BS + 4], [BS + 4])
        cm.slot_mapping = torch.tensor([3 * BS + t for t in range(BS)]
                                       + [7 * BS + t for t in range(4)])
        state.compactor.compact(cm)
        if ok:
            state.ring.check_keys(0, key)
            assert state.ring.keys_checked == {0}
        else:
            with pytest.raises(SelfCheckError, match="key view"):
                state.ring.check_keys(0, key)
        state.end_step(step)


def test_two_block_tables_in_one_step_are_refused() -> None:
    runner = FakeRunner(PHYS)
    state = make_state(runner)
    step = state.begin_step(scheduler_output(), _plan(1, evict={"a": (1,)}))
    first = common_metadata(runner, [4 * BS + 5, 2 * BS, 4 * BS], [1, 1, 1])
    state.compactor.compact(first)
    with pytest.raises(RuntimeError, match="one KV cache group"):
        state.compactor.compact(common_metadata(runner, [4 * BS + 5, 2 * BS, 4 * BS], [1, 1, 1]))
    state.end_step(step)


def _score_two_requests(kinds: frozenset[str], seed: int, rotary: object = None
                        ) -> tuple[object, dict[str, torch.Tensor], torch.Tensor]:
    """Two requests (5 and 4 blocks) due in one step of a two-request worker, scored for
    ``kinds``: the reply, each request's keys and the captured queries (in batch order)."""
    from nexus_vllm.integration.protocol import ScoreRequest
    from nexus_vllm.integration.worker.attention import key_view

    torch.manual_seed(seed)
    runner = FakeRunner({"a": PHYS["a"], "b": PHYS["c"]})
    kv = torch.zeros(16, HKV, BS, 2 * D)
    keys = {"a": torch.randn(5 * BS, HKV, D), "b": torch.randn(4 * BS, HKV, D)}
    write_keys(kv, keys["a"], torch.randn(5 * BS, HKV, D), PHYS["a"])
    write_keys(kv, keys["b"], torch.randn(4 * BS, HKV, D), PHYS["c"])
    state = make_state(runner, window=4, max_requests=2,
                       layers={0: key_view("CPU_ATTN", kv, D, "vec")})
    state.scorer.rotary = rotary
    lens = {"a": 5 * BS, "b": 4 * BS}
    score = {r: ScoreRequest(window=4, num_logical_blocks=n // BS, evictable_below=1,
                             kinds=kinds) for r, n in lens.items()}
    step = state.begin_step(scheduler_output(new=("a", "b")),
                            _plan(1, track=("a", "b"), score=score))
    state.compactor.compact(common_metadata(runner, list(lens.values()), list(lens.values())))
    queries = torch.randn(sum(lens.values()), HQ, D)
    state.ring.capture(0, queries)
    reply = _reply(state, step)
    state.end_step(step)
    return reply, keys, queries


def test_scoring_every_request_with_mass_and_key_norms_in_one_step() -> None:
    """A Nexus config with ``knorm_prior > 0`` reads mass and key norms, so each request
    due takes a row in both; with every one of ``max_num_seqs`` requests due in one step
    (more than half is enough), the scorer's row staging must still hold them all, or
    the whole step's events are dropped as ``score_error``."""
    from nexus_vllm.core import EvictionConfig

    policy = EvictionConfig(method="nexus", max_tokens=192,
                            policy_args={"knorm_prior": 1.0}).event_policies().decode
    assert policy.needs == {"mass", "key_norms"}
    reply, _, _ = _score_two_requests(frozenset(policy.needs), seed=3)
    assert reply.faults == {}
    assert {r: m.shape for r, m in reply.of("mass").items()} == {"a": (4, 5), "b": (4, 4)}
    assert {r: n.shape for r, n in reply.of("key_norms").items()} == {"a": (5,), "b": (4,)}


def test_expected_attention_through_the_worker_equals_the_dense_gatherer() -> None:
    """Nexus mixing expected attention reads two kinds; the worker's reply carries both,
    and each request's expected attention equals the kind's transformers-path gatherer on
    the same keys and captured queries (their logical positions un-rotated with the
    model's rotary table)."""
    from nexus_vllm.core import EvictionConfig, Rotary, evidence_kind
    from nexus_vllm.core.evidence import DenseLayer, DenseSequence

    policy = EvictionConfig(method="nexus", max_tokens=192,
                            policy_args={"expected": 0.5}).event_policies().decode
    assert policy.needs == {"mass", "expected_attention"}
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    rotary = Rotary.from_inv_freq(inv_freq, 4096, head_size=D)
    reply, keys, queries = _score_two_requests(frozenset(policy.needs), seed=4,
                                               rotary=rotary)
    assert reply.faults == {}
    assert set(reply.of("mass")) == set(reply.of("expected_attention")) == {"a", "b"}
    start = 0
    for req_id, n in {"a": 5 * BS, "b": 4 * BS}.items():
        rows = queries[start + n - 4:start + n]
        start += n
        seq = DenseSequence(layers=[DenseLayer(queries=rows, keys=keys[req_id])],
                            block_size=BS, attention_reduce="mean",
                            query_positions=torch.arange(n - 4, n), next_position=n,
                            rotary=rotary)
        want = evidence_kind("expected_attention").gather_dense(seq)
        torch.testing.assert_close(torch.from_numpy(reply.of("expected_attention")[req_id]),
                                   want, atol=1e-5, rtol=1e-4)


# -- async scheduling: a step's reply is built after the next step has begun ---------------
def _async_output(step_id: int):  # noqa: ANN202
    """A runner's ``AsyncModelRunnerOutput`` of one step."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput

    class Inner(AsyncModelRunnerOutput):
        def get_output(self):  # noqa: ANN202
            return EMPTY_MODEL_RUNNER_OUTPUT

        def get_kv_connector_output(self) -> None:
            return None

    inner = Inner()
    inner.step_id = step_id  # stands for what vLLM reads of the output beyond get_output
    return inner


def test_async_outputs_carry_the_reply_of_their_own_step() -> None:
    """Two steps in flight on one worker: step 2 (both requests scored) ends, step 3 (b
    scored again) begins and scores before vLLM takes step 2's output, in its output
    thread. Each output carries its own step's reply, equal to a run with one step in
    flight: step 2's masses, then step 3's."""
    import threading
    from types import SimpleNamespace

    import numpy as np
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    from nexus_vllm.integration.protocol import ScoreRequest, read_reply
    from nexus_vllm.integration.worker.attention import key_view
    from nexus_vllm.integration.worker.worker import NexusWorker, ReplyingAsyncOutput

    t_a, t_b = 4 * BS + 5, 3 * BS + 9

    def setup():  # noqa: ANN202
        torch.manual_seed(2)
        runner = FakeRunner({"a": PHYS["a"], "b": PHYS["c"]})
        kv = torch.zeros(16, HKV, BS, 2 * D)
        state = make_state(runner, window=8, layers={1: key_view("CPU_ATTN", kv, D, "vec")},
                           steps_in_flight=2)
        write_keys(kv, torch.randn(t_a, HKV, D), torch.randn(t_a, HKV, D), PHYS["a"])
        write_keys(kv, torch.randn(t_b, HKV, D), torch.randn(t_b, HKV, D), PHYS["c"])
        return runner, state, torch.randn(2, t_a + t_b, HQ, D)

    score2 = {"a": ScoreRequest(window=6, num_logical_blocks=5, evictable_below=2),
              "b": ScoreRequest(window=8, num_logical_blocks=4, evictable_below=1)}
    score3 = {"b": ScoreRequest(window=4, num_logical_blocks=4, evictable_below=1)}
    steps = [(1, (t_a - 3, t_b - 2), (0, 0), {}),
             (2, (t_a - 1, t_b - 1), (t_a - 3, t_b - 2), {"score": score2}),
             (3, (t_a, t_b), (t_a - 1, t_b - 1), {"score": score3})]

    def forward(runner, state, queries, step_id, ends, starts, plan):  # noqa: ANN001, ANN202
        step = state.begin_step(scheduler_output(new=("a", "b") if step_id == 1 else ()),
                                _plan(step_id, track=("a", "b"), **plan))
        qa, qb = torch.arange(starts[0], ends[0]), torch.arange(starts[1], ends[1])
        state.compactor.compact(common_metadata(runner, list(ends), [len(qa), len(qb)]))
        for li in (0, 1):
            q = torch.cat([queries[li][qa], queries[li][t_a + qb]])
            state.ring.capture(li, q.reshape(q.shape[0], HQ * D))
        return step, state.finish_forward(step)

    # One step in flight: the reference replies.
    runner, state, queries = setup()
    want = []
    for args in steps:
        step, pending = forward(runner, state, queries, *args)
        want.append(state.reply_token(step, pending).reply())
        state.end_step(step)
    assert set(want[1].of("mass")) == {"a", "b"} and set(want[2].of("mass")) == {"b"}

    # Two in flight: step 3 runs before step 2's output is taken, in another thread.
    runner, state, queries = setup()
    worker = SimpleNamespace(nexus_state=state)
    NexusWorker._reply_on(worker, EMPTY_MODEL_RUNNER_OUTPUT,
                          *forward(runner, state, queries, *steps[0]))
    out2 = NexusWorker._reply_on(worker, _async_output(2),
                                 *forward(runner, state, queries, *steps[1]))
    assert isinstance(out2, ReplyingAsyncOutput) and state.current is None  # step 2 ended
    step3 = forward(runner, state, queries, *steps[2])
    got: dict[int, object] = {}
    taker = threading.Thread(target=lambda: got.update({2: out2.get_output()}))
    taker.start()
    out3 = NexusWorker._reply_on(worker, _async_output(3), *step3)
    taker.join()
    got[3] = out3.get_output()
    assert out2.step_id == 2 and out2.get_kv_connector_output() is None  # the runner's
    for step_id, reference in ((2, want[1]), (3, want[2])):
        reply = read_reply(got[step_id])
        assert reply is not None and reply.step_id == reference.step_id == step_id
        assert set(reply.of("mass")) == set(reference.of("mass"))
        for req_id, mass in reference.of("mass").items():
            np.testing.assert_array_equal(reply.of("mass")[req_id], mass)


def test_a_plan_made_for_another_step_is_not_applied() -> None:
    """With k steps in flight an older plan the worker has not seen (plan 2 arriving with
    step 3's output) lacks the nulls of replies processed since it was made: the worker
    masks as for a missing plan and does not acknowledge it."""
    from nexus_vllm.integration.protocol import ScoreRequest, attach_plan

    runner = FakeRunner({"a": [3, 7, 8, 2, 5, 6, 4]})
    state = make_state(runner, steps_in_flight=2)
    sreq = ScoreRequest(window=4, num_logical_blocks=7, evictable_below=4)
    out = scheduler_output()
    attach_plan(out, _plan(1, score={"a": sreq}))
    state.end_step(state.begin_step(out, _plan(1, score={"a": sreq})))
    out = scheduler_output()
    attach_plan(out, _plan(2), step_id=3)  # plan 2 on step 3's output
    step = state.begin_step(out, _plan(2))
    assert runner.table[0, :7].tolist() == [3, 0, 0, 0, 5, 6, 4]  # masked for this step
    reply = _reply(state, step)
    assert reply.step_id is None and reply.faults == {"plan_stale": 1}
    state.end_step(step)
    assert state.last_step == 1
