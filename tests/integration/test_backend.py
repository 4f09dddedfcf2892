"""Block-table compaction and key reads against vLLM's real CPU attention kernels."""

from __future__ import annotations

import math

import pytest
import torch

from tests.integration.conftest import HAS_VLLM

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")

BS, HKV, HQ, D = 32, 2, 4, 64


def test_compact_block_table() -> None:
    from nexus_vllm.integration.backend import compact_block_table

    table = torch.tensor([[7, 0, 0, 9, 4, 0, 0], [3, 5, 6, 0, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([5 * BS - 3, 3 * BS], dtype=torch.int32)
    out = compact_block_table(table, lens, BS)
    assert out is not None
    new_table, new_lens = out
    assert new_table[0, :3].tolist() == [7, 9, 4] and new_table[0, 3:5].tolist() == [0, 0]
    assert new_table[1].tolist() == table[1].tolist()
    assert new_lens.tolist() == [3 * BS - 3, 3 * BS] and new_lens.dtype == lens.dtype
    # Nothing evicted: callers keep the original tensors.
    assert compact_block_table(table[1:], lens[1:], BS) is None
    assert table[0, 1] == 0  # the logical table is never modified in place


def _write(kv: torch.Tensor, key: torch.Tensor, val: torch.Tensor, blocks: list[int]) -> None:
    from vllm import _custom_ops as ops

    nb, hkv, bs, _ = kv.shape
    kc, vc = kv.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)
    slot = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(key.shape[0])])
    ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slot, "vec", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")


def test_key_view_reads_what_vllm_wrote() -> None:
    from nexus_vllm.core import gather_paged_keys
    from nexus_vllm.integration.backend import _key_view, key_layout

    torch.manual_seed(0)
    kv = torch.zeros(8, HKV, BS, 2 * D)
    key, val = torch.randn(70, HKV, D), torch.randn(70, HKV, D)
    _write(kv, key, val, [3, 5, 1])
    layout = key_layout("vec", D, BS, torch.float32)
    got = gather_paged_keys(_key_view(kv, layout), torch.tensor([3, 5, 1]), 70,
                            kv_layout="HND")
    assert torch.equal(got, key)


def test_compacted_attention_equals_attention_over_kept_tokens() -> None:
    """The stock CPU kernel on the compacted table == exact attention over kept keys."""
    from vllm import _custom_ops as ops

    from nexus_vllm.integration.backend import compact_block_table

    torch.manual_seed(1)
    t, q_len = 5 * BS - 7, 3  # last block partial; 3 new queries at the end
    phys = [11, 4, 9, 2, 6]
    kv = torch.zeros(16, HKV, BS, 2 * D)
    key, val = torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    _write(kv, key, val, phys)
    evicted = [1, 2]  # logical blocks; never the newest (current) block
    table = torch.zeros(1, 8, dtype=torch.int32)
    table[0, :5] = torch.tensor([0 if j in evicted else b for j, b in enumerate(phys)])
    compacted = compact_block_table(table, torch.tensor([t], dtype=torch.int32), BS)
    assert compacted is not None
    ctable, clens = compacted
    query = torch.randn(q_len, HQ, D)
    qsl = torch.tensor([0, q_len], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=HQ, num_kv_heads=HKV, head_dim=D, seq_lens=clens,
        dtype=torch.float32, query_start_loc=qsl, causal=True, sliding_window_size=-1,
        isa="vec", enable_kv_split=False, dynamic_causal=None, kv_cache_dtype="auto",
    )
    nb = kv.shape[0]
    kc, vc = kv.view(nb, HKV, 2 * BS, D).chunk(2, dim=2)
    out = torch.zeros(q_len, HQ, D)
    scale = 1.0 / math.sqrt(D)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
        seq_lens=clens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=ctable, softcap=0, scheduler_metadata=meta, s_aux=None,
        dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
    )
    keep = torch.cat([torch.arange(j * BS, min((j + 1) * BS, t))
                      for j in range(5) if j not in evicted])
    ref = torch.empty_like(out)
    for i in range(q_len):
        pos = t - q_len + i  # logical position of query i
        vis = keep[keep <= pos]
        for h in range(HQ):
            kh = h // (HQ // HKV)
            w = torch.softmax(key[vis, kh] @ query[i, h] * scale, dim=0)
            ref[i, h] = w @ val[vis, kh]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _fake_runner(req_ids: list[str], block_ids: dict[str, list[int]], max_blocks: int = 16):  # noqa: ANN202
    from types import SimpleNamespace

    import numpy as np

    table = np.zeros((len(req_ids), max_blocks), dtype=np.int32)
    for row, r in enumerate(req_ids):
        table[row, : len(block_ids[r])] = block_ids[r]
    bt = SimpleNamespace(block_table=SimpleNamespace(np=table))
    batch = SimpleNamespace(req_ids=list(req_ids), req_id_to_index={r: i for i, r in
                                                                     enumerate(req_ids)},
                            block_table=[bt])
    requests = {r: SimpleNamespace(block_ids=[list(block_ids[r])]) for r in req_ids}
    return SimpleNamespace(input_batch=batch, requests=requests), table


