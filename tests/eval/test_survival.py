"""Block survival across events (``nexus-vllm survival``) on a tiny random model: the
bookkeeping, not the quality (tiny random weights make no quality claim)."""

from __future__ import annotations

import pathlib
from collections import defaultdict

import numpy as np
import pytest
import torch

from nexus_vllm.core import EvictionConfig
from nexus_vllm.eval.survival import STREAMING, SamplerTrace, plot_survival, trace_sample
from nexus_vllm.hf.testing import tiny_llama

PROMPT = [int(x) for x in torch.randint(3, 250, (700,), generator=torch.Generator().manual_seed(0))]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=260)


def _trace(model, sampler: str) -> tuple[SamplerTrace, EvictionConfig]:
    cfg = EvictionConfig.from_budget("nexus", 0.3, block_size=16, chunk_size=32,
                                     sampler=sampler, **STREAMING)
    trace = SamplerTrace(sampler)
    with torch.no_grad():
        trace.add_events(trace_sample(model, PROMPT, cfg, max_new_tokens=40, request_seed=0),
                         cfg)
    return trace, cfg


@pytest.mark.parametrize("sampler", ["topk", "pps", "ares"])
def test_each_event_keeps_exactly_its_candidate_quota(model, sampler: str) -> None:
    trace, _ = _trace(model, sampler)
    assert len(trace.pi) > 50 and all(0.0 <= p <= 1.0 + 1e-9 for p in trace.pi)
    by_event: dict[int, list[tuple[float, bool]]] = defaultdict(list)
    for e, p, s in zip(trace.event, trace.pi, trace.survived, strict=True):
        by_event[e].append((p, s))
    assert len(by_event) > 10  # many events per sample: the regime the figure is about
    for pairs in by_event.values():
        # pi sums to the number the event keeps among its candidates (exact inclusion)
        assert sum(p for p, _ in pairs) == pytest.approx(sum(s for _, s in pairs), abs=1e-6)
        if sampler == "topk":  # deterministic: every survivor outweighs every evicted block
            kept = [p for p, s in pairs if s]
            gone = [p for p, s in pairs if not s]
            if kept and gone:
                assert min(kept) >= max(gone)
    raster = trace.rasters[0]
    assert raster.shape[1] >= len(by_event) and set(np.unique(raster)) <= {-1, 0, 1}
    # a block evicted at one event is never a candidate again
    for row in raster:
        seen = row[row >= 0]
        assert (seen[:-1] == 1).all()


def test_plot_writes_a_figure(model, tmp_path: pathlib.Path) -> None:
    traces = [_trace(model, s)[0] for s in ("topk", "pps")]
    rows = traces[0].calibration()
    assert rows and sum(r["n"] for r in rows) == len(traces[0].pi)
    plot_survival(traces, tmp_path / "survival.png")
    assert (tmp_path / "survival.png").stat().st_size > 10_000
