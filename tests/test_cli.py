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