def test_worker_state_nulls_entries_and_scores_like_the_oracle() -> None:
    """Plan application + query windows + per-layer scoring == core oracle on live keys."""
    from nexus_vllm.core import block_attention_mass
    from nexus_vllm.integration.backend import _key_view, compact_block_table, key_layout
    from nexus_vllm.integration.channel import ScoreRequest, StepPlan, WorkerEvictionState

    torch.manual_seed(2)
    t = 4 * BS + 5
    phys = {"a": [3, 7, 8, 2, 5], "b": [9, 10]}
    runner, table = _fake_runner(["a", "b"], phys)
    state = WorkerEvictionState()
    plan = StepPlan(evict={"a": [1]}, score={"a": ScoreRequest(window=4,
                                                               num_logical_blocks=5)},
                    track=["a", "b"], max_window=8, skip_layers=1)
    state.begin_step(runner, plan, finished=set())
    assert table[0, :5].tolist() == [3, 0, 8, 2, 5]
    assert runner.requests["a"].block_ids[0] == [3, 0, 8, 2, 5]
    assert state.active and state.any_evicted

    kv = torch.zeros(16, HKV, BS, 2 * D)
    key, val = torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    _write(kv, key, val, phys["a"])
    keys = _key_view(kv, key_layout("vec", D, BS, torch.float32))
    lens = torch.tensor([t, 2 * BS], dtype=torch.int32)
    compacted = compact_block_table(torch.from_numpy(table), lens, BS)
    assert compacted is not None
    ctable, clens = compacted
    n_q = 6  # this step: 6 new tokens of "a", 1 of "b"
    qsl = torch.tensor([0, n_q, n_q + 1])
    live_keys = torch.cat([key[: BS], key[2 * BS:]])  # logical block 1 evicted
    expected = torch.zeros(4, 4)
    for layer in range(3):
        q = torch.randn(n_q + 1, HQ, D)
        state.observe(f"model.layers.{layer}.self_attn.attn", q, keys, ctable, clens, qsl,
                      HQ, D)
        if layer >= 1:
            expected += block_attention_mass(q[n_q - 4: n_q], live_keys, BS)
    scores = state.end_step()
    assert set(scores) == {"a"} and not state.active
    res = scores["a"]
    assert res.live == [0, 2, 3, 4]
    torch.testing.assert_close(res.mass, expected / 2, atol=1e-5, rtol=1e-5)
    assert state.windows[("a", 2)].shape == (6, HQ, D)
    assert state.windows[("b", 0)].shape == (1, HQ, D)
    # Finished requests drop their windows.
    state.begin_step(runner, StepPlan(), finished={"b"})
    assert not any(k[0] == "b" for k in state.windows)
