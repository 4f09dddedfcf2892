"""Train the learned stand-in for KVzip's reconstruction score per (layer, KV head, token)
(``nexus_vllm/core/head_scorer.py``) on text outside every evaluation set.

    .venv/bin/python scripts/train_head_scorer.py [--docs 32] [--held-out 4]
        [--data runs/head_scorer_data.pt] [--out nexus_vllm/core/head_scorers/NAME.pt]
        [--compare-features]

The text: Python's own language reference (``pydoc_data.topics``) and the long descriptions
of the packages installed in this environment, cut into ~2k-token documents, each in a
user turn of the model's chat template (the report sets' prompts are Paul Graham's essays
and synthetic needles, neither of which is here). Each document is streamed through the
transformers path in 512-token chunks with nothing evicted; after each chunk KVzip's
reconstruction score of the chunk is read (``scripts/stream_reconstruction.py``:
"Repeat the previous context exactly.", then the chunk again) per (full layer, KV head,
token), and each token's attention input (the layer's ``input_layernorm`` output) is
kept. The map per layer is ridge regression from the attention input to
``log(score)`` per KV head, in closed form (KVzap's linear variant; one matrix product per
token and layer at run time). About 15 s per document on one core, then seconds to fit.

Prints each layer's held-out R^2 and how much of the reconstruction's own top fifth of
(layer, head, token) units the map's top fifth recovers on the held-out documents (one
threshold over all of them, as head granularity spends the budget).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
DOC_TOKENS = 2048
CHUNK = 512
LOG_FLOOR = 1e-6  # scores below this are the same (never kept)
RIDGE = 1e-2


def _recon_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "stream_reconstruction", REPO / "scripts" / "stream_reconstruction.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def corpus() -> list[str]:
    """Texts outside every evaluation set, in a fixed order."""
    import pydoc_data.topics as topics

    texts = [topics.topics[k] for k in sorted(topics.topics)]
    pages = []
    for dist in sorted(importlib.metadata.distributions(),
                       key=lambda d: d.metadata.get("Name", "") or ""):
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if isinstance(body, str) and len(body) > 4000:
            pages.append(body)
    # Interleave the two sources so a few documents hold both.
    out: list[str] = []
    for i in range(max(len(texts), len(pages))):
        if i < len(pages):
            out.append(pages[i])
        if i < len(texts):
            out.append(texts[i])
    return out


def documents(tokenizer: Any, n: int) -> list[torch.Tensor]:
    """``n`` token-id documents of ``DOC_TOKENS``, each a chat user turn's start followed
    by the corpus text (consecutive texts joined until long enough)."""
    marker = "\x00"
    head = tokenizer.apply_chat_template([{"role": "user", "content": marker}],
                                         add_generation_prompt=False, tokenize=False
                                         ).split(marker)[0]
    head_ids = tokenizer(head + "Read the following text.\n\n",
                         add_special_tokens=False)["input_ids"]
    docs: list[torch.Tensor] = []
    buf: list[int] = []
    for text in corpus():
        buf += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
        while len(buf) >= DOC_TOKENS - len(head_ids):
            take = DOC_TOKENS - len(head_ids)
            docs.append(torch.tensor(head_ids + buf[:take]))
            buf = buf[take:]
            if len(docs) == n:
                return docs
    raise SystemExit(f"the corpus holds only {len(docs)} documents of {DOC_TOKENS} tokens")


@torch.no_grad()
def collect(model: Any, docs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per document token: each full layer's attention input ``[N, L, D]`` (fp16) and the
    reconstruction's ``log(score)`` ``[N, L, Hkv]``."""
    from tqdm import tqdm

    from nexus_vllm.hf.streaming import StreamingSession, make_config

    recon = _recon_module()
    recon.install()
    layers_mod = model.model.layers
    inputs: dict[int, list[torch.Tensor]] = {}
    capturing = [False]

    def hook(li: int) -> Any:
        def fn(_m: Any, _inp: Any, out: torch.Tensor) -> None:
            if capturing[0]:
                inputs.setdefault(li, []).append(out[0].detach().to(torch.float16))
        return fn

    xs, ys = [], []
    for doc in tqdm(docs, desc="reconstruction scores", unit="doc"):
        config = make_config("expected", 1 << 20, granularity="head", prompt_mode="stream")
        session = StreamingSession(model, config, prompt_tokens=1 << 30)
        full = session.full_attention_layers
        handles = [layers_mod[li].input_layernorm.register_forward_hook(hook(li)) for li in full]
        try:
            for start in range(0, int(doc.numel()), CHUNK):
                capturing[0] = True
                session.forward(doc[start:start + CHUNK])
                capturing[0] = False
                recon.reconstruct(session)
        finally:
            for h in handles:
                h.remove()
        x = torch.stack([torch.cat(inputs.pop(li)) for li in full], dim=1)  # [N, L, D]
        scores = recon.head_scores(session)  # [L, Hkv, N]
        ys.append(scores.clamp_min(LOG_FLOOR).log().permute(2, 0, 1).float())
        xs.append(x)
    return {"x": torch.cat(xs), "y": torch.cat(ys),
            "doc": torch.cat([torch.full((int(d.numel()),), i) for i, d in enumerate(docs)])}


