"""The kernel benchmark's CPU paths: the no-GPU message and the interpreter ``--smoke`` run."""

from __future__ import annotations

import json
from types import ModuleType

import pytest
import torch

from nexus_vllm.kernels import HAS_TRITON
from tests.script_module import load_script


def _load_bench() -> ModuleType:
    return load_script("benchmarks/kernels/bench_block_scoring.py")


def test_peak_table_lookup():
    bench = _load_bench()
    assert bench.peak_gbps_for("NVIDIA H200") == 4800.0
    assert bench.peak_gbps_for("NVIDIA H100 80GB HBM3") == 3350.0
    assert bench.peak_gbps_for("NVIDIA A100-SXM4-80GB") == 2039.0
    assert bench.peak_gbps_for("Some Future GPU") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_bench_without_gpu_exits_cleanly(capsys):
    assert _load_bench().main([]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available() or not HAS_TRITON, reason="CPU interpreter run")
def test_bench_smoke_runs_under_interpreter(tmp_path):
    out = tmp_path / "bench.json"
    # attention_reduce="max": the option's path (the mean is every other test's default).
    assert _load_bench().main(["--smoke", "--attention-reduce", "max", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["smoke"] is True
    assert len(data["scoring"]) == 2 and len(data["compaction"]) == 1
    for point in data["scoring"]:
        assert point["max_abs_diff"] < 1e-5 and point["attention_reduce"] == "max"
        assert point["triton_us"] > 0 and point["torch_us"] > 0
