"""Scoring across pipeline stages and tensor-parallel ranks with real gloo process groups.

Each test starts one process per rank (``torch.distributed`` with gloo on CPU), gives
every rank the layers (pipeline parallelism) and heads (tensor parallelism) it would hold
in a server, and runs the worker's eviction state on the same plans: the masses the
output rank (TP rank 0 of the last stage) reports must be the ``core`` oracle's mean over
every scored layer and every head, exactly what one rank holding the whole model reports;
every rank must apply the same plan to its own block table; and a scoring failure on one
rank must drop the event on all of them without a deadlock.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import queue
import tempfile
from typing import Any

import pytest
import torch

from tests.integration.conftest import HAS_VLLM

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

HKV, HQ, D = 2, 4, 64
NUM_LAYERS = 4
PHYS = {"a": [3, 7, 8, 2, 5], "b": [11, 12, 13, 14]}
T_A, T_B = 4 * 32 + 5, 3 * 32 + 9
# A rank that neither finishes nor fails within this many seconds is deadlocked.
JOIN_TIMEOUT_S = 180


def _layers_of_stage(pp_rank: int, pp_size: int) -> range:
    """vLLM's even split of the decoder layers over stages."""
    per = NUM_LAYERS // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def _rank_main(rank: int, tp_size: int, pp_size: int, skip_layers: int, fault: str,
               attention_reduce: str, init_file: str, results: Any,
               first_stage_done: Any = None) -> None:
    """One rank: build its share of the model, run two steps, report what it saw. With
    ``first_stage_done`` (an event), the later stages start only once stage 0 has run
    both steps."""
    if fault:
        os.environ["NEXUS_VLLM_FAULTS"] = fault
    import torch.distributed as dist

    from nexus_vllm.core import EvictionConfig
    from nexus_vllm.integration.compat.vllm_compat import StageLink
    from nexus_vllm.integration.faults import with_doubles
    from nexus_vllm.integration.protocol import ScoreRequest, StepPlan
    from nexus_vllm.integration.worker.attention import key_view
    from nexus_vllm.integration.worker.wire import RankLayout
    from nexus_vllm.integration.worker.worker_state import (
        LayerKeys,
        WorkerEvictionState,
        WorkerParts,
    )
    from tests.integration.fakes import (
        BS,
        FakeRunner,
        adapter,
        common_metadata,
        scheduler_output,
        write_keys,
    )

    world = tp_size * pp_size
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    # vLLM's layout inside one engine: stage-major, TP rank within a stage.
    tp_groups = [dist.new_group([p * tp_size + t for t in range(tp_size)])
                 for p in range(pp_size)]
    pp_ranks = [[p * tp_size + t for p in range(pp_size)] for t in range(tp_size)]
    pp_groups = [dist.new_group(ranks) for ranks in pp_ranks]
    layout = RankLayout(tp_rank=rank % tp_size, tp_size=tp_size, pp_rank=rank // tp_size,
                        pp_size=pp_size)

    def reduced(group: Any) -> Any:
        def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
            out = t.clone()
            dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op],
                            group=group)
            return out
        return reduce

    # The same model on every rank (same seed); each keeps its layers and heads.
    torch.manual_seed(2)
    key_a, key_b = torch.randn(T_A, HKV, D), torch.randn(T_B, HKV, D)
    val_a, val_b = torch.randn(T_A, HKV, D), torch.randn(T_B, HKV, D)
    queries = {li: torch.randn(T_A + T_B, HQ, D) for li in range(NUM_LAYERS)}
    hkv, hq = HKV // tp_size, HQ // tp_size
    kv_heads = slice(layout.tp_rank * hkv, (layout.tp_rank + 1) * hkv)
    q_heads = slice(layout.tp_rank * hq, (layout.tp_rank + 1) * hq)

    cfg = EvictionConfig(skip_layers=skip_layers)
    model_scored = cfg.scored_layers(NUM_LAYERS)
    local = [li for li in _layers_of_stage(layout.pp_rank, pp_size) if li in model_scored]
    runner = FakeRunner({"a": PHYS["a"], "b": PHYS["b"]})
    layer_keys = {}
    for li in local:
        kv = torch.zeros(16, hkv, BS, 2 * D)
        write_keys(kv, key_a[:, kv_heads], val_a[:, kv_heads], PHYS["a"])
        write_keys(kv, key_b[:, kv_heads], val_b[:, kv_heads], PHYS["b"])
        layer_keys[li] = LayerKeys(f"model.layers.{li}.self_attn.attn",
                                   key_view("CPU_ATTN", kv, D, "vec"))
    # The stages' parts travel to the last stage on a group of their own, as in a server.
    stages = StageLink(pp_groups[layout.tp_rank], pp_ranks[layout.tp_rank])
    state = WorkerEvictionState(block_size=BS, window=8, max_requests=4,
                                device=torch.device("cpu"), score_backend="torch",
                                layout=layout, scored_layers=len(model_scored),
                                attention_reduce=attention_reduce, stages=stages,
                                parts=with_doubles(WorkerParts()))
    state.scorer._tp_reduce = reduced(tp_groups[layout.pp_rank])
    state.allocate_ring(len(local), hq, D, torch.float32)
    state.bind_layers(adapter(runner), layer_keys)

    def run_step(step_id: int, ends: tuple[int, int], starts: tuple[int, int],
                 **plan: Any) -> Any:
        step = state.begin_step(scheduler_output(new=("a", "b") if step_id == 1 else ()),
                         StepPlan(step_id=step_id, track=("a", "b"), **plan))
        qa, qb = torch.arange(starts[0], ends[0]), torch.arange(starts[1], ends[1])
        state.compactor.compact(common_metadata(runner, list(ends), [len(qa), len(qb)]))
        for li in _layers_of_stage(layout.pp_rank, pp_size):  # every layer it holds
            q = torch.cat([queries[li][qa], queries[li][T_A + qb]])[:, q_heads]
            state.ring.capture(li, q.reshape(q.shape[0], hq * D))
        # As NexusWorker: scored after the forward, the reply token taken after sampling.
        pending = state.finish_forward(step)
        reply = state.reply_token(step, pending).reply()
        state.end_step(step)
        return reply

    if first_stage_done is not None and layout.pp_rank > 0:
        assert first_stage_done.wait(JOIN_TIMEOUT_S), "stage 0 waited for a later stage"
    run_step(1, (T_A - 3, T_B - 1), (0, 0))
    sreqs = {"a": ScoreRequest(window=6, num_logical_blocks=5, evictable_below=2),
             "b": ScoreRequest(window=8, num_logical_blocks=4, evictable_below=1)}
    reply = run_step(2, (T_A, T_B), (T_A - 3, T_B - 1), evict={"a": (1,)}, score=sreqs)
    if first_stage_done is not None and layout.pp_rank == 0:
        first_stage_done.set()
    dist.barrier()
    results.put((rank, {"output": layout.is_output, "local": local,
                        "masses": {k: v.tolist() for k, v in reply.of("mass").items()},
                        "faults": dict(reply.faults), "step_id": reply.step_id,
                        "table_a": runner.table[0, :5].tolist()}))
    dist.destroy_process_group()


