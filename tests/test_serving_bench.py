"""Smoke test of ``benchmarks/serving/capacity.py --smoke`` on the tiny random Llama.

Three real ``vllm serve`` processes (stock, nexus, streaming) one after another, two
concurrency levels each: about 1.5-2 minutes on 2 idle CPU cores, most of it server
start-up. Checks that the script writes its JSON, table and plots (``capacity_report.py``
on the JSON it wrote) and that the numbers are sane; the timings of a tiny model on a
shared box mean nothing.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from tests.integration.tiny_model import build_tiny_llama
from tests.script_module import load_script

pytestmark = [
    pytest.mark.slow, pytest.mark.e2e, pytest.mark.long,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed"),
]

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "serving" / "capacity.py"


# The smoke's evicting configs (capacity.py --smoke): Nexus in the default prompt mode
# (end), StreamingLLM streaming the prompt.
NEXUS, STREAMING = "nexus", "streaming:prompt_mode=stream"


def test_capacity_smoke(tmp_path: pathlib.Path) -> None:
    model = build_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--model", str(model),
                           "--out", str(out)], capture_output=True, text=True, timeout=900,
                          cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    result = json.loads((out / "capacity.json").read_text())
    for name in ("capacity.md", "throughput.png", "preemptions.png", "pool_usage.png",
                 "running.png"):
        assert (out / name).stat().st_size > 0, name
    table = (out / "capacity.md").read_text()
    assert "| config | conc." in table and f"| {NEXUS} | 2 |" in table
    assert "stock **" in table

    capacity = load_script("benchmarks/serving/capacity.py")
    d = result["derived"]
    rows = result["rows"]
    assert {(r["config"], r["concurrency"]) for r in rows} == {
        (c, n) for c in ("stock", NEXUS, STREAMING) for n in (1, 2)}
    # Each level's bound follows its longest prompt (end holds a whole prompt); the
    # lifetime peak spans the config's levels.
    bounds: dict[str, int] = {}
    for r in rows:
        bounds[r["config"]] = max(bounds.get(r["config"], 0), r["bound_blocks"])
    for r in rows:
        stem = capacity.file_stem(r["config"])
        assert (out / "runs" / f"{stem}-c{r['concurrency']}.json").is_file()
        assert r["failed"] == 0 and r["completed"] == r["num_prompts"], r
        assert r["output_tok_s"] > 0 and r["ttft_p50_ms"] > 0, r
        assert 0 <= r["peak_pool_blocks"] <= d["usable_blocks"], r
        assert r["faults"] == 0, r
        if r["config"] == "stock":
            assert r["overhead"] is None
        else:
            # Never above the bound, and eviction did happen.
            assert 0 < r["live_blocks_peak_lifetime"] <= bounds[r["config"]], r
            assert r["peak_blocks_per_request"] <= r["bound_blocks"], r
            assert r["over_budget_peak_lifetime"] <= 0, r
            assert r["evicted_blocks"] > 0 and r["preemptions"] == 0, r
            assert r["overhead"] is not None and 0 <= r["overhead"] < 1, r
    report = load_script("benchmarks/serving/capacity_report.py")
    names, evicting = report.config_names(result), report.evicting_configs(result)
    assert names == ["stock", NEXUS, STREAMING] and evicting == {NEXUS, STREAMING}
    h = report.headline(rows, names, evicting)
    assert set(h["no_preemption_concurrency"]) == {"stock", NEXUS, STREAMING}
    assert h["top_level"] == 2 and NEXUS in h["throughput_ratio_top"]

    # --update-docs, pointed at copies: the marked section is created once, then replaced.
    docs = tmp_path / "performance.md"
    docs.write_text("# Kernel performance\n\nkept.\n")
    figures = tmp_path / "figures" / "serving"
    pngs = sorted(out.glob("*.png"))
    for _ in range(2):
        report.update_docs(result, pngs, docs=docs, figures=figures)
    text = docs.read_text()
    assert text.startswith("# Kernel performance\n\nkept.\n")
    assert text.count(report.BEGIN) == 1 and text.count(report.END) == 1
    assert "## Serving: capacity and speed against stock vLLM (CPU)" in text
    assert result["command"] in text and "](figures/serving/throughput.png)" in text
    assert (figures / "throughput.png").is_file()
