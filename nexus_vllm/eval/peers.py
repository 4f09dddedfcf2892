"""Peer comparison: kvpress's presses on the same model, samples and budgets as ours.

kvpress 0.5.5 needs transformers < 5.3, while vLLM 0.32 needs transformers >= 5.16, so
kvpress gets its own virtualenv, created on demand (``.venv-kvpress`` next to ``.venv``,
or ``$NEXUS_VLLM_KVPRESS_VENV``), and runs ``_kvpress_worker.py`` there on the token ids
our harness produced. :func:`run_kvpress_peer` is ``nexus-vllm eval --peer kvpress``: it
prepares the samples, runs the presses and writes our records.

Two kinds of press, each in kvpress's own protocol:

* ``PROMPT_PRESSES`` compress the context once, when its prefill ends, before the question
  is seen (kvpress's query-agnostic setting): ``compression_ratio`` is ``1 - budget`` for
  a keep ratio, and for a token budget the share of the sample's context it does not keep
  (kvpress has no token budget for them; the ratio is set per sample). They run on the
  one-prompt tasks.
* ``DECODING_PRESSES`` (``decoding_<press>``) are kvpress's ``DecodingPress`` around a
  scorer press, for long generation: the prompt is kept whole, the generated tokens are
  fed as decode steps and the cache is compressed to ``target_size`` tokens every
  ``compression_interval`` (512, kvpress's default) steps. They run on ``longgen``; a token
  budget is the ``target_size``, a ratio budget that share of the tokens before the answer.

The multi-turn families have no kvpress protocol here (kvpress compresses one prompt or
one generation) and are skipped.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer

    from nexus_vllm.eval.records import Record, SampleId
    from nexus_vllm.eval.runner import RunConfig

__all__ = ["DECODING_PRESSES", "KVPRESS_VERSION", "PEER_PRESSES", "PROMPT_PRESSES",
           "KvpressResult", "KvpressSample", "check_presses", "ensure_kvpress_venv",
           "run_kvpress", "run_kvpress_peer"]

KVPRESS_VERSION = "0.5.5"
# kvpress 0.5.5's SnapKVPress, StreamingLLMPress, TOVAPress, KnormPress,
# ExpectedAttentionPress and KVzipPress (``_kvpress_worker.PRESS_CLASSES``).
PROMPT_PRESSES = ("snapkv", "streaming", "tova", "knorm", "expected_attention", "kvzip")
# DecodingPress(base_press=...) around each scorer press (KVzip is not one).
DECODING_PRESSES = ("decoding_snapkv", "decoding_streaming", "decoding_tova",
                    "decoding_knorm", "decoding_expected_attention")
PEER_PRESSES = PROMPT_PRESSES + DECODING_PRESSES
# The long-generation family: decoding presses; the other dialogue families: none.
_DECODING_TASKS = ("longgen",)
_WORKER = pathlib.Path(__file__).with_name("_kvpress_worker.py")


class _KvpressSampleIds(TypedDict):
    key: str
    ids: list[int]  # the full prompt + answer
    n_context: int  # where the context ends
    n_prompt: int  # where the question (or the fed output) ends
    max_new_tokens: int


class KvpressSample(_KvpressSampleIds, total=False):
    """One sample of the worker's job (:func:`run_kvpress`)."""

    feed: str  # "chunk" (one prompt, the default) or "decode" (long generation)
    presses: list[str]  # its own, else the job's
    budgets: list[float | int]  # its own, else the job's


class KvpressResult(TypedDict):
    """One line the worker prints: a sample, a press and a budget."""

    key: str
    press: str
    budget: float | int
    prediction: str
    answer_loglik: float
    dense_answer_loglik: float
    delta_loglik: float
    answer_tokens: int
    kl: float
    kl_answer: float
    cache_tokens: int
    events: int
    seconds: float


def _default_venv() -> pathlib.Path:
    env = os.environ.get("NEXUS_VLLM_KVPRESS_VENV")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(sys.prefix).parent / ".venv-kvpress"


def ensure_kvpress_venv(venv: pathlib.Path | None = None) -> pathlib.Path:
    """Create (once) a virtualenv with kvpress and return its python.

    The virtualenv reads torch from this interpreter's site-packages (a ``.pth`` line
    after its own): the same torch, so numbers are comparable, and no second 1 GB copy
    to install (about 3 of the 5 minutes a fresh one took). kvpress's pinned
    transformers and its other dependencies install into the virtualenv and come first.
    """
    import sysconfig

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
    here = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    (pathlib.Path(purelib) / "_nexus_vllm_torch.pth").write_text(
        "".join(f"{path}\n" for path in sorted(here)))
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         f"torch=={torch_version}", "transformers<5.3", f"kvpress=={KVPRESS_VERSION}"],
        check=True,
    )
    stamp.write_text(KVPRESS_VERSION)
    return python


