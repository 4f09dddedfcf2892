import pathlib
import subprocess
import sys

from nexus_vllm.cli import SUBCOMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


def test_unknown_command_fails_with_usage(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_simulate_rejects_bad_flag_value():
    proc = subprocess.run(
        [sys.executable, "-m", "nexus_vllm.cli", "simulate", "--budget-blocks", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "budget_blocks" in proc.stderr


def test_parity_rejects_bad_budget_without_contacting_a_server():
    proc = subprocess.run(
        [sys.executable, "-m", "nexus_vllm.cli", "parity", "--base-url", "http://127.0.0.1:9",
         "--budget", "lots"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "budget must be a keep ratio" in proc.stderr


def _presets() -> dict[str, str]:
    configs = pathlib.Path(__file__).resolve().parents[1] / "configs"
    presets = sorted(configs.glob("*.yaml"), key=lambda p: p.stem)  # by name, as listed
    return {p.stem: p.read_text() for p in presets}


def test_presets_lists_every_preset_with_a_line_about_it(capsys):
    from nexus_vllm.presets import describe

    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    rows = [line.split(None, 1) for line in out.splitlines() if line.startswith("  ")]
    assert [name for name, _ in rows] == list(_presets())  # configs/eval/ is no preset
    for (name, about), text in zip(rows, _presets().values()):
        assert about == describe(text) and about.endswith((".", "...")), (name, about)
        assert 0 < len(about) <= 72
    assert dict(rows)["h2o"] == "Baseline: h2o."
    assert dict(rows)["nexus"] == "Nexus Sampling (default knobs)."
    assert "--kv-eviction-config NAME" in out and "--show NAME" in out


def test_presets_show_prints_one_preset(capsys):
    for spec in ("nexus-fast", "nexus-fast.yaml"):
        assert main(["presets", "--show", spec]) == 0
        assert capsys.readouterr().out == _presets()["nexus-fast"]


def test_presets_show_unknown_name_fails_listing_the_presets(capsys):
    assert main(["presets", "--show", "nexus-fats"]) == 2
    err = capsys.readouterr().err
    assert "--show: no such preset 'nexus-fats' (did you mean 'nexus-fast'?)" in err
    assert ", ".join(_presets()) in err


def test_describe_takes_the_leading_comment():
    from nexus_vllm.presets import describe

    assert describe("# Baseline: tova. Use with:\n#   vllm serve MODEL\nnexus: {}\n") == (
        "Baseline: tova.")
    long = ("# Nexus with cheaper evidence: the newest 16 queries of a prefill chunk, scored\n"
            "# in every other layer. More text.\n#   vllm serve ...\n")
    assert describe(long) == "Nexus with cheaper evidence."
    assert describe("nexus:\n  method: nexus\n") == ""
