"""``nexus-vllm parity``: the suite's prompts through a running server and through the
transformers path, token for token.

    nexus-vllm parity --base-url http://127.0.0.1:8000 --task niah_single_noise \\
        --context 1024 --samples 4 --method nexus --budget 256 --chunk-size 128

Each sample's prompt (the suite's own tokenization, ``nexus_vllm.hf.encode_prompt``) is
sent to the server as token ids, greedy, and streamed through the transformers model by
:func:`nexus_vllm.hf.generate_ids`, which chunks the prompt and fires events exactly as
the vLLM plugin does and seeds the sampler like a request without a seed. With the same
weights, dtype and eviction config the two paths evict the same blocks and produce the
same token ids; this command shows per sample whether they do. With ``--task multiturn``
every turn of each conversation is a request (the conversation so far, as the evaluation
streams it: :mod:`nexus_vllm.eval.dialogues`). ``--protocol chat`` sends the chat shape
through ``/v1/chat/completions`` as messages (``chat_multiturn``: each turn's conversation
so far), as a user's client does: the server renders the chat template and tokenizes, and
the prompt ids it reports must be the suite's own (``prompt_match``).

The HF side must be told the server's eviction config. Per request the server gets the
method (``vllm_xargs.kv_eviction``) and, for a token budget (an int), the budget
(``vllm_xargs.kv_budget``). A keep ratio (a float) cannot be sent per request: start the
server with ``--kv-keep-ratio`` of the same value. Server-wide settings are passed here
with the server's values: ``--block-size`` (vLLM's), ``--chunk-size``
(``--kv-chunk-size``), ``--eviction-seed`` (``--kv-eviction-seed``) and ``--knobs`` for
anything from ``--kv-eviction-config``; left out, each is ``EvictionConfig``'s default,
which is also the server's.

Prints one JSON line per sample (texts, scores, whether the token ids match, and the
evicted-block counts: the server's ``vllm:nexus_evicted_blocks_total`` delta around the
request, which assumes no other traffic, and the transformers session's events), then a
summary line. Exits 1 when any sample's token ids differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nexus_vllm.eval.budget import parse_budget

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nexus_vllm.core import EvictionConfig

__all__ = ["SampleParity", "build_parser", "compare", "main", "summarize"]

_EVICTED = "vllm:nexus_evicted_blocks_total"
# Methods that evict nothing: the request opts out, the HF side runs dense.
_NO_EVICTION = ("none", "dense")


@dataclass(frozen=True)
class SampleParity:
    """One sample through both paths.

    ``ids_match`` is None when the server did not return token ids;
    ``first_difference`` is the index of the first differing generated token (None when
    they match); an evicted-block count is None when it cannot be read.
    """

    index: int
    turn: int | None  # the conversation turn (multi-turn tasks), else None
    prompt_tokens: int
    # chat requests: whether the server's rendering of the messages is the suite's prompt
    prompt_match: bool | None
    server_text: str
    hf_text: str
    server_score: float
    hf_score: float
    ids_match: bool | None
    first_difference: int | None
    server_evicted_blocks: int | None
    hf_evicted_blocks: int | None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nexus-vllm parity",
                                description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None,
                   help="checkpoint the server serves, for the tokenizer and the HF path "
                        "(default: the embedded model)")
    p.add_argument("--task", default="niah_single_noise",
                   help="a task of the suite, or multiturn (a request per turn)")
    p.add_argument("--context", type=int, default=1024, help="target prompt tokens")
    p.add_argument("--protocol", default="question-last",
                   help="question-last or question-first (token ids to /v1/completions), "
                        "or chat (messages to /v1/chat/completions)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--data-seed", type=int, default=1, help="which set of generated samples")
    p.add_argument("--method", default="nexus", help="eviction method, or none")
    p.add_argument("--budget", default="0.2",
                   help="int = tokens (sent per request); float = keep ratio (start the "
                        "server with --kv-keep-ratio of the same value)")
    p.add_argument("--block-size", type=int, default=None, help="the server's --block-size")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="the server's prefill chunk: --kv-chunk-size where its mode evicts "
                        "during the prompt (stream), else vLLM's --max-num-batched-tokens")
    p.add_argument("--eviction-seed", type=int, default=None,
                   help="the server's --kv-eviction-seed")
    p.add_argument("--knobs", default=None,
                   help="JSON dict of other EvictionConfig knobs the server runs with")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    return p


def _hf_config(args: argparse.Namespace) -> EvictionConfig | None:
    """The ``EvictionConfig`` the server runs each request with (None: no eviction)."""
    from nexus_vllm.core import EvictionConfig

    if args.method in _NO_EVICTION:
        return None
    knobs = json.loads(args.knobs) if args.knobs else {}
    if not isinstance(knobs, dict):
        raise ValueError(f"--knobs must be a JSON object of EvictionConfig knobs, got "
                         f"{args.knobs!r}")
    for name, value in (("block_size", args.block_size), ("chunk_size", args.chunk_size),
                        ("seed", args.eviction_seed)):
        if value is not None:
            knobs[name] = value
    return EvictionConfig.from_budget(args.method, parse_budget(args.budget), **knobs)


def _xargs(method: str, budget: float | int) -> dict[str, object]:
    if method in _NO_EVICTION:
        return {"kv_eviction": "none"}
    xargs: dict[str, object] = {"kv_eviction": method}
    if isinstance(budget, int):
        xargs["kv_budget"] = budget
    return xargs


def _evicted(base_url: str) -> float | None:
    """The server's evicted-block counter; 0 before its first eviction (the exporter
    shows a labelled counter only once incremented); None without the plugin's metrics."""
    from nexus_vllm.eval.server import read_metrics

    metrics = read_metrics(base_url)
    if _EVICTED in metrics:
        return metrics[_EVICTED]
    return 0.0 if any(k.startswith("vllm:nexus_") for k in metrics) else None


