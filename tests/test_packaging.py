"""The install surface: entry points, the pinned vLLM version, the Docker image."""

import importlib.metadata as md
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]


def _pinned_vllm() -> str:
    text = (REPO / "scripts" / "setup_env.sh").read_text()
    match = re.search(r'^VLLM_VERSION="([\d.]+)"', text, re.M)
    assert match, "setup_env.sh must pin VLLM_VERSION"
    return match.group(1)


def test_plugin_and_cli_entry_points_are_installed():
    plugins = {e.name: e.value for e in md.entry_points(group="vllm.general_plugins")}
    assert plugins.get("nexus_vllm") == "nexus_vllm:register"
    scripts = {e.name: e.value for e in md.entry_points(group="console_scripts")}
    assert scripts.get("nexus-vllm") == "nexus_vllm.cli:main"


def test_one_vllm_version_everywhere():
    version = _pinned_vllm()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"vllm=={version}"' in pyproject
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert f"ARG VLLM_VERSION=v{version}" in dockerfile
    assert md.version("vllm").split("+")[0] == version


def test_dockerfile_copies_existing_paths_and_keeps_entrypoint():
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM vllm/vllm-openai:\$\{VLLM_VERSION\}$", dockerfile, re.M)
    assert "ENTRYPOINT" not in dockerfile  # vLLM's own `vllm serve` entrypoint stays
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), f"Dockerfile copies missing path {src}"
