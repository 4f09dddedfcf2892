"""Import a repository script (``scripts/``, ``benchmarks/``) as a module for its tests."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_script(rel: str) -> ModuleType:
    """The script at ``REPO / rel``, executed once as a module named after its stem (and
    registered in ``sys.modules``, which its dataclasses need)."""
    path = REPO / rel
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
