"""Peer comparison: kvpress's presses on the same model, samples and budgets as ours.

kvpress 0.5.5 needs transformers < 5.3, while vLLM 0.32 needs transformers >= 5.16, so
kvpress gets its own virtualenv, created on demand (``.venv-kvpress`` next to ``.venv``,
or ``$NEXUS_VLLM_KVPRESS_VENV``), and runs ``_kvpress_worker.py`` there on the token ids
our harness produced. :func:`run_kvpress_peer` is ``nexus-vllm eval --peer kvpress``: it
prepares the samples, runs the presses and writes our records.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nexus_vllm.eval.records import Record, SampleId
    from nexus_vllm.eval.runner import RunConfig

__all__ = ["KVPRESS_VERSION", "PEER_PRESSES", "ensure_kvpress_venv", "run_kvpress",
           "run_kvpress_peer"]

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


def _check_ratios(budgets: list[Any]) -> None:
    """kvpress compresses by a ratio: every budget must be a keep ratio by our one rule."""
    from nexus_vllm.core import EvictionConfig

    for b in budgets:
        if not isinstance(b, float):
            raise ValueError(f"peer budgets must be keep ratios (floats in (0, 1]); kvpress "
                             f"has no token budget; got {b!r}")
        # The method only names a config; any one applies the same ratio rule.
        EvictionConfig.from_budget("streaming", b)


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
        Keep ratios in (0, 1] (floats, by the budget rule of
        ``EvictionConfig.from_budget``); kvpress's ``compression_ratio`` is ``1 - budget``.

    Returns
    -------
    list of dict, one per (sample, press, budget), with the keys the worker prints.
    """
    presses = list(presses)
    unknown = sorted(set(presses) - set(PEER_PRESSES))
    if unknown:
        raise ValueError(f"--peer presses {unknown} unknown; allowed: {list(PEER_PRESSES)}")
    budgets = list(budgets)
    _check_ratios(budgets)
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


def run_kvpress_peer(cfg: RunConfig, out: pathlib.Path) -> list[Record]:
    """kvpress presses on exactly ``cfg``'s samples' token ids (own virtualenv).

    Records go to ``out/kvpress_records.jsonl`` (resumable per sample) in our record
    format, with methods named ``kvpress:<press>``, seed 0 and one event (the press
    compresses once, when the context's prefill ends). Only ``cfg``'s ratio budgets run.

    Returns
    -------
    list of Record: every peer record, earlier ones included.
    """
    from transformers import AutoTokenizer

    from nexus_vllm.eval.dialogues import DIALOGUE_TASKS
    from nexus_vllm.eval.records import Record, read_records, record_writer
    from nexus_vllm.eval.runner import iter_samples
    from nexus_vllm.eval.tasks import Sample, make_sample
    from nexus_vllm.hf.generate import encode_prompt
    from nexus_vllm.models import resolve_model_path

    path = resolve_model_path(None if cfg.model == "default" else cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rec_path = out / "kvpress_records.jsonl"
    records = read_records(rec_path)
    budgets = [b for b in cfg.budgets if isinstance(b, float)]
    per_sample: dict[SampleId, int] = {}
    for r in records:
        per_sample[r.sample] = per_sample.get(r.sample, 0) + 1
    # A sample is done when every press x budget came back (the worker streams per sample).
    done = {k for k, n in per_sample.items() if n >= len(PEER_PRESSES) * len(budgets)}
    jobs: list[dict[str, Any]] = []
    meta: dict[str, tuple[SampleId, Sample]] = {}
    for sid in iter_samples(cfg):
        if sid in done or sid.task in DIALOGUE_TASKS:  # kvpress compresses one prompt
            continue
        s = make_sample(sid.task, seed=cfg.data_seed, index=sid.index,
                        target_tokens=sid.context, tokenizer=tokenizer, protocol=sid.protocol)
        split = encode_prompt(tokenizer, s.context, s.question, preamble=s.preamble,
                              answer=s.target)
        key = json.dumps(sid.as_list())
        meta[key] = (sid, s)
        jobs.append({"key": key, "ids": split.ids.tolist(), "n_context": split.n_context,
                     "n_prompt": split.n_prompt, "max_new_tokens": s.max_new_tokens})
    if not jobs:
        return records
    seen = {r.key for r in records}
    with record_writer(rec_path) as write:
        def on_record(r: dict[str, Any]) -> None:
            sid, s = meta[r["key"]]
            rec = Record.build(
                sid, f"kvpress:{r['press']}", r["budget"], 0, score=s.score(r["prediction"]),
                prediction=r["prediction"], answers=s.answers,
                answer_loglik=r["answer_loglik"], dense_answer_loglik=r["dense_answer_loglik"],
                answer_tokens=r["answer_tokens"], kl=r["kl"], kl_answer=r["kl_answer"],
                prompt_tokens=s.num_tokens, cache_tokens=r["cache_tokens"], events=1,
                seconds=r["seconds"])
            if rec.key in seen:  # re-run of a partially finished sample
                return
            seen.add(rec.key)
            write(rec)
            records.append(rec)

        run_kvpress(jobs, model=path, presses=PEER_PRESSES, budgets=budgets,
                    threads=cfg.threads, on_record=on_record)
    return records