@dataclass(frozen=True)
class _Request:
    index: int
    turn: int | None
    ids: list[int]
    max_new_tokens: int
    score: Callable[[str], float]
    messages: list[dict[str, str]] | None = None  # sent as a chat when given


def _requests(args: argparse.Namespace, tok: PreTrainedTokenizerBase) -> Iterator[_Request]:
    """The requests of ``--task``: one per sample, or one per turn of a conversation."""
    from nexus_vllm.eval.dialogues import DIALOGUE_TASKS, make_dialogue
    from nexus_vllm.eval.tasks import make_sample
    from nexus_vllm.hf import encode_prompt

    chat = args.protocol == "chat"
    for index in range(args.samples):
        if args.task in DIALOGUE_TASKS:
            d = make_dialogue(args.task, seed=args.data_seed, index=index,
                              target_tokens=args.context, tokenizer=tok)
            for t, turn in enumerate(d.turns):
                yield _Request(index, t, list(d.ids[:turn.probe.prompt_end]),
                               turn.probe.max_new_tokens, functools.partial(d.score, t),
                               list(turn.messages) if chat else None)
            continue
        sample = make_sample(args.task, seed=args.data_seed, index=index,
                             target_tokens=args.context, tokenizer=tok,
                             protocol=args.protocol)
        ids = encode_prompt(tok, sample.context, sample.question,
                            preamble=sample.preamble).ids.tolist()
        yield _Request(index, None, ids, sample.max_new_tokens, sample.score,
                       sample.meta.get("messages") if chat else None)


def _send(base: str, model: str, req: _Request, xargs: dict[str, object],
          timeout: float) -> tuple[str, list[int] | None, list[int] | None]:
    """``(text, generated ids, prompt ids)`` of one request: token ids to
    ``/v1/completions``, or messages to ``/v1/chat/completions`` (the prompt ids are then
    the server's rendering of them)."""
    import requests

    body: dict[str, object] = {"model": model, "max_tokens": req.max_new_tokens,
                            "temperature": 0.0, "return_token_ids": True,
                            "vllm_xargs": xargs}
    if req.messages is not None:
        r = requests.post(base + "/v1/chat/completions", timeout=timeout,
                          json={**body, "messages": req.messages})
        r.raise_for_status()
        out = r.json()
        choice = out["choices"][0]
        return (str(choice["message"]["content"] or ""), choice.get("token_ids"),
                out.get("prompt_token_ids"))
    r = requests.post(base + "/v1/completions", timeout=timeout,
                      json={**body, "prompt": req.ids})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return str(choice["text"]), choice.get("token_ids"), None