def _run_ranks(tp_size: int, pp_size: int, *, skip_layers: int = 1, fault: str = "",
               attention_reduce: str = "mean",
               first_stage_alone: bool = False) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    first_stage_done = ctx.Event() if first_stage_alone else None
    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(pathlib.Path(tmp) / "gloo_init")
        procs = [ctx.Process(target=_rank_main, args=(r, tp_size, pp_size, skip_layers,
                                                      fault, attention_reduce, init_file, results,
                                                      first_stage_done))
                 for r in range(tp_size * pp_size)]
        for p in procs:
            p.start()
        out: dict[int, dict[str, Any]] = {}
        try:
            for _ in procs:
                rank, seen = results.get(timeout=JOIN_TIMEOUT_S)
                out[rank] = seen
        except queue.Empty:
            pytest.fail(f"ranks {sorted(set(range(len(procs))) - set(out))} never "
                        f"finished: a deadlock across ranks")
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return out


def _oracle(skip_layers: int, attention_reduce: str = "mean") -> dict[str, torch.Tensor]:
    """What one rank holding every layer and head reports (the ``core`` oracle)."""
    from nexus_vllm.core import block_attention_mass, combine_layer_masses

    torch.manual_seed(2)
    key_a, key_b = torch.randn(T_A, HKV, D), torch.randn(T_B, HKV, D)
    torch.randn(T_A, HKV, D), torch.randn(T_B, HKV, D)  # the values, same draw order
    queries = {li: torch.randn(T_A + T_B, HQ, D) for li in range(NUM_LAYERS)}
    scored = range(skip_layers, NUM_LAYERS)
    live_a = torch.cat([key_a[:32], key_a[64:]])  # block 1 of "a" evicted
    rows = {"a": (queries, T_A - 6, T_A, live_a), "b": (queries, T_A + T_B - 8, T_A + T_B,
                                                          key_b)}
    return {req: combine_layer_masses(
        [block_attention_mass(q[li][lo:hi], keys, 32, attention_reduce=attention_reduce)
         for li in scored], attention_reduce) for req, (q, lo, hi, keys) in rows.items()}


