"""The prepared-model cache: where checkpoints live, and building one atomically, once.

A checkpoint is complete when its directory holds a marker with the builder's format
version; it is built in a temporary directory beside it under a per-model file lock and
renamed into place, so concurrent callers (test workers, a server and an evaluation)
convert once and never read half a directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator

MARKER = ".nexus_vllm_complete"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Directory that holds prepared checkpoints.

    ``cache_dir`` if given, else ``$NEXUS_VLLM_CACHE``, else ``~/.cache/nexus_vllm``.
    """
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()
    env = os.environ.get("NEXUS_VLLM_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "nexus_vllm"


@contextlib.contextmanager
def file_lock(path: pathlib.Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def is_complete(target: pathlib.Path, format_version: int) -> bool:
    """Whether ``target`` holds a finished checkpoint of ``format_version``."""
    marker = target / MARKER
    if not marker.is_file():
        return False
    try:
        return int(json.loads(marker.read_text()).get("format", 0)) == format_version
    except (ValueError, OSError, AttributeError):
        return False


def build_once(root: pathlib.Path, name: str, format_version: int,
               build: Callable[[pathlib.Path], str], *, check: Callable[[], object] | None = None,
               force: bool = False, message: str | None = None) -> pathlib.Path:
    """Return ``root / name``, building it with ``build`` unless it is already complete.

    Parameters
    ----------
    root : pathlib.Path
        Cache root.
    name : str
        Directory name of the checkpoint under ``root``.
    format_version : int
        Written to the marker; a checkpoint with another version is rebuilt.
    build : callable
        ``build(out_dir) -> source`` writes the checkpoint into the empty ``out_dir`` and
        returns the name of what it was built from (recorded in the marker).
    check : callable, optional
        Called before a build (only when one is due): raises when the source is missing,
        before a temporary directory or ``message`` appear.
    force : bool
        Rebuild even when a complete checkpoint exists.
    message : str, optional
        Printed to stderr before building, and the checkpoint's path after (nothing is
        printed when the cache is warm).

    Returns
    -------
    pathlib.Path
        The complete checkpoint directory.
    """
    target = root / name
    if not force and is_complete(target, format_version):
        return target
    with file_lock(root / f".{name}.lock"):
        if not force and is_complete(target, format_version):  # another process finished
            return target
        if check is not None:
            check()
        if message:
            print(message, file=sys.stderr, flush=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; a server under another user reads it
            source = build(tmp)
            for f in tmp.rglob("*"):  # some writers (safetensors) leave files owner-only
                f.chmod(f.stat().st_mode | 0o444 | (0o111 if f.is_dir() else 0))
            (tmp / MARKER).write_text(json.dumps({"format": format_version, "source": source}))
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)  # atomic on one filesystem: readers never see half a dir
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        if message:
            print(f"nexus-vllm: model ready at {target}", file=sys.stderr, flush=True)
    return target
