"""Evaluation loop: tasks x protocols x samples, dense once per sample, then every method.

Each run is one :func:`nexus_vllm.hf.run_sample` call (one streamed prefill, then greedy
generation and teacher forcing of the reference answer on two branches). Records are
appended to ``records.jsonl`` as they finish, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import pathlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from nexus_vllm.eval.tasks import Sample, make_sample
from nexus_vllm.hf import SampleResult, run_sample

__all__ = ["MethodSpec", "RunConfig", "aggregate", "bootstrap_ci", "iter_runs", "kl_to_dense",
           "parse_method", "run_eval"]

STOCHASTIC = ("nexus", "random")


@dataclass(frozen=True)
class MethodSpec:
    """A method and its knob overrides, written ``name`` or ``name:k=v,k=v`` on the CLI."""

    label: str
    method: str
    knobs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def stochastic(self) -> bool:
        sampler = self.knobs.get("sampler", "pps")
        return self.method == "random" or (self.method == "nexus" and sampler != "topk")


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
        for b in self.budgets:
            if isinstance(b, float) and not 0 < b <= 1:
                raise ValueError(f"budgets: a ratio must be in (0, 1], got {b}")
            if isinstance(b, int) and b < 1:
                raise ValueError(f"budgets: a token count must be >= 1, got {b}")
        if not self.tasks or not self.methods or not self.contexts or not self.protocols:
            raise ValueError("tasks, methods, contexts and protocols must be non-empty")
        for m in self.methods:
            parse_method(m)


def kl_to_dense(dense: SampleResult, other: SampleResult) -> tuple[float, float]:
    """Mean KL(dense || other) of next-token distributions: (question+answer, answer only)."""
    p, q = dense.logprobs, other.logprobs
    if p.shape != q.shape:
        raise ValueError(f"logprob shapes differ: {tuple(p.shape)} vs {tuple(q.shape)}")
    kl = (p.exp() * (p - q)).sum(-1).clamp_min(0)  # [P]
    return float(kl.mean()), float(kl[-dense.n_answer:].mean())


def iter_runs(cfg: RunConfig) -> Iterator[tuple[str, int, str, int, MethodSpec, Any, int]]:
    """(task, context, protocol, index, method, budget, seed) in execution order."""
    specs = [parse_method(m) for m in cfg.methods]
    for context in cfg.contexts:
        for task in cfg.tasks:
            for index in range(cfg.samples):
                for protocol in cfg.protocols:
                    yield task, context, protocol, index, MethodSpec("dense", "dense"), None, 0
                    for spec in specs:
                        if spec.method == "dense":
                            continue
                        for budget in cfg.budgets:
                            for seed in range(cfg.seeds if spec.stochastic else 1):
                                yield task, context, protocol, index, spec, budget, seed


def _key(task: str, context: int, protocol: str, index: int, label: str, budget: Any,
         seed: int) -> str:
    return json.dumps([task, context, protocol, index, label, budget, seed])


def run_eval(cfg: RunConfig, model: Any, tokenizer: Any, out_dir: pathlib.Path, *,
             progress: bool = True, log: Any = None) -> list[dict[str, Any]]:
    """Run (or resume) every run of ``cfg``; return all records (also in records.jsonl)."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "records.jsonl"
    records: list[dict[str, Any]] = []
    done: set[str] = set()
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                records.append(rec)
                done.add(rec["key"])
    runs = list(iter_runs(cfg))
    bar = tqdm(total=len(runs), disable=not progress, desc="eval", dynamic_ncols=True,
               initial=sum(1 for r in runs if _key(*r[:4], r[4].label, *r[5:]) in done))
    samples: dict[tuple[str, int, str, int], Sample] = {}
    dense: dict[tuple[str, int, str, int], SampleResult] = {}
    dense_secs = 0.0
    with path.open("a") as fh:
        for task, context, protocol, index, spec, budget, seed in runs:
            key = _key(task, context, protocol, index, spec.label, budget, seed)
            if key in done:
                continue
            sid = (task, context, protocol, index)
            if sid not in samples:  # runs are grouped by sample: keep only the current one
                samples = {sid: make_sample(task, seed=cfg.data_seed, index=index,
                                            target_tokens=context, tokenizer=tokenizer,
                                            protocol=protocol)}
            sample = samples[sid]
            if sid not in dense:
                dense_res, dense_secs = _run(model, tokenizer, sample, "dense", None, 0, {}, cfg)
                dense = {sid: dense_res}
            if spec.method == "dense":
                res, secs = dense[sid], dense_secs
            else:
                knobs = {**cfg.knobs, **spec.knobs}
                res, secs = _run(model, tokenizer, sample, spec.method, budget, seed, knobs, cfg)
            kl_all, kl_ans = kl_to_dense(dense[sid], res)
            rec = {
                "key": key, "task": task, "context": context, "protocol": protocol,
                "index": index, "method": spec.label, "budget": budget, "seed": seed,
                "score": sample.score(res.text), "prediction": res.text,
                "answers": list(sample.answers), "answer_loglik": res.answer_loglik,
                "dense_answer_loglik": dense[sid].answer_loglik,
                "delta_loglik": res.answer_loglik - dense[sid].answer_loglik,
                "answer_tokens": res.n_answer, "kl": kl_all, "kl_answer": kl_ans,
                "prompt_tokens": sample.num_tokens, "cache_tokens": res.cache_tokens,
                "events": res.events,
                "seconds": secs,
            }
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            records.append(rec)
            done.add(key)
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


# ---------------------------------------------------------------------------- statistics
def bootstrap_ci(values: Iterable[float], *, n_boot: int = 2000, alpha: float = 0.05,
                 seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap interval of the mean (95% by default)."""
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if x.size == 1 or np.all(x == x[0]):
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    boots = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return mean, float(lo), float(hi)


METRICS = ("score", "delta_loglik", "kl", "kl_answer")


def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and 95% CI per (task, context, protocol, method, budget).

    Seeds are averaged within a sample first, so the interval is over samples (the unit
    that varies the data), not inflated by sampler seeds.
    """
    groups: dict[tuple[Any, ...], dict[int, list[dict[str, Any]]]] = {}
    for r in records:
        g = (r["task"], r["context"], r["protocol"], r["method"], r["budget"])
        groups.setdefault(g, {}).setdefault(r["index"], []).append(r)
    # Methods in the order they were run (dense first), everything else sorted.
    order = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in records))}
    rows = []
    for (task, context, protocol, method, budget), by_sample in sorted(
            groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2], order[kv[0][3]],
                                            -1.0 if kv[0][4] is None else float(kv[0][4]))):
        row: dict[str, Any] = {"task": task, "context": context, "protocol": protocol,
                               "method": method, "budget": budget, "n": len(by_sample),
                               "runs": sum(len(v) for v in by_sample.values())}
        for m in METRICS:
            per_sample = [float(np.mean([r[m] for r in rs])) for rs in by_sample.values()]
            mean, lo, hi = bootstrap_ci(per_sample)
            row[m], row[f"{m}_lo"], row[f"{m}_hi"] = mean, lo, hi
        row["seconds"] = float(np.mean([r["seconds"] for rs in by_sample.values() for r in rs]))
        rows.append(row)
    return rows


def config_dict(cfg: RunConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["torch"] = str(torch.__version__)
    d["budgets"] = list(cfg.budgets)
    for k in ("tasks", "methods", "contexts", "protocols"):
        d[k] = list(d[k])
    return d
