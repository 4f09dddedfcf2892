"""The plugin never breaks stock vLLM: version gate, all-or-nothing patches, catalogue.

Patches are process-wide, so each scenario runs ``register()`` in a fresh interpreter.
The end-to-end proof (a real ``vllm serve`` with a faked unsupported vLLM version) is in
``tests/compat/test_vllm034_e2e.py``.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from nexus_vllm.integration.compat.catalogue import CATALOGUE
from nexus_vllm.integration.compat.versions import (
    SUPPORTED_VLLM,
    UnsupportedVLLMError,
    check_supported,
    is_supported,
    release_tuple,
)
from tests.integration.conftest import HAS_VLLM

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "nexus_vllm"
CLASS_WRAPS = [p.target for p in CATALOGUE if p.kind == "class-wrap"]


@pytest.mark.parametrize("version, ok", [
    ("0.32.0+cpu", True), ("0.32.7", True), ("0.33.0", True), ("0.34.1", True),
    ("0.34.0rc1", True), ("0.31.9", False), ("0.35.0", False), ("1.0.0", False),
    ("0.4.0", False),
])
def test_supported_range(version: str, ok: bool) -> None:
    assert is_supported(version) is ok
    if not ok:
        with pytest.raises(UnsupportedVLLMError, match=f"supports vLLM {SUPPORTED_VLLM}; "
                                                       f"this is vLLM {version}"):
            check_supported(version)


def test_release_tuple() -> None:
    assert release_tuple("0.32.0+cpu") == (0, 32, 0)
    assert release_tuple("v0.34.0rc1") == (0, 34, 0)
    with pytest.raises(ValueError):
        release_tuple("dev")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


_STATE = (
    "from nexus_vllm.integration.compat import catalogue\n"
    "from vllm.engine.arg_utils import EngineArgs\n"
    "from vllm.v1.metrics.loggers import StatLoggerManager\n"
    "print('applied', catalogue.applied())\n"
    "print('wrapped', hasattr(EngineArgs.add_cli_args, '__wrapped__'), "
    "hasattr(StatLoggerManager.record, '__wrapped__'))\n"
)


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_supported_vllm_gets_every_catalogued_class_wrap() -> None:
    out = _run("import nexus_vllm; nexus_vllm.register()\n" + _STATE)
    applied = eval(out.stdout.split("applied ", 1)[1].splitlines()[0])  # noqa: S307
    assert sorted(applied) == sorted(CLASS_WRAPS)
    assert "wrapped True True" in out.stdout


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_unsupported_vllm_gets_no_patch_and_one_line() -> None:
    out = _run(
        "from nexus_vllm.integration.compat import versions\n"
        "versions.installed_vllm_version = lambda: '0.35.0'\n"
        "import nexus_vllm; nexus_vllm.register()\n" + _STATE)
    assert "applied []" in out.stdout and "wrapped False False" in out.stdout
    lines = [line for line in out.stderr.splitlines() if "nexus-vllm" in line]
    assert len(lines) == 1, out.stderr
    assert f"supports vLLM {SUPPORTED_VLLM}; this is vLLM 0.35.0: no patch applied" in lines[0]


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_a_failing_patch_reverts_the_others() -> None:
    """A vLLM release that moved what one patch wraps: nothing stays patched, and
    register() does not raise (vLLM calls plugins unguarded)."""
    out = _run(
        "from nexus_vllm.integration.frontend.patches import stat_logger\n"
        "def broken(): raise ImportError('cannot import name StatLoggerManager')\n"
        "stat_logger.apply = broken\n"
        "import nexus_vllm; nexus_vllm.register()\n" + _STATE)
    assert "applied []" in out.stdout and "wrapped False False" in out.stdout
    assert "could not install its patches" in out.stderr
    assert "cannot import name StatLoggerManager" in out.stderr


def test_uncatalogued_patches_cannot_be_installed() -> None:
    from nexus_vllm.integration.compat.catalogue import swap, wrap_instance

    class Target:
        def method(self) -> int:
            return 1

    with pytest.raises(RuntimeError, match="not in the patch catalogue"):
        swap(Target, "method", lambda self: 2)
    with pytest.raises(RuntimeError, match="not in the patch catalogue"):
        wrap_instance(Target(), "method", "Target.method", lambda orig: orig)
    assert Target().method() == 1


def _calls(name: str) -> list[ast.Call]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == name):
                found.append(node)
    return found


def test_every_instance_wrap_in_the_code_is_catalogued() -> None:
    targets = {p.target for p in CATALOGUE if p.kind == "instance-wrap"}
    used = {c.args[2].value for c in _calls("wrap_instance")
            if isinstance(c.args[2], ast.Constant)}
    assert used and used <= targets
    # Every catalogued instance wrap is made through wrap_instance (the V2 runner
    # adapter's prepare_attn included).
    assert used == targets


def test_every_grafted_attribute_is_catalogued() -> None:
    grafts = {p.target.split(".")[-1] for p in CATALOGUE if p.kind == "graft"}
    written = set()
    for path in (PACKAGE / "integration").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "setattr" and isinstance(node.args[1], ast.Constant):
                written.add(node.args[1].value)
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and t.attr.startswith("_nexus_") and \
                            isinstance(t.value, ast.Name) and t.value.id != "self":
                        written.add(t.attr)
    # _nexus_patched and _nexus_takes_stats mark our own wrapper functions, not vLLM
    # objects.
    ours = {a for a in written if "nexus" in a} - {"_nexus_patched", "_nexus_takes_stats"}
    assert ours <= grafts, f"uncatalogued attributes on vLLM objects: {ours - grafts}"
    from nexus_vllm.integration.protocol import PLAN_ATTR, REPLY_ATTR, STEP_ATTR

    assert {PLAN_ATTR, REPLY_ATTR, STEP_ATTR, "kv_connector_stats",
            "next_decode_eligible_step", "max_num_scheduled_tokens"} <= grafts


def test_the_plugin_writes_no_environment_variable() -> None:
    for path in PACKAGE.joinpath("integration").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    assert not (isinstance(t, ast.Subscript) and "environ" in ast.unparse(t)), \
                        f"{path.name}: {ast.unparse(node)}"


def test_every_catalogue_entry_names_the_module_that_makes_it() -> None:
    """``where`` of each entry is a module under ``nexus_vllm/integration`` (or the setup
    script), and a class wrap's module swaps that very target."""
    repo = PACKAGE.parent
    for patch in CATALOGUE:
        path = (repo / patch.where) if patch.where.startswith("scripts/") else (
            PACKAGE / "integration" / f"{patch.where}.py")
        assert path.is_file(), f"{patch.target}: no module {patch.where}"
        if patch.kind == "class-wrap":
            owner, attr = patch.target.split(".")
            text = path.read_text()
            assert f'"{attr}"' in text and owner in text, f"{patch.target} is not in {path}"
