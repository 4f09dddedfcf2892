"""``nexus-vllm server-eval``: the chat-shaped suite through a running server's
``/v1/chat/completions``, the way users send it (or, with ``--protocol question-last``,
the completion-shaped prompts through ``/v1/completions``, for base models without a chat
template).

    nexus-vllm server-eval --base-url http://127.0.0.1:8000 --budget 0.2 \\
        --tasks niah_single_prose,facts,summary,chat_multiturn \\
        --methods dense,nexus,snapkv,tova,knorm --samples 8 --data-seed 1 --out runs/server

Every sample of the ``chat`` protocol (:mod:`nexus_vllm.eval.tasks`; ``chat_multiturn`` is
one request per turn, the conversation so far as messages) is sent as chat messages,
greedy, once per method. A method travels per request in ``vllm_xargs``: ``dense`` is
``kv_eviction: none``; ``nexus:prompt_mode=stream`` adds ``kv_prompt_mode`` (any
``name:field=value`` becomes ``kv_<field>``, checked by the server: a bad one is its HTTP
400). The budget, and every knob a request cannot carry, are the server's own: start it
with the settings to evaluate; ``--budget`` only labels the records with it.

Writes into ``--out``: ``records.jsonl`` (one :class:`~nexus_vllm.eval.records.Record` per
sample and method, resumable; a server returns no teacher-forced log-probabilities, so
the likelihood fields are NaN), ``table.md`` (score per task and method, 95% intervals)
and ``config.yaml``. Compare methods pairwise with ``nexus-vllm compare
runs/server/records.jsonl --a nexus --b snapkv --metric score``. Tasks scored against
dense's answer take the server's own dense answer as the reference, so ``dense`` runs
first on every sample.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nexus_vllm.eval.budget import parse_budget

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nexus_vllm.eval.records import Record

__all__ = ["ChatRequest", "build_parser", "chat_requests", "main", "request_xargs"]

DENSE = "dense"
PROTOCOLS = ("chat", "question-last")


@dataclass(frozen=True)
class ChatRequest:
    """One request of a sample: its messages (or, completion-shaped, its prompt text)
    and how to score the answer."""

    messages: list[dict[str, str]]
    max_tokens: int
    # answer text, dense's answer to the same request -> score
    score: Callable[[str, str], float]
    prompt: str | None = None  # set: sent to /v1/completions instead of the messages


@dataclass(frozen=True)
class ChatSample:
    """A sample of the chat protocol: one request, or one per conversation turn."""

    task: str
    index: int
    requests: tuple[ChatRequest, ...]
    prompt_tokens: int
    answers: tuple[str, ...]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nexus-vllm server-eval",
                                description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None,
                   help="checkpoint the server serves, for the tokenizer (default: the "
                        "embedded model)")
    p.add_argument("--tasks", default="niah_single_prose,niah_multikey,facts,summary",
                   help="comma list of chat-protocol tasks (and chat_multiturn)")
    p.add_argument("--methods", default="dense,nexus,snapkv,tova,knorm",
                   help="comma list: dense, a served method, or method:field=value,... "
                        "(per-request fields; separate specs with ';' when fields are used)")
    p.add_argument("--budget", required=True,
                   help="the server's budget (--kv-keep-ratio or --kv-budget), recorded with "
                        "each record")
    p.add_argument("--protocol", choices=PROTOCOLS, default="chat",
                   help="chat (messages to /v1/chat/completions) or question-last (the "
                        "prompt text to /v1/completions: base models)")
    p.add_argument("--context", type=int, default=2048, help="target prompt tokens")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--data-seed", type=int, default=1,
                   help="which sample set (0: tuning, 1: report)")
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--no-progress", action="store_true")
    return p


def request_xargs(spec: str) -> tuple[str, dict[str, object]]:
    """``(label, vllm_xargs)`` of a method spec: ``dense`` -> ``kv_eviction: none``;
    ``nexus:prompt_mode=end`` -> ``{"kv_eviction": "nexus", "kv_prompt_mode": "end"}``."""
    from nexus_vllm.eval.runner import parse_method

    parsed = parse_method(spec)
    if parsed.method == DENSE:
        if parsed.knobs:
            raise ValueError(f"dense takes no per-request fields: {spec!r}")
        return DENSE, {"kv_eviction": "none"}
    xargs: dict[str, object] = {"kv_eviction": parsed.method}
    for field, value in parsed.knobs.items():
        xargs[field if field.startswith("kv_") else f"kv_{field}"] = value
    return parsed.label, xargs


def chat_requests(task: str, *, index: int, seed: int, context: int,
                  tokenizer: PreTrainedTokenizerBase, protocol: str = "chat") -> ChatSample:
    """The request(s) of sample ``index`` of ``task``: chat-shaped, or one completion
    prompt (``protocol`` ``question-last``)."""
    from nexus_vllm.eval.dialogues import DIALOGUE_TASKS, dialogue_protocol, make_dialogue
    from nexus_vllm.eval.tasks import make_sample

    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if task in DIALOGUE_TASKS:
        if protocol != "chat":
            raise ValueError(f"task {task!r} is a dialogue; server-eval sends it as chat "
                             "(--protocol chat)")
        if dialogue_protocol(task) != "chat":
            raise ValueError(f"task {task!r} is completion-shaped; the chat variant of "
                             f"multiturn is chat_multiturn")
        d = make_dialogue(task, seed=seed, index=index, target_tokens=context,
                          tokenizer=tokenizer)
        reqs = tuple(ChatRequest(list(t.messages), t.probe.max_new_tokens,
                                 _answer_score(d.score, i)) for i, t in enumerate(d.turns))
        return ChatSample(task, index, reqs, d.num_tokens,
                          tuple(a for t in d.turns for a in t.answers))
    sample = make_sample(task, seed=seed, index=index, target_tokens=context,
                         tokenizer=tokenizer, protocol=protocol)

    def score(text: str, dense_text: str) -> float:
        s = sample.with_reference(dense_text) if sample.needs_reference else sample
        return s.score(text)

    if protocol == "chat":
        req = ChatRequest(sample.meta["messages"], sample.max_new_tokens, score)
    else:
        req = ChatRequest([], sample.max_new_tokens, score,
                          prompt=sample.preamble + sample.context + sample.question)
    return ChatSample(task, index, (req,), sample.num_tokens, sample.answers)


def _answer_score(score: Callable[[int, str], float], turn: int) -> Callable[[str, str], float]:
    return lambda text, _dense: score(turn, text)


def _chat(base: str, model: str, req: ChatRequest, xargs: dict[str, object],
          timeout: float) -> str:
    import requests

    body = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0,
            "vllm_xargs": xargs}
    if req.prompt is None:
        r = requests.post(base + "/v1/chat/completions", timeout=timeout,
                          json={**body, "messages": req.messages})
    else:
        r = requests.post(base + "/v1/completions", timeout=timeout,
                          json={**body, "prompt": req.prompt})
    if r.status_code != 200:
        raise RuntimeError(f"the server answered {r.status_code}: {r.text[:500]}")
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if req.prompt is None else choice["text"]
    return str(text or "")


def _samples(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> Iterator[ChatSample]:
    for task in _tasks(args):
        for index in range(args.samples):
            yield chat_requests(task, index=index, seed=args.data_seed, context=args.context,
                                tokenizer=tokenizer, protocol=args.protocol)


def _tasks(args: argparse.Namespace) -> list[str]:
    return [t.strip() for t in args.tasks.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error(f"--samples must be >= 1, got {args.samples}")
    try:
        budget = parse_budget(args.budget)
        text = args.methods
        specs = [request_xargs(s) for s in text.split(";" if ";" in text else ",")
                 if s.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    # Dense first: the dense-referenced tasks score against its answer.
    specs.sort(key=lambda s: s[0] != DENSE)
    if specs[0][0] != DENSE:
        specs.insert(0, (DENSE, {"kv_eviction": "none"}))
    run(args, budget, specs)
    return 0


def run(args: argparse.Namespace, budget: float | int,
        specs: list[tuple[str, dict[str, object]]]) -> list[Record]:
    """Send every (sample, method) request, append records, write the table."""
    import requests
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from nexus_vllm.eval.records import (
        Record,
        SampleId,
        read_records,
        record_key,
        record_writer,
    )
    from nexus_vllm.eval.report import markdown_table
    from nexus_vllm.eval.stats import aggregate
    from nexus_vllm.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    base = args.base_url.rstrip("/")
    served = requests.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    args.out.mkdir(parents=True, exist_ok=True)
    _write_config(args, budget, specs)
    path = args.out / "records.jsonl"
    records = read_records(path)
    done = {r.key: r for r in records}
    bar = tqdm(total=len(_tasks(args)) * args.samples * len(specs),
               disable=args.no_progress, desc="server-eval", dynamic_ncols=True)
    nan = math.nan
    with record_writer(path) as write:
        for sample in _samples(args, tokenizer):
            sid = SampleId(sample.task, args.context, args.protocol, sample.index)
            dense_texts: list[str] | None = None
            for label, xargs in specs:
                rec_budget = None if label == DENSE else budget
                key = record_key(sid, label, rec_budget, 0)
                if key in done:
                    prev = done[key]
                    texts = prev.prediction.split(" | ") if len(sample.requests) > 1 \
                        else [prev.prediction]
                else:
                    t0 = time.perf_counter()
                    texts = [_chat(base, served, req, xargs, args.timeout)
                             for req in sample.requests]
                    scores = [req.score(text, dense)
                              for req, text, dense in zip(sample.requests, texts,
                                                          dense_texts or texts)]
                    rec = Record.build(
                        sid, label, rec_budget, 0, score=sum(scores) / len(scores),
                        prediction=" | ".join(texts), answers=sample.answers,
                        answer_loglik=nan, dense_answer_loglik=nan, answer_tokens=0,
                        kl=nan, kl_answer=nan, prompt_tokens=sample.prompt_tokens,
                        cache_tokens=0, events=0, seconds=time.perf_counter() - t0,
                        turn_scores=scores if len(scores) > 1 else ())
                    write(rec)
                    records.append(rec)
                    done[key] = rec
                if label == DENSE:
                    dense_texts = texts
                bar.update(1)
    bar.close()
    table = markdown_table(aggregate(records), metric="score")
    endpoint = "chat/completions" if args.protocol == "chat" else "completions"
    (args.out / "table.md").write_text(
        f"# {args.protocol} suite through {base}/v1/{endpoint} (budget {budget})\n\n"
        f"{table}\n")
    print(table)
    return records


def _write_config(args: argparse.Namespace, budget: float | int,
                  specs: list[tuple[str, dict[str, object]]]) -> None:
    import yaml

    config = {"base_url": args.base_url, "model": args.model or "default",
              "protocol": args.protocol, "tasks": args.tasks,
              "methods": {label: xargs for label, xargs in specs}, "budget": budget,
              "context": args.context, "samples": args.samples, "data_seed": args.data_seed}
    (args.out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