def check_presses(presses: Iterable[str]) -> list[str]:
    """``presses`` as a list, every name one of ``PEER_PRESSES``.

    Raises
    ------
    ValueError
        Naming the unknown presses and listing the choices.
    """
    presses = list(presses)
    unknown = [p for p in presses if p not in PEER_PRESSES]
    if unknown:
        raise ValueError(f"kvpress peer presses {unknown} unknown; choose from "
                         f"{list(PEER_PRESSES)}")
    if not presses:
        raise ValueError(f"no kvpress peer press given; choose from {list(PEER_PRESSES)}")
    return presses


def _check_budgets(budgets: Sequence[float | int]) -> None:
    """Every budget must pass our one budget rule (a keep ratio or a token count)."""
    from nexus_vllm.core import EvictionConfig

    for b in budgets:
        # The method only names a config; any one applies the same budget rule.
        EvictionConfig.from_budget("streaming", b)


def run_kvpress(
    samples: Iterable[KvpressSample],
    *,
    model: str,
    presses: Iterable[str] | None = None,
    budgets: Iterable[float | int] | None = None,
    python: pathlib.Path | None = None,
    threads: int = 1,
    on_record: Callable[[KvpressResult], None] | None = None,
) -> list[KvpressResult]:
    """Run kvpress presses over prepared samples in the kvpress virtualenv.

    Parameters
    ----------
    samples : iterable of dict
        ``{"key", "ids", "n_context", "n_prompt", "max_new_tokens"}``: the full prompt +
        answer token ids and where the context and the question end; optionally
        ``"feed": "decode"`` (the tokens from ``n_context`` to ``n_prompt`` are the model's
        own output, fed as decode steps: long generation) and the sample's own
        ``"presses"`` and ``"budgets"`` (default: the arguments).
    model : str
        Path of the HF checkpoint (the same one our side loads).
    presses : iterable of str, optional
        Names from ``PEER_PRESSES``, for every sample without its own.
    budgets : iterable of float or int, optional
        Keep ratios in (0, 1] (floats) or token counts (ints), by the budget rule of
        ``EvictionConfig.from_budget``. A prompt press's ``compression_ratio`` keeps that
        share, or that many of the sample's ``n_context`` tokens; a decoding press's
        ``target_size`` is the count, or that share of the tokens before the answer.

    Returns
    -------
    list of dict, one per (sample, press, budget), with the keys the worker prints.
    """
    presses = None if presses is None else check_presses(presses)
    budgets = None if budgets is None else list(budgets)
    if budgets is not None:
        _check_budgets(budgets)
    samples = list(samples)
    for s in samples:  # a sample's own presses and budgets follow the same rules
        own_presses, own_budgets = s.get("presses", presses), s.get("budgets", budgets)
        if own_presses is None or own_budgets is None:
            raise ValueError(f"sample {s.get('key')!r} has no presses or budgets, and none "
                             f"were given for every sample")
        if "presses" in s or "budgets" in s:
            check_presses(own_presses)
            _check_budgets(list(own_budgets))
    python = python or ensure_kvpress_venv()
    job = {"model": model, "presses": presses or [], "budgets": budgets or [],
           "threads": threads, "samples": samples}
    records: list[KvpressResult] = []
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
            rec: KvpressResult = json.loads(line)
            records.append(rec)
            if on_record is not None:
                on_record(rec)
        if proc.wait() != 0:
            raise RuntimeError(f"kvpress worker failed with exit code {proc.returncode}")
    finally:
        os.unlink(job_path)
    return records


