"""End to end: each request's blocks in vLLM's own pool never exceed the bound admission
reserved for it, on the tiny random Llama, for prompts of every length modulo the block
size, in every prompt mode.

One evicting engine in this process (vLLM's ``LLM`` with the engine core in-process, the
streaming setting of ``test_e2e_serve``: budget 192 tokens, chunks of 64, blocks of 32,
the CPU backend's; ``end`` and ``keep`` asked per request, as ``vllm_xargs`` do on a
server), all requests in one batch. After every ``schedule()`` the test reads vLLM's block lists themselves
(``req_to_blocks`` of the full-attention manager; vLLM allocates only in ``schedule()``
and eviction only frees, so the largest count read is the request's peak), not the
plugin's gauges. The plugin's own pool self-check (``NEXUS_VLLM_SELF_CHECK=1``,
``AdmissionGate.check_pool``) runs beside it and must read the same. ~1 min on 2 CPU
cores, most of it the engine's start.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.conftest import HAS_VLLM

pytestmark = [
    pytest.mark.e2e, pytest.mark.slow,
    pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed"),
]

BLOCK = 32  # vLLM's CPU attention takes multiples of 32
BUDGET = 192  # 6 blocks
CHUNK = 64  # 2 blocks
LONG, SHORT = 8 * BLOCK, 5 * BLOCK  # prompt bases: above and below the budget
# (prompt base, answer lengths): the prompt's peak and a first decode block (past a last
# prompt block the prompt fills), decode events (interval 16) of a prompt under budget.
WORKLOAD = {LONG: (BLOCK + 1,), SHORT: (2 * BLOCK,)}
# Per-request settings (vllm_xargs) on the streaming engine.
MODES: dict[str, dict[str, Any]] = {
    "stream": {},
    "end": {"kv_prompt_mode": "end"},
    "keep": {"kv_prompt_mode": "keep"},
}
NEXUS = {"method": "nexus", "max_tokens": BUDGET, "chunk_size": CHUNK, "block_size": BLOCK,
         "prompt_mode": "stream", "seed": 7}


def test_pool_peak_within_bound_for_every_residue(tiny_model: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm import LLM, SamplingParams

    from nexus_vllm.integration.testing.pool_watch import PoolWatch

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in-process
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("NEXUS_VLLM_SELF_CHECK", "1")
    llm = LLM(model=tiny_model, additional_config={"nexus": NEXUS}, enforce_eager=True,
              dtype="float32", distributed_executor_backend="uni", max_model_len=512,
              max_num_seqs=128, block_size=BLOCK, num_gpu_blocks_override=2560,
              enable_prefix_caching=False)
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        watch = PoolWatch(scheduler, check=True).wrap()
        prompts, params = [], []
        for mode, xargs in MODES.items():
            for base, answers in WORKLOAD.items():
                for r in range(BLOCK):
                    for answer in answers:
                        # Ordinary ids of the tiny vocabulary (0 and 1 are bos and eos).
                        ids = [2 + (7 * i + 13 * r + len(mode)) % 300
                               for i in range(base + r)]
                        prompts.append({"prompt_token_ids": ids})
                        params.append(SamplingParams(max_tokens=answer, temperature=0.0,
                                                     ignore_eos=True,
                                                     extra_args=dict(xargs) or None))
        outs = llm.generate(prompts, params, use_tqdm=False)
        mgr = scheduler.nexus_manager
        counters = mgr.counters
        pool_check = mgr.admission.pool
    finally:
        del llm
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    rows = watch.rows
    assert len(rows) == len(prompts)
    assert all(r.bound >= 0 for r in rows.values())
    assert not watch.over_bound(), watch.over_bound()
    assert not watch.mismatches
    # The plugin's self-check read the same lists and found every bound held.
    assert watch.check_peaks == {r: row.peak for r, row in rows.items()}
    assert pool_check is not None and pool_check.over_bound is not None
    assert pool_check.over_bound <= 0
    assert dict(counters.faults) == {} and counters.evicted_blocks > 0
    # Where the prompt sets the bound (end: the prompt is held whole until its end), the
    # peak is exactly the prompt's blocks, for every residue: the first decode token's
    # block (after a prompt that fills its last block) comes once the prompt-end event
    # has freed the prompt.
    end_long = [r for r in rows.values()
                if r.xargs == MODES["end"] and r.prompt >= LONG]
    assert len(end_long) == BLOCK * len(WORKLOAD[LONG])
    for r in end_long:
        assert r.peak == r.bound == -(-r.prompt // BLOCK), r
    # Every mode ran, and each mode's bound was reached by some request (tight).
    for mode, xargs in MODES.items():
        mine = [r for r in rows.values() if r.xargs == xargs]
        assert len(mine) == BLOCK * sum(map(len, WORKLOAD.values())), mode
        assert any(r.peak == r.bound for r in mine), mode
