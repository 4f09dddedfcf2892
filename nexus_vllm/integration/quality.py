"""Quality check: a sample of the offline suite through a running server vs. the HF path.

    python -m nexus_vllm.integration.quality --base-url http://127.0.0.1:8000 \
        --task niah_single_noise --context 1024 --samples 4 --method nexus --budget 0.2 --hf

The server must run with the same budget form: for a fraction, start it with
``--kv-keep-ratio 0.2``; for a token budget (an int) the budget travels per request in
``vllm_xargs.kv_budget``. Prompts are sent as token ids from the suite's own tokenization
(``nexus_vllm.hf.encode_prompt``), so both paths see the same tokens; greedy decoding.
Prints one JSON line per sample and a summary line (mean scores, and their difference when
``--hf`` also runs the transformers path at the same method, budget and seed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

__all__ = ["main"]


def _score(sample: Any, text: str) -> float:
    from nexus_vllm.eval.tasks import string_match_all, string_match_part

    fn = string_match_all if sample.metric == "all" else string_match_part
    return float(fn(text, sample.answers))


def _server_text(client: Any, model: str, ids: list[int], sample: Any, method: str,
                 budget: float | int) -> str:
    xargs: dict[str, Any] = {"kv_eviction": method}
    if isinstance(budget, int):
        xargs["kv_budget"] = budget
    r = client.completions.create(model=model, prompt=ids, max_tokens=sample.max_new_tokens,
                                  temperature=0.0, extra_body={"vllm_xargs": xargs})
    return str(r.choices[0].text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nexus_vllm.integration.quality",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None,
                   help="checkpoint path for the tokenizer/HF path (default: embedded model)")
    p.add_argument("--task", default="niah_single_noise")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--method", default="nexus")
    p.add_argument("--budget", default="0.2",
                   help="fraction (server started with --kv-keep-ratio) or tokens (int)")
    p.add_argument("--hf", action="store_true", help="also run the transformers path")
    args = p.parse_args(argv)
    budget: float | int = float(args.budget) if "." in args.budget else int(args.budget)

    import openai
    from transformers import AutoTokenizer

    from nexus_vllm.eval.tasks import make_sample
    from nexus_vllm.hf import encode_prompt
    from nexus_vllm.models import resolve_model_path

    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    client = openai.OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key="unused",
                           max_retries=0, timeout=600)
    served = client.models.list().data[0].id
    hf_model = None
    if args.hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    server_scores: list[float] = []
    hf_scores: list[float] = []
    for index in range(args.samples):
        sample = make_sample(args.task, seed=args.seed, index=index,
                             target_tokens=args.context, tokenizer=tok)
        split = encode_prompt(tok, sample.context, sample.question, preamble=sample.preamble)
        text = _server_text(client, served, split.ids.tolist(), sample, args.method, budget)
        row: dict[str, Any] = {"index": index, "tokens": int(split.n_prompt),
                               "server": _score(sample, text), "server_text": text[:80]}
        server_scores.append(row["server"])
        if hf_model is not None:
            from nexus_vllm.hf import run_sample

            res = run_sample(hf_model, tok, sample.context, sample.question, sample.target,
                             method=args.method, budget=budget,
                             max_new_tokens=sample.max_new_tokens, seed=args.seed,
                             preamble=sample.preamble)
            row["hf"] = _score(sample, res.text)
            row["hf_text"] = res.text[:80]
            hf_scores.append(row["hf"])
        print(json.dumps(row), flush=True)
    summary: dict[str, Any] = {"task": args.task, "method": args.method, "budget": budget,
                               "samples": args.samples,
                               "server_mean": statistics.fmean(server_scores)}
    if hf_scores:
        summary["hf_mean"] = statistics.fmean(hf_scores)
        summary["diff"] = summary["server_mean"] - summary["hf_mean"]
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