def fit(x: torch.Tensor, y: torch.Tensor, ridge: float = RIDGE
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge regression per layer: ``x`` ``[N, L, D]``, ``y`` ``[N, L, H]`` -> weight
    ``[L, D, H]`` and bias ``[L, H]`` (the inputs centred, the penalty scaled by N)."""
    n, layers, d = x.shape
    weights, biases = [], []
    for li in range(layers):
        xl = x[:, li].double()
        yl = y[:, li].double()
        mx, my = xl.mean(0), yl.mean(0)
        xc, yc = xl - mx, yl - my
        gram = xc.T @ xc + ridge * n * torch.eye(d, dtype=torch.float64) * xc.var(0).mean()
        w = torch.linalg.solve(gram, xc.T @ yc)
        weights.append(w.float())
        biases.append((my - mx @ w).float())
    return torch.stack(weights), torch.stack(biases)


def predict(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x`` ``[N, L, D]`` -> ``[N, L, H]``."""
    return torch.einsum("nld,ldh->nlh", x.float(), weight) + bias


def report(x: torch.Tensor, y: torch.Tensor, doc: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor, keep: float = 0.2) -> None:
    pred = predict(x, weight, bias)
    resid = ((pred - y) ** 2).mean(dim=(0, 2))
    total = y.var(dim=0).mean(dim=1)
    r2 = 1 - resid / total
    print("held-out R^2 per layer:", " ".join(f"{v:.2f}" for v in r2.tolist()))
    overlaps = []
    for d in doc.unique().tolist():
        sel = doc == d
        truth, guess = y[sel].flatten(), pred[sel].flatten()
        k = int(keep * truth.numel())
        top_t = set(truth.topk(k).indices.tolist())
        top_g = set(guess.topk(k).indices.tolist())
        overlaps.append(len(top_t & top_g) / k)
    print(f"top {keep:.0%} of (layer, head, token) units recovered per held-out document: "
          + " ".join(f"{o:.2f}" for o in overlaps))


def key_features(model: Any, x: torch.Tensor, kind: str) -> list[torch.Tensor]:
    """What a server's attention op could score from instead of the attention input: per
    layer ``[N, F]`` of the keys before RoPE (``keys``, every KV head of the layer), or the
    norms of their RoPE pairs (``key_pair_norms``: the same before and after RoPE, so a
    worker reads them off the cached keys with no positions)."""
    text = model.config
    hkv = int(text.num_key_value_heads)
    out = []
    for li in range(x.shape[1]):
        wk = model.model.layers[li].self_attn.k_proj.weight.detach().double()
        k = (x[:, li].double() @ wk.T).view(x.shape[0], hkv, -1)
        if kind == "key_pair_norms":
            half = k.shape[-1] // 2  # transformers' rotate_half pairs i with i + D/2
            k = k[..., :half] ** 2 + k[..., half:] ** 2
        out.append(k.reshape(x.shape[0], -1).float())
    return out


def _keys_scorer_as_input_map(model: Any, x: torch.Tensor, y: torch.Tensor, ridge: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge on the keys before RoPE, then the same map written on the attention input:
    ``w_x = W_k^T w_k`` (plus ``b_k . w_k`` in the bias where ``k_proj`` has one)."""
    feats = torch.stack(key_features(model, x, "keys"), dim=1)
    w_keys, bias = fit(feats, y, ridge)  # [L, Hkv*hd, H], [L, H]
    weights = []
    for li in range(x.shape[1]):
        proj = model.model.layers[li].self_attn.k_proj
        weights.append(proj.weight.detach().float().T @ w_keys[li])
        if proj.bias is not None:
            bias[li] = bias[li] + proj.bias.detach().float() @ w_keys[li]
    return torch.stack(weights), bias


def compare_features(model: Any, x: torch.Tensor, y: torch.Tensor, doc: torch.Tensor,
                     train: torch.Tensor, ridge: float) -> None:
    """The held-out report of the maps from the keys (after the attention input's)."""
    for kind in ("keys", "key_pair_norms"):
        feats = torch.stack(key_features(model, x, kind), dim=1)  # [N, L, F]
        print(f"features: {kind}")
        weight, bias = fit(feats[train], y[train], ridge)
        report(feats[~train], y[~train], doc[~train], weight, bias)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--held-out", type=int, default=4)
    ap.add_argument("--data", default="runs/head_scorer_data.pt",
                    help="where the collected (input, score) pairs are cached")
    ap.add_argument("--ridge", type=float, default=RIDGE)
    ap.add_argument("--out", default=None,
                    help="write the scorer fitted on every document here (.pt)")
    ap.add_argument("--features", choices=("attention_input", "keys"),
                    default="attention_input",
                    help="what the written scorer reads: keys = a map fitted on the keys "
                         "before RoPE, written as the same map of the attention input "
                         "(k = W_k x), so the transformers path runs it unchanged")
    ap.add_argument("--compare-features", action="store_true",
                    help="also fit maps from the keys and from their RoPE pair norms "
                         "(what vLLM's attention op sees) and report them beside it")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO))
    from nexus_vllm.models import load_causal_lm

    name, tok, model = load_causal_lm(args.model)
    data_path = Path(args.data)
    if data_path.exists():
        data = torch.load(data_path)
    else:
        data = collect(model, documents(tok, args.docs))
        data_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, data_path)
    x, y, doc = data["x"], data["y"], data["doc"]
    train = doc < int(doc.max()) + 1 - args.held_out
    if args.compare_features:
        print("features: attention input")
    weight, bias = fit(x[train], y[train], args.ridge)
    report(x[~train], y[~train], doc[~train], weight, bias)
    if args.compare_features:
        compare_features(model, x, y, doc, train, args.ridge)
    if args.out:
        from nexus_vllm.core.head_scorer import HeadScorer

        if args.features == "keys":
            weight, bias = _keys_scorer_as_input_map(model, x, y, args.ridge)
        else:
            weight, bias = fit(x, y, args.ridge)
        source = (f"scripts/train_head_scorer.py --docs {args.docs} --held-out "
                  f"{args.held_out} --ridge {args.ridge} --features {args.features}")
        HeadScorer(model=Path(name).name, weight=weight, bias=bias, source=source
                   ).save(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
