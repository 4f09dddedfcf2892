"""The shipped ``--kv-eviction-config`` presets, and ``nexus-vllm presets``.

The presets are the repository's ``configs/*.yaml`` (``configs/eval/`` holds evaluation
runs, not presets). The wheel ships them as package data, ``nexus_vllm/configs/``
(``[tool.hatch.build.targets.wheel]`` in ``pyproject.toml``); a source checkout or an
editable install reads ``configs/`` in place. ``--kv-eviction-config NAME`` takes a preset
by name (``nexus-fast`` or ``nexus-fast.yaml``) when no file of that name exists.

Only the standard library is imported: listing presets never pays for vLLM or torch.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.resources
import pathlib
import re
import sys
import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.abc import Traversable

__all__ = ["available", "describe", "find", "is_name", "main", "unknown_message"]

SUFFIX = ".yaml"
_SUMMARY_WIDTH = 72


def presets_dir() -> Traversable | None:
    """Where the presets are: the package's ``configs/`` (an installed wheel), else the
    checkout's ``configs/`` (a source tree or an editable install), else None."""
    shipped = importlib.resources.files("nexus_vllm") / "configs"
    if shipped.is_dir():
        return shipped
    root = pathlib.Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "configs").is_dir():
        return root / "configs"
    return None


def available() -> dict[str, Traversable]:
    """Preset name (the file name without ``.yaml``) -> its file, sorted by name."""
    where = presets_dir()
    if where is None:
        return {}
    found = {f.name.removesuffix(SUFFIX): f for f in where.iterdir()
             if f.name.endswith(SUFFIX) and f.is_file()}
    return dict(sorted(found.items()))


def is_name(spec: str) -> bool:
    """Whether ``spec`` can name a preset: no directory part."""
    return bool(spec) and "/" not in spec and "\\" not in spec and spec not in (".", "..")


def find(spec: str) -> Traversable | None:
    """The preset ``spec`` names (with or without ``.yaml``), or None."""
    if not is_name(spec):
        return None
    return available().get(spec.removesuffix(SUFFIX))


def unknown_message(spec: str, flag: str = "--kv-eviction-config",
                    what: str = "file or preset") -> str:
    """The error for a ``flag`` value that is neither a file nor a preset."""
    names = list(available())
    msg = f"{flag}: no such {what} {spec!r}"
    close = difflib.get_close_matches(spec.removesuffix(SUFFIX), names, n=1)
    if close:
        msg += f" (did you mean {close[0]!r}?)"
    listed = ", ".join(names) if names else "none found"
    return f"{msg}; presets: {listed} (`nexus-vllm presets` describes them)"


def describe(text: str) -> str:
    """One line about a preset: the first sentence of its leading comment, cut at its
    first colon when long ("Use with:" dropped)."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#") or line.startswith("#   "):  # code, or a usage example
            break
        lines.append(line.lstrip("#").strip())
    words = re.sub(r"\s*Use with:.*$", "", " ".join(lines))
    words = re.split(r"(?<=\.)\s", words, maxsplit=1)[0].strip()
    if len(words) > _SUMMARY_WIDTH and ": " in words:
        words = words.split(": ")[0]
    if words and not words.endswith("."):
        words += "."
    return textwrap.shorten(words, _SUMMARY_WIDTH, placeholder=" ...") if words else ""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nexus-vllm presets",
        description="The eviction presets for `vllm serve MODEL --kv-eviction-config NAME`.",
    )
    parser.add_argument("--show", metavar="NAME", default=None,
                        help="Print one preset's YAML (NAME with or without .yaml).")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    presets = available()
    if args.show is not None:
        preset = find(args.show)
        if preset is None:
            msg = unknown_message(args.show, "--show", "preset")
            print(f"nexus-vllm presets: error: {msg}", file=sys.stderr)
            return 2
        sys.stdout.write(preset.read_text())
        return 0
    if not presets:
        print("nexus-vllm presets: error: no presets found (configs/*.yaml)", file=sys.stderr)
        return 1
    width = max(len(name) for name in presets)
    print("Presets for `vllm serve MODEL --kv-eviction-config NAME` (or a file's path):")
    for name, preset in presets.items():
        print(f"  {name:<{width}}  {describe(preset.read_text())}")
    print(f"\nFrom {presets_dir()}. `nexus-vllm presets --show NAME` prints one.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
