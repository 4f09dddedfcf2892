"""Where each kind of evidence ranks a needle's block at the stream events after the needle
is read and before the question is seen (the streaming regime's question: does the
evidence predict what a later question needs?).

    .venv/bin/python scripts/needle_ranks.py [--tasks niah_single_noise,niah_multikey]
        [--samples 4] [--rows 8,32,128] [--data-seed 0]

Each sample's prompt (question last, ~2k tokens) is streamed through the transformers path
in 512-token chunks without evicting; after every chunk past the needle, each evidence
kind is gathered over all blocks (expected attention from the newest ``rows`` queries, for
each value of ``--rows``; the window's mass as the mean of its rows; key norms, lowest
first; surprisal, each block's largest token NLL under the model, as prompt-compression
methods such as LLMLingua read it) and the needle's best block is ranked among the blocks
an event could evict (not the sink, not the newest three). Prints, per task, head reduction and evidence, the mean
rank as a fraction of the candidates and how often the needle is in the top 10%.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from nexus_vllm.core import EvictionConfig
from nexus_vllm.eval.tasks import make_sample
from nexus_vllm.hf.streaming import StreamingSession
from nexus_vllm.models import load_causal_lm

BLOCK, CHUNK = 32, 512


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="niah_single_noise,niah_multikey")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--rows", default="8,32,128")
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--model", default="default")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows_list = [int(x) for x in args.rows.split(",")]
    _, tok, model = load_causal_lm(args.model)
    ranks: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for task in args.tasks.split(","):
        for idx in range(args.samples):
            s = make_sample(task, seed=args.data_seed, index=idx, target_tokens=2048,
                            tokenizer=tok, protocol="question-last")
            prompt = s.preamble + s.context + s.question
            enc = tok(prompt, return_offsets_mapping=True)
            start = prompt.find(s.answers[0])
            end = start + len(s.answers[0])
            needle = sorted({i // BLOCK for i, (a, b) in enumerate(enc["offset_mapping"])
                             if a < end and b > start})
            question_at = len(tok(s.preamble + s.context)["input_ids"])
            ids = torch.tensor(enc["input_ids"])
            for attention_reduce in ("mean", "max"):
                cfg = EvictionConfig(method="nexus", max_tokens=1 << 20, block_size=BLOCK,
                                     window=max(rows_list), prompt_window=max(rows_list),
                                     attention_reduce=attention_reduce)
                sess = StreamingSession(model, cfg, prompt_tokens=1 << 30)
                surprisal = torch.zeros(0)  # each fed token's NLL given the ones before
                last: torch.Tensor | None = None  # the previous chunk's last logits
                for at in range(0, question_at - CHUNK, CHUNK):
                    chunk = ids[at:at + CHUNK]
                    logits = sess.forward(chunk, logits_to_keep=0)
                    before = logits[:-1] if last is None else torch.cat([last[None], logits[:-1]])
                    nll = torch.nn.functional.cross_entropy(
                        before, chunk[-before.shape[0]:], reduction="none")
                    surprisal = torch.cat([surprisal, torch.zeros(chunk.shape[0] - nll.shape[0]),
                                           nll])
                    last = logits[-1]
                    if at + CHUNK <= needle[-1] * BLOCK:
                        continue  # the needle is not read yet
                    n = -(-sess.seen // BLOCK)
                    scores = {f"expected_attention ({r} rows)": sess.gather(
                        frozenset({"expected_attention"}), r)["expected_attention"]
                        for r in rows_list}
                    got = sess.gather(frozenset({"mass", "key_norms"}), 32)
                    scores["mass (32 rows, mean)"] = got["mass"].mean(0)
                    scores["key norms (lowest first)"] = -got["key_norms"]
                    padded = torch.full((n * BLOCK,), float("-inf"))
                    padded[:surprisal.shape[0]] = surprisal
                    scores["surprisal (block max)"] = padded.view(n, BLOCK).max(1).values
                    for name, values in scores.items():
                        cand = values[1:n - 3]
                        order = torch.argsort(cand, descending=True).tolist()
                        inside = [b - 1 for b in needle if 1 <= b < n - 3]
                        if inside:
                            best = min(order.index(b) for b in inside)
                            ranks[(task, attention_reduce, name)].append(best / len(cand))
    print(f"{'task':20} {'heads':6} {'evidence':30} {'mean rank':>10} {'top 10%':>8}")
    for (task, attention_reduce, name), values in ranks.items():
        top = sum(1 for v in values if v < 0.1)
        print(f"{task:20} {attention_reduce:6} {name:30} {sum(values) / len(values):10.2f} "
              f"{top:>4}/{len(values)}")


if __name__ == "__main__":
    main()