def compare(args: argparse.Namespace) -> list[SampleParity]:
    """Run every sample of ``args`` (from :func:`build_parser`) through both paths."""
    import requests
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nexus_vllm.hf import generate_ids
    from nexus_vllm.hf.generate import eos_ids
    from nexus_vllm.models import resolve_model_path

    config = _hf_config(args)
    xargs = _xargs(args.method, parse_budget(args.budget))
    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    # float32: what the server runs on a CPU (eval.server.CPU_FLAGS); greedy ids are only
    # comparable in the same dtype.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stop = eos_ids(model, tok)  # vLLM stops at the tokenizer's and the config's eos
    base = args.base_url.rstrip("/")
    served = requests.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    rows: list[SampleParity] = []
    for req in _requests(args, tok):
        before = _evicted(base)
        server_text, server_ids, prompt_ids = _send(base, served, req, xargs, args.timeout)
        after = _evicted(base)
        hf_ids, session = generate_ids(model, req.ids, config,
                                       max_new_tokens=req.max_new_tokens, eos_token_ids=stop)
        hf_text = str(tok.decode(hf_ids, skip_special_tokens=True))
        first = None
        if server_ids is not None and server_ids != hf_ids:
            first = next((i for i, (a, b) in enumerate(zip(server_ids, hf_ids)) if a != b),
                         min(len(server_ids), len(hf_ids)))
        rows.append(SampleParity(
            index=req.index, turn=req.turn, prompt_tokens=len(req.ids),
            prompt_match=None if req.messages is None else prompt_ids == req.ids,
            server_text=server_text, hf_text=hf_text,
            server_score=req.score(server_text), hf_score=req.score(hf_text),
            ids_match=None if server_ids is None else server_ids == hf_ids,
            first_difference=first,
            # No nexus series before the first request a fresh server runs: 0 so far.
            server_evicted_blocks=(None if after is None
                                   else int(after - (before or 0.0))),
            hf_evicted_blocks=sum(e.blocks_before - e.blocks_after for e in session.events),
        ))
    return rows


def summarize(args: argparse.Namespace, rows: list[SampleParity]) -> dict[str, object]:
    """One run's summary: mean scores on both paths and how many requests matched."""
    server_mean = statistics.fmean(r.server_score for r in rows)
    hf_mean = statistics.fmean(r.hf_score for r in rows)
    return {
        "task": args.task, "method": args.method, "budget": parse_budget(args.budget),
        "samples": len(rows), "server_mean": server_mean, "hf_mean": hf_mean,
        "diff": server_mean - hf_mean,
        "ids_match": sum(r.ids_match is True for r in rows),
        "evicted_match": sum(r.server_evicted_blocks == r.hf_evicted_blocks for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error(f"--samples must be >= 1, got {args.samples}")
    from nexus_vllm.eval.tasks import PROTOCOLS

    if args.protocol not in PROTOCOLS:
        parser.error(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {args.protocol!r}")
    from nexus_vllm.eval.dialogues import DIALOGUE_TASKS, dialogue_protocol

    if args.task in DIALOGUE_TASKS and dialogue_protocol(args.task) == "chat" \
            and args.protocol != "chat":
        parser.error(f"--task {args.task} is chat-shaped: give --protocol chat")
    if args.task == "longgen":
        parser.error("--task longgen cannot be sent to a server: its long answer is the "
                     "model's own output, teacher-forced, which a completion request cannot "
                     "force; use --task multiturn")
    try:
        parse_budget(args.budget)
        _hf_config(args)  # refuse a bad method, budget or knob before loading anything
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    rows = compare(args)
    for row in rows:
        print(json.dumps(dataclasses.asdict(row)), flush=True)
    print(json.dumps({"summary": summarize(args, rows)}), flush=True)
    return 0 if all(r.ids_match and r.prompt_match is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