def run_kvpress_peer(cfg: RunConfig, out: pathlib.Path,
                     presses: Iterable[str] | None = None) -> list[Record]:
    """kvpress presses on exactly ``cfg``'s samples' token ids (own virtualenv).

    Records go to ``out/kvpress_records.jsonl`` (resumable per sample, press and budget) in
    our record format, with methods named ``kvpress:<press>`` and seed 0. Prompt presses
    run on the one-prompt tasks at ``cfg``'s budgets (one event: the press
    compresses once, when the context's prefill ends); decoding presses run on ``longgen``
    at every budget (events: the compressions before the answer). The multi-turn families
    are skipped.

    Parameters
    ----------
    presses : iterable of str, optional
        Names from ``PEER_PRESSES`` (default: all of them); each runs where it applies.

    Returns
    -------
    list of Record: every peer record, earlier ones included.
    """
    from transformers import AutoTokenizer

    from nexus_vllm.eval.records import read_records, record_writer
    from nexus_vllm.models import resolve_model_path

    chosen = check_presses(PEER_PRESSES if presses is None else presses)
    path = resolve_model_path(None if cfg.model == "default" else cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rec_path = out / "kvpress_records.jsonl"
    records = read_records(rec_path)
    seen = {r.key for r in records}
    jobs, meta = _peer_jobs(cfg, chosen, tokenizer, seen)
    if not jobs:
        return records
    with record_writer(rec_path) as write:
        def on_record(r: KvpressResult) -> None:
            rec = _peer_record(r, meta[r["key"]])
            if rec.key in seen:  # re-run of a partially finished sample
                return
            seen.add(rec.key)
            write(rec)
            records.append(rec)

        run_kvpress(jobs, model=path, threads=cfg.threads, on_record=on_record)
    return records


@dataclass(frozen=True)
class _PeerSample:
    """What our side knows of a peer job's sample, to turn the worker's lines into records."""

    sid: SampleId
    score: Callable[[str], float]  # of a prediction
    answers: tuple[str, ...]
    prompt_tokens: int


def _peer_jobs(cfg: RunConfig, chosen: list[str], tokenizer: Tokenizer, seen: set[str]
               ) -> tuple[list[KvpressSample], dict[str, _PeerSample]]:
    """The worker's samples for ``cfg`` (only the presses with a budget not on record in
    ``seen``), and what our side keeps of each, by the sample's key."""
    from nexus_vllm.eval.dialogues import DIALOGUE_TASKS
    from nexus_vllm.eval.records import record_key
    from nexus_vllm.eval.runner import iter_samples

    jobs: list[KvpressSample] = []
    meta: dict[str, _PeerSample] = {}
    for sid in iter_samples(cfg):
        kind: tuple[str, ...]
        if sid.task in _DECODING_TASKS:
            kind, budgets = DECODING_PRESSES, list(cfg.budgets)
        elif sid.task in DIALOGUE_TASKS:  # multi-turn: no kvpress protocol
            continue
        else:
            kind, budgets = PROMPT_PRESSES, list(cfg.budgets)
        # Only the (press, budget) pairs not on record yet; a press with any missing runs
        # all its budgets again (the repeats are not written twice).
        todo = [p for p in chosen if p in kind and any(
            record_key(sid, f"kvpress:{p}", b, 0) not in seen for b in budgets)]
        if not todo or not budgets:
            continue
        key = json.dumps(sid.as_list())
        make = _decoding_job if sid.task in _DECODING_TASKS else _prompt_job
        job, meta[key] = make(cfg, sid, tokenizer, key)
        job["presses"], job["budgets"] = todo, budgets
        jobs.append(job)
    return jobs, meta


def _decoding_job(cfg: RunConfig, sid: SampleId, tokenizer: Tokenizer, key: str
                  ) -> tuple[KvpressSample, _PeerSample]:
    """A long generation's worker sample: its own output fed as decode steps."""
    from nexus_vllm.eval.dialogues import make_dialogue

    d = make_dialogue(sid.task, seed=cfg.data_seed, index=sid.index,
                      target_tokens=sid.context, tokenizer=tokenizer)
    (turn,) = d.turns
    probe = turn.probe
    job: KvpressSample = {"key": key, "ids": list(d.ids[:probe.answer_end]), "feed": "decode",
                          "n_context": probe.prompt_end, "n_prompt": probe.forced_end,
                          "max_new_tokens": probe.max_new_tokens}
    return job, _PeerSample(sid, functools.partial(d.score, 0), turn.answers, d.num_tokens)


def _prompt_job(cfg: RunConfig, sid: SampleId, tokenizer: Tokenizer, key: str
                ) -> tuple[KvpressSample, _PeerSample]:
    """A one-prompt task's worker sample: context, question and answer token ids."""
    from nexus_vllm.eval.tasks import make_sample
    from nexus_vllm.hf.generate import encode_prompt

    s = make_sample(sid.task, seed=cfg.data_seed, index=sid.index,
                    target_tokens=sid.context, tokenizer=tokenizer, protocol=sid.protocol)
    split = encode_prompt(tokenizer, s.context, s.question, preamble=s.preamble,
                          answer=s.target)
    job: KvpressSample = {"key": key, "ids": split.ids.tolist(), "n_context": split.n_context,
                          "n_prompt": split.n_prompt, "max_new_tokens": s.max_new_tokens}
    return job, _PeerSample(sid, s.score, tuple(s.answers), s.num_tokens)


def _peer_record(r: KvpressResult, peer: _PeerSample) -> Record:
    """Our record of one worker line (a sample, a press and a budget)."""
    from nexus_vllm.eval.records import Record

    decoding = peer.sid.task in _DECODING_TASKS
    value = peer.score(r["prediction"])
    return Record.build(
        peer.sid, f"kvpress:{r['press']}", r["budget"], 0, score=value,
        prediction=r["prediction"], answers=peer.answers,
        answer_loglik=r["answer_loglik"], dense_answer_loglik=r["dense_answer_loglik"],
        answer_tokens=r["answer_tokens"], kl=r["kl"], kl_answer=r["kl_answer"],
        prompt_tokens=peer.prompt_tokens, cache_tokens=r["cache_tokens"],
        events=r.get("events", 1), seconds=r["seconds"],
        # A long generation is a one-turn stream: per-turn fields as our side's.
        turn_scores=[value] if decoding else (),
        turn_delta_loglik=([r["answer_loglik"] - r["dense_answer_loglik"]]
                           if decoding else ()))
