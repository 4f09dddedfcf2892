"""Scheduler-side eviction against vLLM's real block pool and full-attention manager."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.integration.conftest import HAS_VLLM

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

BS = 32


def _setup(num_blocks: int = 64, budget: int = 256, chunk: int = 128):  # noqa: ANN202
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from nexus_vllm.integration.config import resolve_config
    from nexus_vllm.integration.manager import EvictionManager

    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=False, hash_block_size=BS)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32,
                             dtype=torch.float32)
    single = FullAttentionManager(spec, block_pool=pool, enable_caching=False,
                                  kv_cache_group_id=0, scheduler_block_size=BS)
    kvm = SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=(single,)),
                          block_pool=pool)
    cfg = resolve_config(flags={"method": "nexus", "max_tokens": budget, "chunk_size": chunk,
                                "seed": 3})
    return EvictionManager(cfg, kvm, BS), single, pool


def _request(req_id: str, prompt: int, **extra):  # noqa: ANN003, ANN202
    params = SimpleNamespace(extra_args=extra or None, seed=None)
    return SimpleNamespace(request_id=req_id, num_prompt_tokens=prompt, num_computed_tokens=0,
                           sampling_params=params)


def _step(mgr, single, requests, sched):  # noqa: ANN001, ANN202
    """Allocate like vLLM's scheduler, advance computed tokens, plan the step."""
    for req_id, n in sched.items():
        r = requests[req_id]
        single.allocate_new_blocks(req_id, r.num_computed_tokens + n, r.num_computed_tokens + n)
        r.num_computed_tokens += n
    out = SimpleNamespace(finished_req_ids=set(), num_scheduled_tokens=dict(sched))
    return mgr.plan_step(out, requests)


def _scores(plan, mgr, req_id: str, seed: int = 0):  # noqa: ANN001, ANN202
    from nexus_vllm.integration.channel import ScoreResult

    sreq = plan.score[req_id]
    blocks = mgr.blocks(req_id)[: sreq.num_logical_blocks]
    live = [j for j, b in enumerate(blocks) if not b.is_null]
    g = torch.Generator().manual_seed(seed)
    mass = torch.softmax(torch.randn(sreq.window, len(live), generator=g), dim=-1)
    return {req_id: ScoreResult(mass=mass, live=live, seconds=0.001)}


def test_chunked_prefill_stays_within_budget_plus_chunk_and_frees_blocks() -> None:
    mgr, single, pool = _setup()
    free0 = pool.get_num_free_blocks()
    reqs = {"r": _request("r", prompt=1000)}
    budget_blocks, chunk_blocks = 8, 4
    evicted_total = 0
    while reqs["r"].num_computed_tokens < 1000:
        plan = _step(mgr, single, reqs, {"r": min(128, 1000 - reqs["r"].num_computed_tokens)})
        live = mgr.live_count("r")
        assert live <= budget_blocks + chunk_blocks
        if "r" in plan.score:
            assert plan.score["r"].prefill
            before = pool.get_num_free_blocks()
            mgr.apply_scores(_scores(plan, mgr, "r"), reqs, plan)
            assert mgr.live_count("r") == budget_blocks
            freed = pool.get_num_free_blocks() - before
            evicted = mgr.pending_evict["r"]
            assert freed == len(evicted) > 0
            evicted_total += freed
            blocks = mgr.blocks("r")
            assert all(blocks[j].is_null for j in evicted)
            # Sink block and the newest recent_blocks + 1 blocks are never evicted.
            n = len(blocks)
            assert 0 not in evicted and all(j < n - 5 for j in evicted)
    assert mgr.counters.over_budget_peak <= 0
    # The next plan ships the evictions to the worker, exactly once.
    plan = _step(mgr, single, reqs, {"r": 1})
    assert sum(len(v) for v in plan.evict.values()) > 0 and mgr.pending_evict == {}
    assert not plan.score  # decode: interval not reached yet
    # Request end: vLLM frees the rest; every block is back.
    single.free("r")
    assert pool.get_num_free_blocks() == free0
    stats = mgr.stats({})
    assert stats["nexus:evicted_blocks"] == evicted_total
    assert stats["nexus:free_blocks"] == stats["nexus:total_blocks"] == free0


def test_decode_interval_and_restart_reset() -> None:
    mgr, single, pool = _setup()
    reqs = {"r": _request("r", prompt=300)}
    plan = _step(mgr, single, reqs, {"r": 300})
    mgr.apply_scores(_scores(plan, mgr, "r"), reqs, plan)
    first = list(mgr.pending_evict["r"])
    events = 0
    for _ in range(64):
        plan = _step(mgr, single, reqs, {"r": 1})
        # Between events a decoding request may hold one block over its budget.
        assert mgr.live_count("r") <= 8 + 1
        if "r" in plan.score:
            assert not plan.score["r"].prefill and plan.score["r"].window == 16
            mgr.apply_scores(_scores(plan, mgr, "r", seed=events), reqs, plan)
            events += 1
    # Tokens 301..364 cross two block boundaries (320, 352): an event follows each, once
    # 16 decode tokens (the interval) have passed since the previous one.
    assert events == 2
    assert mgr.counters.over_budget_peak <= 0
    # Preemption: vLLM frees everything and recomputes from token 0 -> same evictions.
    single.free("r")
    reqs["r"].num_computed_tokens = 0
    plan = _step(mgr, single, reqs, {"r": 300})
    assert plan.reset == ["r"]
    mgr.apply_scores(_scores(plan, mgr, "r"), reqs, plan)
    assert mgr.pending_evict["r"] == first


def test_per_request_overrides_and_opt_out() -> None:
    mgr, single, pool = _setup()
    reqs = {"big": _request("big", 600, kv_budget=100_000),
            "off": _request("off", 600, kv_eviction="none"),
            "h2o": _request("h2o", 600, kv_eviction="h2o", kv_budget=192)}
    plan = _step(mgr, single, reqs, {"big": 256, "off": 256, "h2o": 256})
    assert sorted(plan.track) == ["big", "h2o"]
    assert list(plan.score) == ["h2o"]  # 8 live blocks > 192 // 32; "big" is far below
    assert mgr.states["h2o"] is not None and mgr.states["h2o"].cfg.method == "h2o"
