"""The synthetic-stream simulator (``nexus_vllm.sim``) and ``nexus-vllm simulate``."""

import pytest

from nexus_vllm.sim import SimulationConfig, simulate
from nexus_vllm.sim.cli import main


def test_simulation_sampling_outlives_topk_on_intermittent_blocks():
    seen: list[int] = []
    result = simulate(SimulationConfig(seeds=12), on_stream=seen.append)
    assert seen == list(range(12))
    assert result.survival["nexus"]["intermittent"] > result.survival["nexus-topk"]["intermittent"]
    assert result.survival["snapkv"]["intermittent"] == 0.0
    assert result.survival["streaming"]["background"] == 0.0  # only sinks + recents live


def test_simulate_cli_prints_table_and_writes_plot(tmp_path, capsys):
    plot = tmp_path / "survival.png"
    argv = ["--seeds", "3", "--events", "10", "--plot", str(plot),
            "--json", str(tmp_path / "s.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| nexus |" in out and "intermittent" in out
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("kwargs, match", [
    ({"budget_blocks": 3}, "budget_blocks"),
    ({"class_probs": {"hub": 1.0}}, "unknown classes"),
    ({"class_probs": {"bridge": 0.0}}, "positive sum"),
])
def test_bad_simulation_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SimulationConfig(**kwargs)


def test_core_and_the_simulation_import_no_cli_plot_or_progress_bar():
    # The oracle (core) and the simulation stay importable without the tools around them
    # (tqdm is not checked at run time: torch itself imports it).
    import pathlib
    import re
    import subprocess
    import sys

    code = ("import sys, nexus_vllm.core, nexus_vllm.sim; "
            "print(sorted(m for m in ('matplotlib', 'vllm', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"
    core = pathlib.Path(__file__).parents[2] / "nexus_vllm" / "core"
    for path in core.glob("*.py"):
        assert not re.search(r"^\s*(import|from) (argparse|tqdm|matplotlib)\b",
                             path.read_text(), re.M), path


def test_a_policy_reading_a_kind_the_stream_does_not_make_is_left_out(monkeypatch) -> None:
    """A new evidence kind needs no simulator change to land: its policies are not run by
    default, and asking for one names the kind."""
    from dataclasses import dataclass
    from typing import ClassVar

    from nexus_vllm.core.policies import POLICIES, EvictionPolicy
    from nexus_vllm.sim.simulate import DEFAULT_POLICIES, SIMULATED_KINDS, _simulated

    @dataclass(frozen=True)
    class ValueNormPolicy(EvictionPolicy):
        name: ClassVar[str] = "value_norm_test"
        evidence: ClassVar[frozenset[str]] = frozenset({"value_norms"})

    assert not _simulated(ValueNormPolicy)
    assert all(_simulated(POLICIES[kind]) for kind, _ in DEFAULT_POLICIES.values())
    assert "value_norms" not in SIMULATED_KINDS
    monkeypatch.setitem(POLICIES, "value_norm_test", ValueNormPolicy)
    with pytest.raises(ValueError, match=r"'v' reads \['value_norms'\]"):
        simulate(SimulationConfig(seeds=1), policies={"v": ("value_norm_test", {})})
