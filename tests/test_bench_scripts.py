"""Cheap checks of the benchmark scripts that need a GPU or minutes to run for real."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests.script_module import load_script

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_cudagraph_cost_configs_format() -> None:
    """Every config's flags survive str.format (the JSON of -cc has braces) and the idle
    budget equals the max length (a budget above it is refused at startup)."""
    mod = load_script("benchmarks/serving/cudagraph_cost.py")
    flags = {name: [f.format(budget=256, max_len=832) for f in v]
             for name, v in mod.CONFIGS.items()}
    assert flags["stock-piecewise"] == ["-cc", '{"cudagraph_mode": "PIECEWISE"}']
    assert flags["stock-sync"] == ["--no-async-scheduling"]
    assert flags["nexus-idle"][-1] == "832" and flags["nexus"][-1] == "256"
    assert flags["nexus-sync"] == [*flags["nexus"], "--no-async-scheduling"]


@pytest.mark.slow
@pytest.mark.long  # CI time: a benchmark's smoke run
def test_cpu_scoring_runs() -> None:
    out = subprocess.run([sys.executable, str(REPO / "benchmarks/kernels/cpu_scoring.py"),
                          "--repeats", "1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith("| ") and "x) |" in ln]
    assert len(rows) == 4
    # every scorer agrees with the reference to float32 rounding
    assert all(float(ln.rstrip(" |").rsplit("| ", 1)[1]) < 1e-5 for ln in rows)
    prof = subprocess.run([sys.executable, str(REPO / "benchmarks/kernels/cpu_scoring.py"),
                           "--profile", "--repeats", "1"], capture_output=True, text=True,
                          timeout=600)
    assert prof.returncode == 0 and "aten::bmm" in prof.stdout, prof.stderr[-2000:]


@pytest.mark.slow
def test_evidence_cost_runs_every_kind_side_by_side() -> None:
    from nexus_vllm.core import EVIDENCE_KINDS

    out = subprocess.run([sys.executable, str(REPO / "benchmarks/kernels/evidence_cost.py"),
                          "--repeats", "1", "--cases", "1:4:4;2:3:2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    header, *rows = out.stdout.strip().splitlines()
    assert header.split()[-len(EVIDENCE_KINDS):][0] == "mass"
    assert set(header.split()) >= set(EVIDENCE_KINDS) and len(rows) == 2
    assert all(row.count("x)") == len(EVIDENCE_KINDS) and "(1.00x)" in row for row in rows)
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks/kernels/evidence_cost.py"),
                          "--kinds", "bogus"], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "unknown evidence kind 'bogus'" in bad.stderr


@pytest.mark.slow
def test_schedule_overhead_runs() -> None:
    """The scheduler benchmark builds vLLM's real scheduler and prints one row per size;
    the step the full reads take grows with the list, ours does not read it."""
    pytest.importorskip("vllm")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks/scheduler/schedule_overhead.py"),
                          "--tokens", "256,4096", "--requests", "4", "--steps", "4"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [ln.strip("| ").split(" | ") for ln in out.stdout.splitlines()
            if ln.startswith("| ") and ln[2].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("256", "4"), ("4096", "4")]
    # (logical, live) blocks per request: a 256-token request is under its 1024-token
    # budget and keeps every block; a 4096-token one keeps about its budget (64 blocks).
    shapes = [tuple(int(x) for x in r[2].split(" / ")) for r in rows]
    assert shapes[0][0] == shapes[0][1] >= 16
    assert shapes[1][0] >= 256 and 64 <= shapes[1][1] <= 64 + 32


def test_capacity_configs_with_knobs() -> None:
    """A config may carry EvictionConfig knobs ('nexus:layer_stride=2'): they reach the
    server as --additional-config, name a file-safe run, and a bad knob fails at parse."""
    import json

    mod = load_script("benchmarks/serving/capacity.py")
    args = mod._parse(["--configs", "stock;nexus;nexus:layer_stride=2,prompt_window=16"])
    assert args.names == ["stock", "nexus", "nexus:layer_stride=2,prompt_window=16"]
    assert mod._parse(["--configs", "stock,nexus"]).names == ["stock", "nexus"]
    d = mod.derive(args)
    flags = mod.server_flags(args.names[2], d, 8, gpu=False)
    assert flags[flags.index("--kv-eviction") + 1] == "nexus"
    extra = json.loads(flags[flags.index("--additional-config") + 1])
    assert extra == {"nexus": {"layer_stride": 2, "prompt_window": 16}}
    assert "--additional-config" not in mod.server_flags("nexus", d, 8, gpu=False)
    assert mod.file_stem(args.names[2]) == "nexus_layer_stride_2_prompt_window_16"
    for bad in ("nexus:layer_stride=0", "nexus:layer_strid=2", "lru"):
        with pytest.raises(SystemExit):
            mod._parse(["--configs", bad])


def test_capacity_report_from_saved_json(tmp_path: pathlib.Path) -> None:
    """The docs side reads only a capacity.json: ``capacity.py --from-json`` on the saved
    run behind docs/results.md rewrites its table and headline as committed, and the docs
    section comes from the same JSON (a config evicts when its server got --kv-eviction)."""
    import json
    import shutil

    saved = REPO / "docs" / "figures" / "serving_modes"
    shutil.copy2(saved / "capacity.json", tmp_path / "capacity.json")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/serving/capacity.py"),
                           "--from-json", str(tmp_path / "capacity.json")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The load caveat depends on this machine's cores; table and headline do not.
    committed = (saved / "capacity.md").read_text().split("**Caveat")[0]
    assert (tmp_path / "capacity.md").read_text().split("**Caveat")[0] == committed
    for name in ("throughput", "preemptions", "pool_usage", "running"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0, name

    report = load_script("benchmarks/serving/capacity_report.py")
    result = json.loads((tmp_path / "capacity.json").read_text())
    assert report.evicting_configs(result) == set(report.config_names(result)) - {"stock"}
    docs = tmp_path / "performance.md"
    docs.write_text("# Performance\n")
    report.update_docs(result, sorted(tmp_path.glob("*.png")), docs=docs,
                       figures=tmp_path / "figures" / "serving")
    section = docs.read_text().split(report.BEGIN, 1)[1]
    assert "| nexus:prompt_mode=end,prefill_budget=832 | 8 | 8 | 0 | 6 | 0 |" in section
    assert "stock **2**, nexus:prompt_mode=stream **9**" in section and "- **Knobs:**" in section
    assert "stock-chunked" not in section  # not among this run's configs
    assert "![running](figures/serving/running.png)" in section
