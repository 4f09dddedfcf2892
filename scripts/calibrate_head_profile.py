"""Calibrate a per-model head profile: how head granularity's budget splits over (layer,
KV head) when KVzip's reconstruction score spends it, averaged over calibration text.

    .venv/bin/python scripts/calibrate_head_profile.py
        [--samples 4] [--budget 416] [--out nexus_vllm/core/head_profiles/NAME.json]

Each calibration document (the TUNING set's long documents, data_seed 0: the report sets
never calibrate what they measure) is streamed in 512-token chunks with head granularity,
every chunk scored by reconstructing it (scripts/stream_reconstruction.py, KVzip's score,
one threshold over every (layer, KV head, token)) and the cache brought back within the
budget; after the context's last chunk, each head's share of the kept entries is read.
The profile is the mean share over the documents. ``head_profile: NAME`` then allocates
by it, with any per-head evidence choosing the entries inside each head, at no
reconstruction cost. About 40 s per document on one core.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

TASKS = ("niah_single_prose", "niah_multikey", "niah_single_noise")
RECONSTRUCTION = "reconstruction"


def calibrate(samples: int, budget: int, context: int, chunk_size: int,
              method: str = RECONSTRUCTION) -> tuple[str, torch.Tensor, list[str]]:
    """The model's name, the mean per-head share ``[L, Hkv]`` and the documents read,
    under ``method`` (``reconstruction``, or any eval method spec with a per-head score,
    e.g. ``snapkv:prompt_window=512``: the forward's own evidence, for comparison)."""
    from tqdm import tqdm

    from nexus_vllm.eval.runner import parse_method
    from nexus_vllm.eval.tasks import make_sample
    from nexus_vllm.hf import StreamingSession, make_config
    from nexus_vllm.models import load_causal_lm

    if method == RECONSTRUCTION:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        import stream_reconstruction  # noqa: PLC0415  (a script beside this one)

        stream_reconstruction.install()
        spec = parse_method("expected")
    else:
        spec = parse_method(method)
    name, tok, model = load_causal_lm("default")
    cfg = make_config(spec.method, budget, **{"prompt_mode": "stream", "granularity": "head",
                                              "chunk_size": chunk_size, **spec.knobs})
    total = None
    read = []
    docs = [(task, i) for i in range(samples) for task in TASKS]
    for task, index in tqdm(docs, desc="calibrate", dynamic_ncols=True):
        sample = make_sample(task, seed=0, index=index, target_tokens=context, tokenizer=tok,
                             protocol="question-last")
        ids = torch.tensor(tok(sample.preamble + sample.context)["input_ids"])
        session = StreamingSession(model, cfg)
        for start in range(0, ids.numel(), chunk_size):
            session.forward(ids[start:start + chunk_size])
            session.evict(prefill=True)
        live = session.head_live
        assert live is not None
        counts = live.sum(dim=-1).double()
        share = counts / counts.sum()
        total = share if total is None else total + share
        read.append(f"{task}[{index}]")
    assert total is not None
    return str(name), total / len(docs), read


def compare(shares: torch.Tensor, profile: str, budget: int, context: int) -> str:
    """How an allocation differs from a profile's: their rank correlation over the heads,
    and how many heads each leaves below half an even share (every head keeps its forced
    entries, about a quarter of an even share at 20%)."""
    from nexus_vllm.core.head_paged import load_head_profile

    ref = load_head_profile(profile).tensor()
    a, b = shares.flatten(), ref.flatten()
    ranks = [torch.argsort(torch.argsort(x)).double() for x in (a, b)]
    rho = float(torch.corrcoef(torch.stack(ranks))[0, 1])
    even = 1.0 / a.numel()
    starved = int((a < even / 2).sum()), int((b < even / 2).sum())
    mean_tokens = budget * a.numel()
    return (f"rank correlation with {profile}: {rho:+.2f}; heads under half an even "
            f"share: {starved[0]} here, {starved[1]} in the profile; the largest share here "
            f"{float(a.max()):.3f} ({float(a.max()) * mean_tokens:.0f} of {context} tokens), "
            f"in the profile {float(b.max()):.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=4, help="documents per task")
    ap.add_argument("--budget", type=int, default=416, help="tokens (20%% of --context)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--out", default="nexus_vllm/core/head_profiles/smollm2-135m-instruct.json")
    ap.add_argument("--method", default=RECONSTRUCTION,
                    help="what spends the budget: KVzip's reconstruction score (the "
                         "profile), or an eval method with a per-head score")
    ap.add_argument("--compare", default=None, metavar="PROFILE",
                    help="print how this allocation differs from PROFILE's (a name or a "
                         "file) instead of writing --out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, shares, read = calibrate(args.samples, args.budget, args.context, args.chunk_size,
                                    args.method)
    if args.compare:
        print(compare(shares, args.compare, args.budget, args.context))
        return
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    what = "KVzip's reconstruction score" if args.method == RECONSTRUCTION else args.method
    source = (f"scripts/calibrate_head_profile.py --samples {args.samples} --budget "
              f"{args.budget} --context {args.context} --method {args.method}: {what} in "
              f"stream, one threshold, on the tuning set's {', '.join(read)}")
    out.write_text(json.dumps({
        "model": pathlib.Path(model).name, "budget_share": args.budget / args.context,
        "source": source,
        "shares": [[round(float(x), 6) for x in row] for row in shares]}, indent=1) + "\n")
    top = torch.topk(shares.flatten(), 5)
    print(f"wrote {out}: the largest shares {[round(float(v), 3) for v in top.values]}, "
          f"the smallest {float(shares.min()):.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
