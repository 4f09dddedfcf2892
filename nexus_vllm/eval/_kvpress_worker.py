"""Runs kvpress presses on prepared samples; executed inside the kvpress virtualenv.

kvpress 0.5.5 needs transformers < 5.3 while vLLM 0.32 needs transformers >= 5.16, so
this file runs as a script under ``.venv-kvpress/bin/python`` and imports only torch,
transformers and kvpress (never ``nexus_vllm``). It reads the exact token ids our own
harness uses, so the only difference between the two sides is the eviction method.

Protocols (kvpress's own, as its pipeline runs them):

* ``feed: "chunk"`` (one prompt; the prompt presses): the whole context is prefilled at
  once and compressed by the press when the prefill ends, before the question is seen;
  the question and the answer are then fed uncompressed.
* ``feed: "decode"`` (long generation; the ``decoding_*`` presses): the prompt is
  prefilled whole and kept, then the model's own output (the tokens up to ``n_prompt``)
  is fed one token at a time under kvpress's ``DecodingPress``, which compresses the
  cache to ``target_size`` tokens every ``compression_interval`` steps; the answer is
  decoded and teacher-forced with the press still on.

Input: a JSON file ``{"model": path, "presses": [...], "budgets": [...], "samples": [...]}``
with ``samples[i] = {"key", "ids", "n_context", "n_prompt", "max_new_tokens"}`` and
optionally ``"feed"`` (``"chunk"`` by default) and its own ``"presses"``/``"budgets"``.
Output: one JSON line per (sample, press, budget); dense is run once per sample (the
reference of ``kl`` and ``dense_answer_loglik``), not printed.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import sys
import time
from typing import Any

import torch

# Our press name -> kvpress class, for the presses that compress the context once, when
# its prefill ends (``compression_ratio`` from the budget, :func:`compression_ratio`;
# every other knob at kvpress's default). The keys plus ``DECODING_PRESSES`` are
# peers.PEER_PRESSES (a test checks).
PRESS_CLASSES = {
    "snapkv": "SnapKVPress",
    "streaming": "StreamingLLMPress",
    "tova": "TOVAPress",
    "knorm": "KnormPress",
    "expected_attention": "ExpectedAttentionPress",
    "kvzip": "KVzipPress",
}
# ``decoding_<name>``: ``DecodingPress(base_press=<name>'s class())`` for long generation;
# kvpress's DecodingPress takes scorer presses only (KVzip is not one).
DECODING_PREFIX = "decoding_"
DECODING_PRESSES = {f"{DECODING_PREFIX}{name}": PRESS_CLASSES[name]
                    for name in ("snapkv", "streaming", "tova", "knorm", "expected_attention")}


def press_spec(name: str) -> tuple[str, str | None]:
    """``(kvpress class, base press class or None)`` of our press ``name``."""
    if name in PRESS_CLASSES:
        return PRESS_CLASSES[name], None
    if name in DECODING_PRESSES:
        return "DecodingPress", DECODING_PRESSES[name]
    raise ValueError(f"unknown press {name!r}; choose from "
                     f"{[*PRESS_CLASSES, *DECODING_PRESSES]}")


def target_size(budget: float | int, n_tokens: int) -> int:
    """A decoding press's ``target_size``: a token budget as it is, a keep ratio of the
    ``n_tokens`` seen before the answer (the cache our side holds there) rounded up."""
    if isinstance(budget, int):
        return budget
    return max(1, math.ceil(budget * n_tokens - 1e-9))


def compression_ratio(budget: float | int, n_context: int) -> float:
    """A prompt press's ``compression_ratio``: ``1 - budget`` for a keep ratio; for a token
    budget, the share of the ``n_context`` tokens it compresses that the budget does not
    keep (0 when the context fits)."""
    keep = budget if isinstance(budget, float) else min(1.0, budget / max(1, n_context))
    return round(1.0 - keep, 6)


def _make_press(name: str, budget: float | int, n_tokens: int, n_context: int) -> Any:
    import kvpress

    cls_name, base_name = press_spec(name)
    cls = getattr(kvpress, cls_name)
    if base_name is None:
        return cls(compression_ratio=compression_ratio(budget, n_context))
    # compression_interval, hidden_states_buffer_size and the base press's knobs at
    # kvpress's defaults; the base press's compression_ratio is set by DecodingPress.
    return cls(base_press=getattr(kvpress, base_name)(),
               target_size=target_size(budget, n_tokens))


def _cache_tokens(model: Any, cache: Any) -> int:
    """Tokens the cache holds per layer and KV head. Presses that evict per head without
    shrinking the cache (KVzip, AdaKV) mask keys through ``masked_key_indices``: those
    count as evicted."""
    n = int(cache.get_seq_length())
    masks = [getattr(layer.self_attn, "masked_key_indices", None)
             for layer in model.model.layers]
    if any(m is not None for m in masks):
        heads = model.config.num_key_value_heads
        masked = sum(int(m[0].numel()) for m in masks if m is not None)
        n = round(n - masked / (heads * len(masks)))
    return n


def _decoding_state(press: Any) -> Any:
    # A DecodingPress counts steps and buffers hidden states per layer: the greedy answer
    # and the teacher-forced one each start from the state after the forced tokens.
    return copy.deepcopy({k: v for k, v in vars(press).items() if k != "base_press"})


@torch.no_grad()
def _run(model: Any, sample: dict[str, Any], press: Any, eos: set[int]) -> dict[str, Any]:
    if sample.get("feed", "chunk") == "decode":
        return _run_decode(model, sample, press, eos)
    from transformers import DynamicCache

    ids = torch.tensor(sample["ids"], dtype=torch.long)[None]
    n_ctx, n_prompt = sample["n_context"], sample["n_prompt"]
    cache = DynamicCache()
    t0 = time.perf_counter()
    with press(model) if press is not None else _null():
        hidden = model.model(input_ids=ids[:, :n_ctx], past_key_values=cache).last_hidden_state
    last_ctx_logits = model.lm_head(hidden[:, -1:])[0]
    cache_tokens = _cache_tokens(model, cache)
    positions = torch.arange(n_ctx, ids.shape[1])[None]
    forced_cache = copy.deepcopy(cache)
    # Greedy answer from the question.
    out = model(input_ids=ids[:, n_ctx:n_prompt], past_key_values=cache,
                position_ids=positions[:, : n_prompt - n_ctx])
    q_logits = out.logits[0]
    generated = _greedy(model, cache, q_logits[-1], n_prompt, sample["max_new_tokens"], eos)
    # Teacher forcing of question + answer (the last token predicts nothing scored).
    tf = model(input_ids=ids[:, n_ctx:-1], past_key_values=forced_cache,
               position_ids=positions[:, :-1]).logits[0]
    all_logits = torch.cat([last_ctx_logits, tf]).float()
    return {
        "generated": generated,
        "logprobs": torch.log_softmax(all_logits, dim=-1),
        "cache_tokens": cache_tokens,
        "events": 1,
        "seconds": time.perf_counter() - t0,
    }


def _greedy(model: Any, cache: Any, logits: torch.Tensor, pos: int, max_new_tokens: int,
            eos: set[int]) -> list[int]:
    generated: list[int] = []
    for step in range(max_new_tokens):
        tok = int(torch.argmax(logits))
        generated.append(tok)
        if tok in eos or step == max_new_tokens - 1:
            break
        logits = model(input_ids=torch.tensor([[tok]]), past_key_values=cache,
                       position_ids=torch.tensor([[pos]])).logits[0, -1]
        pos += 1
    return generated


def _run_decode(model: Any, sample: dict[str, Any], press: Any, eos: set[int]
                ) -> dict[str, Any]:
    """Long generation: the prompt prefilled whole, the model's own output fed as decode
    steps under the (decoding) press, then the answer; only the answer is scored."""
    from transformers import DynamicCache

    ids = torch.tensor(sample["ids"], dtype=torch.long)[None]
    n_ctx, n_forced = sample["n_context"], sample["n_prompt"]
    cache = DynamicCache()
    t0 = time.perf_counter()
    logits = model(input_ids=ids[:, :n_ctx], past_key_values=cache,
                   logits_to_keep=1).logits[0, -1]
    events = 0
    with press(model) if press is not None else _null():
        for pos in range(n_ctx, n_forced):
            before = cache.get_seq_length()
            logits = model(input_ids=ids[:, pos:pos + 1], past_key_values=cache,
                           position_ids=torch.tensor([[pos]])).logits[0, -1]
            events += int(cache.get_seq_length() <= before)  # a compression happened
        cache_tokens = _cache_tokens(model, cache)
        forced_cache = copy.deepcopy(cache)
        state = _decoding_state(press) if press is not None else None
        generated = _greedy(model, cache, logits, n_forced, sample["max_new_tokens"], eos)
        if press is not None:
            vars(press).update(state)
        positions = torch.arange(n_forced, ids.shape[1] - 1)[None]
        tf = model(input_ids=ids[:, n_forced:-1], past_key_values=forced_cache,
                   position_ids=positions).logits[0]
    all_logits = torch.cat([logits[None], tf]).float()
    return {
        "generated": generated,
        "logprobs": torch.log_softmax(all_logits, dim=-1),
        "cache_tokens": cache_tokens,
        "events": events,
        "seconds": time.perf_counter() - t0,
    }


def _answer_loglik(logprobs: torch.Tensor, targets: torch.Tensor, n_answer: int) -> float:
    """Sum of the reference answer tokens' log-probabilities (the last ``n_answer``)."""
    return float(logprobs[-n_answer:].gather(1, targets[-n_answer:, None]).sum())


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main(path: str) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # KVzipPress warns of its reconstruction cost each time one is made (per sample and
    # budget); the cost is in the records' seconds.
    logging.getLogger("kvpress.presses.kvzip_press").setLevel(logging.ERROR)
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
        decode = sample.get("feed", "chunk") == "decode"
        # What is scored: question + answer (one prompt), the answer (long generation).
        first = sample["n_prompt"] if decode else sample["n_context"]
        targets = torch.tensor(sample["ids"][first:])
        n_answer = len(sample["ids"]) - sample["n_prompt"]
        dense = _run(model, sample, None, eos)
        dense_ll = _answer_loglik(dense["logprobs"], targets, n_answer)
        for name in sample.get("presses", job["presses"]):
            for budget in sample.get("budgets", job["budgets"]):
                press = _make_press(name, budget, sample["n_prompt"], sample["n_context"])
                res = _run(model, sample, press, eos)
                p, q = dense["logprobs"], res["logprobs"]
                kl = (p.exp() * (p - q)).sum(-1).clamp_min(0)
                ll = _answer_loglik(q, targets, n_answer)
                print(json.dumps({
                    "key": sample["key"], "press": name, "budget": budget,
                    "prediction": tokenizer.decode(res["generated"], skip_special_tokens=True),
                    "answer_loglik": ll, "dense_answer_loglik": dense_ll,
                    "delta_loglik": ll - dense_ll, "answer_tokens": n_answer,
                    "kl": float(kl.mean()), "kl_answer": float(kl[-n_answer:].mean()),
                    "cache_tokens": res["cache_tokens"], "events": res["events"],
                    "seconds": res["seconds"],
                }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
