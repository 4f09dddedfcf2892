"""Evaluation loop: tasks x protocols x samples, dense once per sample, then every method.

Each run is one :func:`nexus_vllm.hf.run_sample` call (one streamed prefill, then greedy
generation and teacher forcing of the reference answer on two branches). Records are
appended to ``records.jsonl`` as they finish, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from nexus_vllm.core import EvictionConfig
from nexus_vllm.eval.records import Record, SampleId, read_records, record_key, record_writer
from nexus_vllm.eval.tasks import Sample, make_sample
from nexus_vllm.hf import SampleResult, run_sample

__all__ = ["MethodSpec", "Run", "RunConfig", "config_dict", "iter_runs", "iter_samples",
           "kl_to_dense", "parse_method", "run_eval"]


@dataclass(frozen=True)
class MethodSpec:
    """A method and its knob overrides, written ``name`` or ``name:k=v,k=v`` on the CLI."""

    label: str
    method: str
    knobs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def stochastic(self) -> bool:
        """Whether the method's choice depends on the seed (then several seeds run)."""
        if self.method in ("dense", "none"):
            return False
        return EvictionConfig(method=self.method, **self.knobs).policy().stochastic


DENSE = MethodSpec("dense", "dense")


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_method(spec: str) -> MethodSpec:
    """``"nexus:sampler=ares,n=8"`` -> MethodSpec(label=spec, method="nexus", knobs=...)."""
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    knobs: dict[str, Any] = {}
    if rest:
        for item in rest.split(","):
            k, eq, v = item.partition("=")
            if not eq or not k.strip():
                raise ValueError(f"method knob must be key=value, got {item!r} in {spec!r}")
            knobs[k.strip()] = _value(v.strip())
    if not name:
        raise ValueError(f"empty method in {spec!r}")
    return MethodSpec(label=spec, method=name, knobs=knobs)


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines an evaluation run (written to config.yaml)."""

    model: str
    tasks: tuple[str, ...]
    methods: tuple[str, ...]
    budgets: tuple[float | int, ...]
    contexts: tuple[int, ...]
    protocols: tuple[str, ...]
    samples: int
    seeds: int  # sampler seeds per sample, for stochastic methods
    data_seed: int  # which set of generated samples (tune on one, report on another)
    chunk_size: int = 512
    knobs: dict[str, Any] = field(default_factory=dict)  # applied to every eviction method
    threads: int = 1

    def __post_init__(self) -> None:
        if self.samples < 1 or self.seeds < 1:
            raise ValueError("samples and seeds must be >= 1")
        if not self.tasks or not self.methods or not self.contexts or not self.protocols:
            raise ValueError("tasks, methods, contexts and protocols must be non-empty")
        # Every (method, budget) must make a config, checked now rather than hours into
        # the run: the budget rule, the knobs, and a token budget's floor.
        for spec in (parse_method(m) for m in self.methods):
            if spec.method == "dense":
                continue
            knobs = {"chunk_size": self.chunk_size, **self.knobs, **spec.knobs}
            for b in self.budgets:
                try:
                    EvictionConfig.from_budget(spec.method, b, **knobs)
                except ValueError as exc:
                    raise ValueError(f"method {spec.label!r} at budget {b!r}: {exc}") from None


@dataclass(frozen=True)
class Run:
    """One run: a sample, a method and, for eviction methods, a budget and a seed."""

    sample: SampleId
    method: MethodSpec
    budget: float | int | None
    seed: int

    @property
    def key(self) -> str:
        return record_key(self.sample, self.method.label, self.budget, self.seed)


def iter_samples(cfg: RunConfig) -> Iterator[SampleId]:
    """Every sample of ``cfg`` in execution order (contexts, tasks, indices, protocols)."""
    for context in cfg.contexts:
        for task in cfg.tasks:
            for index in range(cfg.samples):
                for protocol in cfg.protocols:
                    yield SampleId(task, context, protocol, index)


def iter_runs(cfg: RunConfig) -> Iterator[Run]:
    """Every run of ``cfg`` in execution order: per sample, dense, then each method x
    budget x seed (one seed for deterministic methods)."""
    specs = [parse_method(m) for m in cfg.methods]
    for sid in iter_samples(cfg):
        yield Run(sid, DENSE, None, 0)
        for spec in specs:
            if spec.method == "dense":
                continue
            for budget in cfg.budgets:
                for seed in range(cfg.seeds if spec.stochastic else 1):
                    yield Run(sid, spec, budget, seed)


def kl_to_dense(dense: SampleResult, other: SampleResult) -> tuple[float, float]:
    """Mean KL(dense || other) of next-token distributions: (question+answer, answer only)."""
    p, q = dense.logprobs, other.logprobs
    if p.shape != q.shape:
        raise ValueError(f"logprob shapes differ: {tuple(p.shape)} vs {tuple(q.shape)}")
    kl = (p.exp() * (p - q)).sum(-1).clamp_min(0)  # [P]
    return float(kl.mean()), float(kl[-dense.n_answer:].mean())


def run_eval(cfg: RunConfig, model: Any, tokenizer: Any, out_dir: pathlib.Path, *,
             progress: bool = True,
             log: Callable[[Record], None] | None = None) -> list[Record]:
    """Run (or resume) every run of ``cfg``; return all records (also in records.jsonl)."""
    from tqdm import tqdm

    path = out_dir / "records.jsonl"
    records = read_records(path)
    done = {r.key for r in records}
    runs = list(iter_runs(cfg))
    bar = tqdm(total=len(runs), disable=not progress, desc="eval", dynamic_ncols=True,
               initial=sum(1 for r in runs if r.key in done))
    # Runs are grouped by sample: only the current sample and its dense result are kept.
    sample: Sample | None = None
    dense: tuple[SampleResult, float] | None = None
    current: SampleId | None = None
    with record_writer(path) as write:
        for run in runs:
            if run.key in done:
                continue
            sid = run.sample
            if sid != current:
                current = sid
                sample = make_sample(sid.task, seed=cfg.data_seed, index=sid.index,
                                     target_tokens=sid.context, tokenizer=tokenizer,
                                     protocol=sid.protocol)
                dense = _run(model, tokenizer, sample, "dense", None, 0, {}, cfg)
            assert sample is not None and dense is not None
            if run.method.method == "dense":
                res, secs = dense
            else:
                knobs = {**cfg.knobs, **run.method.knobs}
                res, secs = _run(model, tokenizer, sample, run.method.method, run.budget,
                                 run.seed, knobs, cfg)
            kl_all, kl_ans = kl_to_dense(dense[0], res)
            rec = Record.build(
                sid, run.method.label, run.budget, run.seed, score=sample.score(res.text),
                prediction=res.text, answers=sample.answers, answer_loglik=res.answer_loglik,
                dense_answer_loglik=dense[0].answer_loglik, answer_tokens=res.n_answer,
                kl=kl_all, kl_answer=kl_ans, prompt_tokens=sample.num_tokens,
                cache_tokens=res.cache_tokens, events=res.events, seconds=secs,
            )
            write(rec)
            records.append(rec)
            done.add(run.key)
            bar.update(1)
            if log is not None:
                log(rec)
    bar.close()
    return records


def _run(model: Any, tokenizer: Any, sample: Sample, method: str, budget: Any, seed: int,
         knobs: dict[str, Any], cfg: RunConfig) -> tuple[SampleResult, float]:
    t0 = time.perf_counter()
    res = run_sample(model, tokenizer, sample.context, sample.question, sample.target,
                     method=method, budget=budget, chunk_size=cfg.chunk_size,
                     max_new_tokens=sample.max_new_tokens, seed=seed,
                     preamble=sample.preamble, **knobs)
    return res, time.perf_counter() - t0


def config_dict(cfg: RunConfig) -> dict[str, Any]:
    """``cfg`` as plain YAML/JSON data (lists, not tuples), plus the torch version."""
    d = asdict(cfg)
    d["torch"] = str(torch.__version__)
    d["budgets"] = list(cfg.budgets)
    for k in ("tasks", "methods", "contexts", "protocols"):
        d[k] = list(d[k])
    return d