def _check_output_rank_matches_oracle(out: dict[int, dict[str, Any]],
                                      skip_layers: int, attention_reduce: str = "mean") -> None:
    want = _oracle(skip_layers, attention_reduce)
    assert sum(seen["output"] for seen in out.values()) == 1
    for rank, seen in out.items():
        # Every rank applied the same plan to its own block table.
        assert seen["step_id"] == 2 and seen["table_a"] == [3, 0, 8, 2, 5]
        if not seen["output"]:
            assert seen["masses"] == {}, rank  # only the output rank replies with scores
            continue
        assert set(seen["masses"]) == {"a", "b"}
        for req_id, mass in want.items():
            torch.testing.assert_close(torch.tensor(seen["masses"][req_id]), mass,
                                       atol=1e-5, rtol=1e-5)


def test_two_stages_report_the_one_rank_masses() -> None:
    """PP=2: stage 0 scores layer 1, stage 1 layers 2 and 3; the last stage reports the
    mean over all three, as one rank would."""
    out = _run_ranks(tp_size=1, pp_size=2)
    assert out[0]["local"] == [1] and out[1]["local"] == [2, 3]
    assert not out[0]["output"] and out[1]["output"]
    _check_output_rank_matches_oracle(out, skip_layers=1)


def test_the_first_stage_never_waits_for_the_last() -> None:
    """No barrier across the pipeline: stage 0 scores both steps and sends its parts
    before stage 1 has started its first step (an all-reduce over the stages would hang
    stage 0 at the scored step); stage 1 then adds them up to the one-rank masses."""
    out = _run_ranks(tp_size=1, pp_size=2, first_stage_alone=True)
    _check_output_rank_matches_oracle(out, skip_layers=1)


def test_a_stage_without_scored_layers_still_joins() -> None:
    """skip_layers=2 leaves stage 0 nothing to score: it adds zeros to the sum and the
    mean is over the scored layers of stage 1 only."""
    out = _run_ranks(tp_size=1, pp_size=2, skip_layers=2)
    assert out[0]["local"] == [] and out[1]["local"] == [2, 3]
    _check_output_rank_matches_oracle(out, skip_layers=2)


def test_two_stages_of_two_tensor_parallel_ranks() -> None:
    """TP=2 x PP=2 (four ranks, each with half the heads of half the layers): the
    output rank is TP rank 0 of the last stage (rank 2) and reports the oracle's mean."""
    out = _run_ranks(tp_size=2, pp_size=2)
    assert [r for r, seen in out.items() if seen["output"]] == [2]
    _check_output_rank_matches_oracle(out, skip_layers=1)


def test_head_max_over_two_stages_of_two_tensor_parallel_ranks() -> None:
    """attention_reduce max, TP=2 x PP=2: each rank's maximum over its heads and layers,
    reduced by max over the ranks (the key norms and the flag still summed), is the
    oracle's maximum over every head and layer, renormalised."""
    out = _run_ranks(tp_size=2, pp_size=2, attention_reduce="max")
    _check_output_rank_matches_oracle(out, skip_layers=1, attention_reduce="max")


def test_scoring_failure_on_one_stage_drops_the_event_everywhere() -> None:
    """Rank 0 (stage 0) fails to score: no deadlock, every rank still applied the plan,
    and the output rank reports no masses and the peer's failure."""
    out = _run_ranks(tp_size=1, pp_size=2, fault="score_error@0")
    assert out[0]["faults"] == {"score_error": 1} and out[0]["masses"] == {}
    assert out[1]["masses"] == {}
    assert out[1]["faults"] == {"score_error_peer": 1}
    assert all(seen["step_id"] == 2 and seen["table_a"] == [3, 0, 8, 2, 5]
               for seen in out.values())
