"""Patch an unpacked vLLM 0.34 ``vllm/`` package so that it runs on an x86 CPU box without
triton-cpu (test-only build of ``scripts/setup_vllm034.sh``; not product code).

Usage: ``python patch_vllm.py VLLM_PACKAGE_DIR``

1. ``platforms/cpu.py``: the x86 "requires Triton (triton-cpu)" error becomes a warning, and
   ``uses_standalone_cpu_model_runner()`` is true whenever Triton with a CPU backend is not
   usable, so the Triton-free ``v1/worker/cpu/standalone_model_runner.py`` runs on x86 too.
   With ``NEXUS_VLLM_CPU_ASYNC_SCHEDULING=1`` in the environment, ``check_and_update_config``
   keeps the async scheduling vLLM settled on (its default for the uni and mp executors,
   or ``--async-scheduling``) instead of turning it off: the compat harness's way to run
   vLLM's ``AsyncScheduler`` and its batch queue of two steps on CPU (the standalone
   runner samples each step before it runs the next, and returns plain outputs).
   Catalogued in ``nexus_vllm/integration/compat/catalogue.py``.
2. ``_cpu_ops.py``: gets ``cpu_ops_shim.install(globals())`` appended (the shim is copied
   beside it as ``_nexus_cpu_ops_shim.py``), which fills in pure-torch versions of the ops
   that the compiled vllm-cpu 0.32 library lacks.

Each edit asserts that its anchor text occurs exactly once and that the shim's functions
take the same parameters as 0.34's ``_cpu_ops`` wrappers; a vLLM whose source differs
fails here, loudly, instead of producing a silently broken build.
"""

from __future__ import annotations

import ast
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
SHIM = HERE / "cpu_ops_shim.py"
SHIM_MODULE = "_nexus_cpu_ops_shim"
MARKER = "# nexus-vllm test build (scripts/setup_vllm034.sh)"

_HELPER = f'''

{MARKER}: Triton counts only with a CPU backend
# (triton-cpu); the `triton` wheel from PyPI has none on this box.
def _nexus_triton_cpu_usable() -> bool:
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        return False
    try:
        from triton.backends import backends
    except Exception:
        return False
    return "cpu" in backends


class CpuPlatform(Platform):'''

# The environment variable that keeps async scheduling on in this build.
ASYNC_ENV = "NEXUS_VLLM_CPU_ASYNC_SCHEDULING"

# (anchor, replacement) pairs for platforms/cpu.py; each anchor must occur exactly once.
CPU_PY_EDITS: list[tuple[str, str]] = [
    (
        '''        # async scheduling is not required on CPU
        scheduler_config.async_scheduling = False
''',
        f'''        # async scheduling is not required on CPU
        {MARKER}: {ASYNC_ENV}=1 keeps it.
        if os.environ.get("{ASYNC_ENV}") != "1":
            scheduler_config.async_scheduling = False
''',
    ),
    ("\n\nclass CpuPlatform(Platform):", _HELPER),
    (
        '''        if cls.get_cpu_architecture() == CpuArchEnum.X86 and not HAS_TRITON:
            raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")
''',
        f'''        if cls.get_cpu_architecture() == CpuArchEnum.X86 and not HAS_TRITON:
            {MARKER}
            logger.warning(
                "No triton-cpu: using the standalone CPU model runner on x86 "
                "(nexus-vllm test build of vLLM 0.34)."
            )
''',
    ),
    (
        '''        # Only non-x86 CPUs have a standalone no-Triton MRV2 runner.
        from vllm.triton_utils import HAS_TRITON

        return not HAS_TRITON and cls.get_cpu_architecture() != CpuArchEnum.X86
''',
        f'''        {MARKER}: any CPU without a usable
        # triton-cpu runs the standalone no-Triton MRV2 runner.
        return not _nexus_triton_cpu_usable()
''',
    ),
]

CPU_OPS_HOOK = f'''

{MARKER}: pure-torch versions of the ops that
# the compiled vllm-cpu 0.32 library lacks (only where torch.ops._C lacks them).
from vllm.{SHIM_MODULE} import install as _nexus_install_cpu_ops_shim  # noqa: E402

_nexus_install_cpu_ops_shim(globals())
'''


def _fail(msg: str) -> None:
    raise SystemExit(f"patch_vllm: {msg}")


def _apply(path: pathlib.Path, edits: list[tuple[str, str]]) -> None:
    text = path.read_text()
    if MARKER in text:
        _fail(f"{path} is already patched (start from a fresh copy of the wheel)")
    for anchor, replacement in edits:
        count = text.count(anchor)
        if count != 1:
            _fail(f"expected exactly one anchor in {path}, found {count}:\n{anchor}")
        text = text.replace(anchor, replacement)
    path.write_text(text)


def _params(fn: ast.FunctionDef) -> list[str]:
    args = fn.args
    return [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]


def _functions(path: pathlib.Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _shim_names() -> list[str]:
    tree = ast.parse(SHIM.read_text(), filename=str(SHIM))
    for node in tree.body:
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == "FALLBACKS" and isinstance(node.value, ast.Dict)):
            return [k.value for k in node.value.keys
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    _fail(f"no FALLBACKS table in {SHIM}")
    return []


def check_signatures(cpu_ops: pathlib.Path) -> None:
    """Every op the shim provides must exist in ``cpu_ops`` with the same parameters."""
    wrappers = _functions(cpu_ops)
    shim = _functions(SHIM)
    for name in _shim_names():
        if name not in wrappers:
            _fail(f"{cpu_ops} has no wrapper {name}(): vLLM's CPU ops changed")
        want, have = _params(wrappers[name]), _params(shim[name])
        if want != have:
            _fail(f"{name}: vLLM's wrapper takes {want}, the shim takes {have}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    pkg = pathlib.Path(argv[0])
    cpu_py, cpu_ops = pkg / "platforms" / "cpu.py", pkg / "_cpu_ops.py"
    for path in (cpu_py, cpu_ops):
        if not path.is_file():
            _fail(f"{path} is missing: not a vLLM package directory")
    check_signatures(cpu_ops)
    _apply(cpu_py, CPU_PY_EDITS)
    text = cpu_ops.read_text()
    if MARKER in text:
        _fail(f"{cpu_ops} is already patched (start from a fresh copy of the wheel)")
    if text.count("current_platform.import_kernels()") != 1:
        _fail(f"{cpu_ops} no longer loads the compiled kernels where expected")
    cpu_ops.write_text(text.rstrip("\n") + "\n" + CPU_OPS_HOOK)
    shutil.copyfile(SHIM, pkg / f"{SHIM_MODULE}.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
