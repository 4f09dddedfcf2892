"""Runs kvpress presses on prepared samples; executed inside the kvpress virtualenv.

kvpress 0.5.5 needs transformers < 5.3 while vLLM 0.32 needs transformers >= 5.16, so
this file runs as a script under ``.venv-kvpress/bin/python`` and imports only torch,
transformers and kvpress (never ``nexus_vllm``). It reads the exact token ids our own
harness uses, so the only difference between the two sides is the eviction method.

Protocol (kvpress's own): the whole context is prefilled at once and compressed by the
press when the prefill ends; the question and the answer are then fed uncompressed.
Input: a JSON file ``{"model": path, "presses": [...], "budgets": [...], "samples": [...]}``
with ``samples[i] = {"key", "ids", "n_context", "n_prompt", "max_new_tokens"}``.
Output: one JSON line per (sample, press, budget), plus one per sample for dense.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from typing import Any

import torch

# Our press name -> kvpress class; the keys are peers.PEER_PRESSES (a test checks).
PRESS_CLASSES = {
    "snapkv": "SnapKVPress",
    "streaming": "StreamingLLMPress",
    "tova": "TOVAPress",
    "knorm": "KnormPress",
    "expected_attention": "ExpectedAttentionPress",
}


def _make_press(name: str, budget: float) -> Any:
    import kvpress

    cls = getattr(kvpress, PRESS_CLASSES[name])
    return cls(compression_ratio=round(1.0 - budget, 6))


@torch.no_grad()
def _run(model: Any, sample: dict[str, Any], press: Any, eos: set[int]) -> dict[str, Any]:
    from transformers import DynamicCache

    ids = torch.tensor(sample["ids"], dtype=torch.long)[None]
    n_ctx, n_prompt = sample["n_context"], sample["n_prompt"]
    cache = DynamicCache()
    t0 = time.perf_counter()
    with press(model) if press is not None else _null():
        hidden = model.model(input_ids=ids[:, :n_ctx], past_key_values=cache).last_hidden_state
    last_ctx_logits = model.lm_head(hidden[:, -1:])[0]
    cache_tokens = cache.get_seq_length()
    positions = torch.arange(n_ctx, ids.shape[1])[None]
    forced_cache = copy.deepcopy(cache)
    # Greedy answer from the question.
    out = model(input_ids=ids[:, n_ctx:n_prompt], past_key_values=cache,
                position_ids=positions[:, : n_prompt - n_ctx])
    q_logits = out.logits[0]
    logits, pos, generated = q_logits[-1], n_prompt, []
    for step in range(sample["max_new_tokens"]):
        tok = int(torch.argmax(logits))
        generated.append(tok)
        if tok in eos or step == sample["max_new_tokens"] - 1:
            break
        logits = model(input_ids=torch.tensor([[tok]]), past_key_values=cache,
                       position_ids=torch.tensor([[pos]])).logits[0, -1]
        pos += 1
    # Teacher forcing of question + answer (the last token predicts nothing scored).
    tf = model(input_ids=ids[:, n_ctx:-1], past_key_values=forced_cache,
               position_ids=positions[:, :-1]).logits[0]
    all_logits = torch.cat([last_ctx_logits, tf]).float()
    return {
        "generated": generated,
        "logprobs": torch.log_softmax(all_logits, dim=-1),
        "cache_tokens": cache_tokens,
        "seconds": time.perf_counter() - t0,
    }


def _answer_loglik(logprobs: torch.Tensor, targets: torch.Tensor, n_answer: int) -> float:
    """Sum of the reference answer tokens' log-probabilities (the last ``n_answer``)."""
    return float(logprobs[-n_answer:].gather(1, targets[-n_answer:, None]).sum())


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def main(path: str) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with open(path) as fh:
        job = json.load(fh)
    torch.set_num_threads(int(job.get("threads", 1)))
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    eos = {tokenizer.eos_token_id}
    gen_eos = model.generation_config.eos_token_id
    eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    eos.discard(None)
    for sample in job["samples"]:
        targets = torch.tensor(sample["ids"][sample["n_context"]:])
        n_answer = len(sample["ids"]) - sample["n_prompt"]
        dense = _run(model, sample, None, eos)
        dense_ll = _answer_loglik(dense["logprobs"], targets, n_answer)
        for name in job["presses"]:
            for budget in job["budgets"]:
                res = _run(model, sample, _make_press(name, budget), eos)
                p, q = dense["logprobs"], res["logprobs"]
                kl = (p.exp() * (p - q)).sum(-1).clamp_min(0)
                ll = _answer_loglik(q, targets, n_answer)
                print(json.dumps({
                    "key": sample["key"], "press": name, "budget": budget,
                    "prediction": tokenizer.decode(res["generated"], skip_special_tokens=True),
                    "answer_loglik": ll, "dense_answer_loglik": dense_ll,
                    "delta_loglik": ll - dense_ll, "answer_tokens": n_answer,
                    "kl": float(kl.mean()), "kl_answer": float(kl[-n_answer:].mean()),
                    "cache_tokens": res["cache_tokens"], "seconds": res["seconds"],
                }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
