"""Triton CPU-interpreter support: lets the CPU CI run the real kernels.

There is no GPU in CI, so the kernel tests run the very ``@triton.jit`` functions of
``_triton_kernels.py`` under Triton's interpreter (``TRITON_INTERPRET=1``), which executes
them as NumPy. Three things make that work inside an ordinary process:

* ``TRITON_INTERPRET`` is read at call time (``triton_interpret_enabled``), not at import:
  the kernel tests set it per test (``tests/kernels/conftest.py``), while other tests in
  the same process must keep ``backend="auto"`` on the fast torch path.
* ``triton.jit`` chooses compiled or interpreted when a function is *decorated*, so
  ``kernel_module`` re-imports ``_triton_kernels`` whenever the mode has changed since the
  last import (a test run flips between the two; the AOT compile check needs the compiled
  module after interpreted tests).
* ``triton.language``'s own ``@jit`` helpers (``tl.sum``, ``tl.cdiv``, ...) are decorated
  when triton is first imported, usually in compiled mode (vLLM imports triton early); a
  compiled helper refuses to be called from an interpreted kernel. ``launch_context``
  swaps in interpreted twins for the duration of an interpreted launch only.

On a GPU none of this does anything: ``launch_context`` is a ``nullcontext`` and the
kernel module is imported once. The scoring tiling also adapts to the interpreter (fp32
``tl.dot`` operands; a row's blocks are not split across programs): see ``_tuning.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from types import ModuleType

_KERNELS = "nexus_vllm.kernels._triton_kernels"
_kernel_module: ModuleType | None = None
_kernel_module_interpreted = False
# (module, name, compiled helper, interpreted twin), built on the first interpreted launch.
_stdlib_swaps: list[tuple[ModuleType, str, object, object]] | None = None


def triton_interpret_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton CPU interpreter (read at call time)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def kernel_module() -> ModuleType:
    """Import (or re-import) the ``@triton.jit`` module in the current interpret mode.

    ``triton.jit`` picks compiled vs interpreted at decoration time, so the module is
    reloaded if ``TRITON_INTERPRET`` changed since it was first imported.
    """
    global _kernel_module, _kernel_module_interpreted
    want = triton_interpret_enabled()
    if _kernel_module is None:
        _kernel_module = importlib.import_module(_KERNELS)
    elif _kernel_module_interpreted != want:
        _kernel_module = importlib.reload(_kernel_module)
    _kernel_module_interpreted = want
    return _kernel_module


@contextlib.contextmanager
def _interpretable_triton_stdlib() -> Iterator[None]:
    """Let interpreted kernels call ``tl.sum``/``tl.cdiv``/... after a compiled-mode import.

    ``triton.language``'s own ``@jit`` helpers are decorated when triton is first imported
    (vLLM imports it early, without ``TRITON_INTERPRET``); compiled ``JITFunction`` helpers
    refuse to be called from an interpreted kernel. For the duration of an interpreted
    launch only, swap them for interpreted twins, then put the originals back.
    """
    global _stdlib_swaps
    if _stdlib_swaps is None:
        _stdlib_swaps = []
        try:  # triton internals: if they move, fall back to no swapping
            import triton.language as tl
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction
        except ImportError:  # pragma: no cover - depends on the triton version
            pass
        else:
            for mod in (tl, tl.standard, tl.math, tl.random):
                for name, obj in list(vars(mod).items()):
                    if isinstance(obj, JITFunction):
                        _stdlib_swaps.append((mod, name, obj, InterpretedFunction(obj.fn)))
    for mod, name, _, twin in _stdlib_swaps:
        setattr(mod, name, twin)
    try:
        yield
    finally:
        for mod, name, orig, _ in _stdlib_swaps:
            setattr(mod, name, orig)


def launch_context() -> contextlib.AbstractContextManager[None]:
    """Wrap a Triton launch: the stdlib swap when interpreting, nothing otherwise."""
    return (
        _interpretable_triton_stdlib() if triton_interpret_enabled() else contextlib.nullcontext()
    )
