"""Evaluation loop: tasks x protocols x samples, dense once per sample, then every method.

Each run is one :func:`nexus_vllm.hf.run_sample` call (one streamed prefill, then greedy
generation and teacher forcing of the reference answer on two branches), or for the
multi-turn families (:mod:`nexus_vllm.eval.dialogues`) one
:func:`nexus_vllm.hf.dialogue.run_probes` call (every turn a request, as a server sees
them). Records are appended to ``records.jsonl`` as they finish, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

import itertools
import pathlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from nexus_vllm.core import POLICIES, EvictionConfig
from nexus_vllm.eval.dialogues import DIALOGUE_TASKS, Dialogue, dialogue_protocol, make_dialogue
from nexus_vllm.eval.oracle import ORACLE, ORACLE_BASE, answer_blocks, oracle_config
from nexus_vllm.eval.records import Record, SampleId, read_records, record_key, record_writer
from nexus_vllm.eval.tasks import CHAT_ONLY_TASKS, Sample, make_sample
from nexus_vllm.hf import SampleResult, make_config
from nexus_vllm.hf.dialogue import ProbeResult, run_probes
from nexus_vllm.hf.generate import (
    PromptState,
    encode_prompt,
    eos_ids,
    finish_sample,
    greedy_text,
    prefill_sample,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["MethodSpec", "Run", "RunConfig", "config_dict", "iter_runs", "iter_samples",
           "kl_to_dense", "parse_method", "run_eval"]


@dataclass(frozen=True)
class MethodSpec:
    """A method and its knob overrides, written ``name`` or ``name:k=v,k=v`` on the CLI."""

    label: str
    method: str
    knobs: dict[str, object] = field(default_factory=dict, hash=False, compare=False)

    @property
    def policy_method(self) -> str:
        """The registered policy the method evicts with (the oracle's: its base)."""
        return ORACLE_BASE if self.method == ORACLE else self.method

    @property
    def stochastic(self) -> bool:
        """Whether the method's choice depends on the seed (then several seeds run)."""
        if self.method in ("dense", "none"):
            return False
        config = EvictionConfig.from_dict({**self.knobs, "method": self.policy_method})
        return config.event_policies().decode.stochastic


DENSE = MethodSpec("dense", "dense")


def _value(text: str) -> int | float | str:
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
    knobs: dict[str, object] = {}
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
    # Applied to every eviction method; a knob of some policies (``prefill_direct``) only
    # to the methods that take it, so one run can pin a policy's knob for all its methods.
    knobs: dict[str, object] = field(default_factory=dict)
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
            knobs = {"chunk_size": self.chunk_size, **self.knobs_for(spec)}
            for b in self.budgets:
                try:
                    EvictionConfig.from_budget(spec.policy_method, b, **knobs)
                except ValueError as exc:
                    raise ValueError(f"method {spec.label!r} at budget {b!r}: {exc}") from None

    def knobs_for(self, spec: MethodSpec) -> dict[str, object]:
        """The run's knobs, then the method's own. A run-level knob of policies other than
        ``spec``'s (``prefill_direct`` is Nexus's) is left out for it."""
        method = spec.policy_method
        takes = set(POLICIES[method].knobs()) if method in POLICIES else set()
        others = {k for cls in POLICIES.values() for k in cls.knobs()} - takes
        run = {k: v for k, v in self.knobs.items()
               if k.removeprefix("prefill_") not in others}
        return {**run, **spec.knobs}


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
    """Every sample of ``cfg`` in execution order (contexts, tasks, indices, protocols).

    A multi-turn family runs once per sample whatever ``protocols`` says, as
    ``question-last`` (each of its questions follows the material it is asked after), or
    ``chat`` for its chat-shaped variants. A chat-only task runs in the ``chat`` protocol
    only.
    """
    for context in cfg.contexts:
        for task in cfg.tasks:
            if task in DIALOGUE_TASKS:
                # A conversation runs in its own shape (chat_multiturn is chat-shaped).
                protocols: tuple[str, ...] = (dialogue_protocol(task),)
            elif task in CHAT_ONLY_TASKS:
                protocols = tuple(p for p in cfg.protocols if p == "chat")
            else:
                protocols = cfg.protocols
            for index in range(cfg.samples):
                for protocol in protocols:
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
    kl = _kl(dense.logprobs, other.logprobs)  # [P]
    return float(kl.mean()), float(kl[-dense.n_answer:].mean())


def run_eval(cfg: RunConfig, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: pathlib.Path, *,
             progress: bool = True,
             log: Callable[[Record], None] | None = None) -> list[Record]:
    """Run (or resume) every run of ``cfg``; return all records (also in records.jsonl)."""
    from tqdm import tqdm

    path = out_dir / "records.jsonl"
    records = read_records(path)
    done = {r.key for r in records}
    runs = list(iter_runs(cfg))
    bar = tqdm(total=len(runs), disable=not progress, desc=f"eval {out_dir.name}", dynamic_ncols=True,
               initial=sum(1 for r in runs if r.key in done))
    # Runs are grouped by sample: only the current sample and its dense result are kept.
    with record_writer(path) as write:
        for sid, todo in itertools.groupby((r for r in runs if r.key not in done),
                                           key=lambda r: r.sample):
            for run, rec in _sample_records(cfg, model, tokenizer, sid, todo):
                write(rec)
                records.append(rec)
                done.add(run.key)
                bar.update(1)
                if log is not None:
                    log(rec)
    bar.close()
    return records


def _sample_records(cfg: RunConfig, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                    sid: SampleId, runs: Iterable[Run]) -> Iterator[tuple[Run, Record]]:
    """Each of ``runs`` (all of sample ``sid``) and its record, dense run first."""
    if sid.task in DIALOGUE_TASKS:
        dialogue = make_dialogue(sid.task, seed=cfg.data_seed, index=sid.index,
                                 target_tokens=sid.context, tokenizer=tokenizer)
        return _job_records(_DialogueJob(cfg, model, tokenizer, sid, dialogue), runs)
    sample = make_sample(sid.task, seed=cfg.data_seed, index=sid.index,
                         target_tokens=sid.context, tokenizer=tokenizer, protocol=sid.protocol)
    return _job_records(_SampleJob(cfg, model, tokenizer, sid, sample), runs)


_Result = TypeVar("_Result")


class _Job(Protocol[_Result]):
    """The runs of one sample (:class:`_SampleJob`, :class:`_DialogueJob`)."""

    def run(self, spec: MethodSpec, budget: float | int | None, seed: int,
            dense: _Result | None = None) -> tuple[_Result, Record]: ...


def _job_records(job: _Job[_Result], runs: Iterable[Run]) -> Iterator[tuple[Run, Record]]:
    """Dense once, then each of ``runs`` against it (a dense run is that record)."""
    dense = job.run(DENSE, None, 0)
    for run in runs:
        yield run, dense[1] if run.method.method == "dense" else job.run(
            run.method, run.budget, run.seed, dense[0])[1]


def _capture_rows(cfg: RunConfig) -> int:
    """Query rows the dense prompt state keeps, enough for every method's windows."""
    rows = 0
    for spec in (parse_method(m) for m in cfg.methods):
        if spec.method != "dense":
            c = EvictionConfig.from_dict({**cfg.knobs_for(spec), "method": spec.policy_method})
            rows = max(rows, c.window, c.prompt_window)
    return rows


@dataclass
class _SampleJob:
    """Runs of one single-question sample.

    A method that does not evict before the prompt's end (``prompt_mode`` ``end`` without
    ``prefill_budget``, or ``keep``) starts from the dense run's prompt state, which is
    exactly the state its own prefill would reach (``PromptState.fork``): those runs cost
    an event and the decoding only.
    """

    cfg: RunConfig
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    sid: SampleId
    sample: Sample
    dense_prompt: PromptState | None = None

    def _prompt(self, config: EvictionConfig | None, seed: int) -> PromptState:
        if config is None and self.sample.needs_reference:
            self.sample = self.sample.with_reference(self._dense_answer())
        s = self.sample
        if config is None:
            state = prefill_sample(self.model, self.tokenizer, s.context, s.question,
                                   s.target, config=None, chunk_size=self.cfg.chunk_size,
                                   preamble=s.preamble, capture_rows=_capture_rows(self.cfg))
            self.dense_prompt = state
            return PromptState(state.session.clone(), state.split, state.ids,
                               state.last_ctx, state.q_logits)
        # A fork skips the prefill: exact with no event before the prompt's end, unless
        # an event's policy reads what is made as tokens are fed (the reconstruction
        # stand-in: the same test HeadLedger.start makes to load its scorer).
        if self.dense_prompt is not None and config.prompt_mode != "stream" \
                and config.prefill_budget is None \
                and "reconstruction" not in config.event_policies().head_needs:
            return self.dense_prompt.fork(config, seed=seed)
        return prefill_sample(self.model, self.tokenizer, s.context, s.question, s.target,
                              config=config, chunk_size=self.cfg.chunk_size,
                              preamble=s.preamble)

    def _dense_answer(self) -> str:
        """The uncompressed model's greedy answer (the reference of a ``metric "dense"``
        sample): one prefill without a reference, then greedy decoding."""
        s = self.sample
        state = prefill_sample(self.model, self.tokenizer, s.context, s.question, "",
                               config=None, chunk_size=self.cfg.chunk_size,
                               preamble=s.preamble)
        return greedy_text(state, self.tokenizer, max_new_tokens=s.max_new_tokens)

    def run(self, spec: MethodSpec, budget: float | int | None, seed: int,
            dense: SampleResult | None = None) -> tuple[SampleResult, Record]:
        knobs = self.cfg.knobs_for(spec)
        t0 = time.perf_counter()
        config = None if spec.method == "dense" else make_config(
            spec.policy_method, budget, chunk_size=self.cfg.chunk_size, seed=seed, **knobs)
        if config is not None and spec.method == ORACLE:
            s = self.sample
            split = encode_prompt(self.tokenizer, s.context, s.question, preamble=s.preamble,
                                  answer=s.target)
            config = oracle_config(config, answer_blocks(
                self.tokenizer, split.ids.tolist(), s.answers, end=split.n_context,
                block_size=config.block_size))
        res = finish_sample(self._prompt(config, seed), self.tokenizer,
                            max_new_tokens=self.sample.max_new_tokens)
        secs = time.perf_counter() - t0
        ref = dense if dense is not None else res
        kl_all, kl_ans = kl_to_dense(ref, res)
        rec = Record.build(
            self.sid, spec.label, budget, seed, score=self.sample.score(res.text),
            prediction=res.text, answers=self.sample.answers,
            answer_loglik=res.answer_loglik, dense_answer_loglik=ref.answer_loglik,
            answer_tokens=res.n_answer, kl=kl_all, kl_answer=kl_ans,
            prompt_tokens=self.sample.num_tokens, cache_tokens=res.cache_tokens,
            events=res.events, seconds=secs)
        return res, rec


@dataclass
class _DialogueJob:
    """Runs of one multi-turn stream: one record each, every turn scored."""

    cfg: RunConfig
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    sid: SampleId
    dialogue: Dialogue

    def run(self, spec: MethodSpec, budget: float | int | None, seed: int,
            dense: list[ProbeResult] | None = None) -> tuple[list[ProbeResult], Record]:
        d = self.dialogue
        config = None if spec.method == "dense" else make_config(
            spec.policy_method, budget, chunk_size=self.cfg.chunk_size, seed=seed,
            **self.cfg.knobs_for(spec))
        if config is not None and spec.method == ORACLE:
            config = oracle_config(config, answer_blocks(
                self.tokenizer, d.ids, [a for t in d.turns for a in t.answers],
                end=len(d.ids), block_size=config.block_size))
        t0 = time.perf_counter()
        res = run_probes(self.model, torch.tensor(d.ids), [t.probe for t in d.turns], config,
                         chunk_size=self.cfg.chunk_size,
                         eos_token_ids=eos_ids(self.model, self.tokenizer))
        secs = time.perf_counter() - t0
        ref = dense if dense is not None else res
        texts = [str(self.tokenizer.decode(r.ids, skip_special_tokens=True)) for r in res]
        scores = [d.score(i, text) for i, text in enumerate(texts)]
        deltas = [r.answer_loglik - q.answer_loglik for r, q in zip(res, ref)]
        # Only answers are scored here, so both KLs are over the answers' tokens.
        kl = float(torch.cat([_kl(q.logprobs, r.logprobs) for r, q in zip(res, ref)]).mean())
        rec = Record.build(
            self.sid, spec.label, budget, seed, score=sum(scores) / len(scores),
            prediction=" | ".join(texts), answers=[a for t in d.turns for a in t.answers],
            answer_loglik=sum(r.answer_loglik for r in res),
            dense_answer_loglik=sum(q.answer_loglik for q in ref),
            answer_tokens=sum(int(r.targets.numel()) for r in res),
            kl=kl, kl_answer=kl, prompt_tokens=d.num_tokens,
            cache_tokens=res[-1].cache_tokens, events=res[-1].events, seconds=secs,
            turn_scores=scores, turn_delta_loglik=deltas)
        return res, rec


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-row KL(p || q) of log-probabilities ``[P, V]``."""
    if p.shape != q.shape:
        raise ValueError(f"logprob shapes differ: {tuple(p.shape)} vs {tuple(q.shape)}")
    return (p.exp() * (p - q)).sum(-1).clamp_min(0)


def config_dict(cfg: RunConfig) -> dict[str, object]:
    """``cfg`` as plain YAML/JSON data (lists, not tuples), plus the torch version."""
    d = asdict(cfg)
    d["torch"] = str(torch.__version__)
    d["budgets"] = list(cfg.budgets)
    for k in ("tasks", "methods", "contexts", "protocols"):
        d[k] = list(d[k])
    return d
