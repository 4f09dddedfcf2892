"""Peer comparison: kvpress's presses on the same model, samples and budgets as ours.

kvpress needs transformers < 5.3 and vLLM >= 5.16, so kvpress gets its own virtualenv,
created on demand (``.venv-kvpress`` next to ``.venv``, or ``$NEXUS_VLLM_KVPRESS_VENV``),
and runs ``_kvpress_worker.py`` there on the token ids our harness produced.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["KVPRESS_VERSION", "PEER_PRESSES", "ensure_kvpress_venv", "run_kvpress"]

KVPRESS_VERSION = "0.5.5"
PEER_PRESSES = ("snapkv", "streaming", "tova", "knorm", "expected_attention")
_WORKER = pathlib.Path(__file__).with_name("_kvpress_worker.py")


def _default_venv() -> pathlib.Path:
    env = os.environ.get("NEXUS_VLLM_KVPRESS_VENV")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(sys.prefix).parent / ".venv-kvpress"


def ensure_kvpress_venv(venv: pathlib.Path | None = None) -> pathlib.Path:
    """Create (once) a virtualenv with kvpress and return its python.

    torch is pinned to the version running here so that numbers are comparable and pip
    takes the same local wheel.
    """
    import torch

    venv = venv or _default_venv()
    python = venv / "bin" / "python"
    stamp = venv / ".nexus_vllm_kvpress"
    if stamp.exists():
        return python
    torch_version = torch.__version__.split("+")[0]
    print(f"[peer] creating kvpress virtualenv at {venv} (first time only, a few minutes)",
          file=sys.stderr, flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         f"torch=={torch_version}", "transformers<5.3", f"kvpress=={KVPRESS_VERSION}"],
        check=True,
    )
    stamp.write_text(KVPRESS_VERSION)
    return python


def run_kvpress(
    samples: Iterable[dict[str, Any]],
    *,
    model: str,
    presses: Iterable[str],
    budgets: Iterable[float],
    python: pathlib.Path | None = None,
    threads: int = 1,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run kvpress presses over prepared samples in the kvpress virtualenv.

    Parameters
    ----------
    samples : iterable of dict
        ``{"key", "ids", "n_context", "n_prompt", "max_new_tokens"}``: the full prompt +
        answer token ids and where the context and the question end.
    model : str
        Path of the HF checkpoint (the same one our side loads).
    presses : iterable of str
        Names from ``PEER_PRESSES``.
    budgets : iterable of float
        Kept fractions in (0, 1]; kvpress's ``compression_ratio`` is ``1 - budget``.

    Returns
    -------
    list of dict, one per (sample, press, budget), with the keys the worker prints.
    """
    presses = list(presses)
    unknown = sorted(set(presses) - set(PEER_PRESSES))
    if unknown:
        raise ValueError(f"--peer presses {unknown} unknown; allowed: {list(PEER_PRESSES)}")
    budgets = [float(b) for b in budgets]
    if any(not 0 < b <= 1 for b in budgets):
        raise ValueError(f"peer budgets must be ratios in (0, 1]; got {budgets}")
    python = python or ensure_kvpress_venv()
    job = {"model": model, "presses": presses, "budgets": budgets, "threads": threads,
           "samples": list(samples)}
    records: list[dict[str, Any]] = []
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(job, fh)
        job_path = fh.name
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.Popen([str(python), str(_WORKER), job_path], stdout=subprocess.PIPE,
                                text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            records.append(rec)
            if on_record is not None:
                on_record(rec)
        if proc.wait() != 0:
            raise RuntimeError(f"kvpress worker failed with exit code {proc.returncode}")
    finally:
        os.unlink(job_path)
    return records
