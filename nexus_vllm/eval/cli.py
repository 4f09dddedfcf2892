"""``nexus-vllm eval``: offline long-context evaluation of eviction policies.

Example (the headline run)::

    nexus-vllm eval --tasks niah_single_noise,niah_single_prose --methods dense,nexus,h2o \\
        --budgets 0.2 --context 2048 --samples 4 --seeds 2 --out runs/headline

Writes into ``--out``: ``records.jsonl`` (one line per run, resumable), ``results.json``
(config + aggregated rows with 95% bootstrap intervals), ``config.yaml``, ``table.md`` and
``plot_<metric>.png`` (metric vs budget per task).

``--calibrate`` runs dense only over the tasks and ``--context`` lengths (comma list) and
writes ``calibration.md``: keep tasks and lengths where dense is well above chance.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any

__all__ = ["build_parser", "main"]

DEFAULT_TASKS = "niah_single_noise,niah_single_prose,niah_multikey,vt,passkey"
DEFAULT_METHODS = "dense,nexus,h2o,snapkv,tova,streaming,random"


def _budget(text: str) -> float | int:
    """'0.2' -> keep ratio 0.2 (float); '512' -> 512 tokens (int)."""
    v = float(text)
    if "." in text or "e" in text.lower():
        return v
    return int(v)


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nexus-vllm eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=pathlib.Path, default=None,
                   help="YAML file with any of these options (CLI flags override it)")
    p.add_argument("--model", default=None,
                   help="HF model dir or hub name (default: the embedded SmolLM2-135M)")
    p.add_argument("--tasks", default=None, help=f"comma list (default {DEFAULT_TASKS})")
    p.add_argument("--methods", default=None,
                   help="comma list; a method may carry knobs: 'nexus:sampler=topk,lam=0' "
                        "(separate specs with ';' when knobs are used)")
    p.add_argument("--budgets", default=None, help="comma list; float = kept ratio, int = tokens")
    p.add_argument("--context", default=None, help="target prompt tokens (comma list allowed)")
    p.add_argument("--samples", type=int, default=None, help="samples per task")
    p.add_argument("--seeds", type=int, default=None,
                   help="sampler seeds per sample for stochastic methods")
    p.add_argument("--data-seed", type=int, default=None,
                   help="sample set (tune knobs on one, report on another; default 1)")
    p.add_argument("--protocol", default=None, help="question-last,question-first")
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--knobs", default=None,
                   help="JSON dict of EvictionConfig knobs for every eviction method")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    p.add_argument("--calibrate", action="store_true", help="dense only; write calibration.md")
    p.add_argument("--peer", choices=["kvpress"], default=None,
                   help="also run the reference library's presses (own virtualenv)")
    p.add_argument("--out", type=pathlib.Path, required=False, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild results/table/plots from records.jsonl without running")
    return p


def _merge(args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    if args.config is not None:
        import yaml

        cfg = yaml.safe_load(args.config.read_text()) or {}
        if not isinstance(cfg, dict):
            raise ValueError(f"--config {args.config} must hold a mapping")
        cfg = {k.replace("-", "_"): v for k, v in cfg.items()}
    for k, v in vars(args).items():
        if v is not None and k != "config" and v is not False:
            cfg[k] = v
    return cfg


def _as_list(v: Any, sep: str = ",") -> list[str]:
    if isinstance(v, (list, tuple)):
        return [str(x) for x in v]
    return [t.strip() for t in str(v).split(sep) if t.strip()]


def _methods(v: Any) -> list[str]:
    if isinstance(v, (list, tuple)):
        return [str(x) for x in v]
    text = str(v)
    return _as_list(text, ";" if ":" in text else ",")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = _merge(args)
    out = pathlib.Path(opts.get("out") or "runs/eval")
    threads = int(opts.get("threads", 1))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    torch.set_num_threads(threads)
    from nexus_vllm.eval.runner import RunConfig, config_dict, run_eval
    from nexus_vllm.eval.tasks import PROTOCOLS, TASKS

    tasks = _as_list(opts.get("tasks", DEFAULT_TASKS))
    for t in tasks:
        if t not in TASKS:
            raise SystemExit(f"unknown task {t!r}; choose from {sorted(TASKS)}")
    protocols = _as_list(opts.get("protocol", ",".join(PROTOCOLS)))
    methods = ["dense"] if opts.get("calibrate") else _methods(
        opts.get("methods", DEFAULT_METHODS))
    knobs = opts.get("knobs") or {}
    if isinstance(knobs, str):
        knobs = json.loads(knobs)
    budgets = [b if isinstance(b, (int, float)) else _budget(b)
               for b in _as_list(opts.get("budgets", "0.2"))]
    budgets = [_budget(str(b)) if isinstance(b, str) else b for b in budgets]
    cfg = RunConfig(
        model=str(opts.get("model") or "default"), tasks=tuple(tasks), methods=tuple(methods),
        budgets=tuple(budgets), contexts=tuple(int(c) for c in _as_list(opts.get("context", 2048))),
        protocols=tuple(protocols), samples=int(opts.get("samples", 4)),
        seeds=int(opts.get("seeds", 2)), data_seed=int(opts.get("data_seed", 1)),
        chunk_size=int(opts.get("chunk_size", 512)), knobs=dict(knobs), threads=threads,
    )
    out.mkdir(parents=True, exist_ok=True)
    _write_config(out, cfg, config_dict)

    if opts.get("report_only"):
        records = []
        for name in ("records.jsonl", "kvpress_records.jsonl"):
            if (out / name).exists():
                records += [json.loads(x) for x in (out / name).read_text().splitlines() if x]
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from nexus_vllm.models import resolve_model_path

        path = resolve_model_path(None if cfg.model == "default" else cfg.model)
        print(f"nexus-vllm eval: model {path}, {threads} thread(s), out {out}", file=sys.stderr)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
        records = run_eval(cfg, model, tokenizer, out, progress=not opts.get("no_progress"))
    if opts.get("peer") == "kvpress":
        records = records + _run_kvpress_peer(cfg, out)
    _write_reports(out, cfg, records, calibrate=bool(opts.get("calibrate")))
    print(f"nexus-vllm eval: wrote {out}/results.json, table.md, plots", file=sys.stderr)
    return 0


def _run_kvpress_peer(cfg: Any, out: pathlib.Path) -> list[dict[str, Any]]:
    """kvpress presses on exactly our samples' token ids (own virtualenv, see peers.py).

    Records go to ``kvpress_records.jsonl`` (resumable per sample) in our record format,
    with methods named ``kvpress:<press>``.
    """
    from transformers import AutoTokenizer

    from nexus_vllm.eval.peers import PEER_PRESSES, run_kvpress
    from nexus_vllm.eval.runner import _key
    from nexus_vllm.eval.tasks import make_sample
    from nexus_vllm.hf.generate import encode_prompt
    from nexus_vllm.models import resolve_model_path

    path = resolve_model_path(None if cfg.model == "default" else cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rec_path = out / "kvpress_records.jsonl"
    records = [json.loads(x) for x in rec_path.read_text().splitlines() if x.strip()] \
        if rec_path.exists() else []
    budgets = [b for b in cfg.budgets if isinstance(b, float)]
    per_sample: dict[tuple[Any, ...], int] = {}
    for r in records:
        sid_done = tuple(json.loads(r["key"])[:4])
        per_sample[sid_done] = per_sample.get(sid_done, 0) + 1
    # A sample is done when every press x budget came back (the worker streams per sample).
    done = {k for k, n in per_sample.items() if n >= len(PEER_PRESSES) * len(budgets)}
    samples, meta = [], {}
    for context in cfg.contexts:
        for task in cfg.tasks:
            for index in range(cfg.samples):
                for protocol in cfg.protocols:
                    sid = (task, context, protocol, index)
                    if sid in done:
                        continue
                    s = make_sample(task, seed=cfg.data_seed, index=index, target_tokens=context,
                                    tokenizer=tokenizer, protocol=protocol)
                    split = encode_prompt(tokenizer, s.context, s.question, preamble=s.preamble,
                                          answer=s.target)
                    key = json.dumps(list(sid))
                    meta[key] = (sid, s)
                    samples.append({"key": key, "ids": split.ids.tolist(),
                                    "n_context": split.n_context, "n_prompt": split.n_prompt,
                                    "max_new_tokens": s.max_new_tokens})
    if not samples:
        return records
    with rec_path.open("a") as fh:
        def on_record(r: dict[str, Any]) -> None:
            sid, s = meta[r["key"]]
            label = f"kvpress:{r['press']}"
            budget = r["budget"]
            rec = {**{k: v for k, v in r.items() if k not in ("press", "key")},
                   "key": _key(*sid, label, budget, 0), "task": sid[0], "context": sid[1],
                   "protocol": sid[2], "index": sid[3], "method": label, "budget": budget,
                   "seed": 0, "score": s.score(r["prediction"]), "answers": list(s.answers),
                   "prompt_tokens": s.num_tokens, "events": 1}
            if rec["key"] in seen:  # re-run of a partially finished sample
                return
            seen.add(rec["key"])
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            records.append(rec)

        seen = {r["key"] for r in records}
        run_kvpress(samples, model=path, presses=PEER_PRESSES, budgets=budgets,
                    threads=cfg.threads, on_record=on_record)
    return records


def _write_config(out: pathlib.Path, cfg: Any, config_dict: Any) -> None:
    import yaml

    (out / "config.yaml").write_text(yaml.safe_dump(config_dict(cfg), sort_keys=False))


def _write_reports(out: pathlib.Path, cfg: Any, records: list[dict[str, Any]], *,
                   calibrate: bool) -> None:
    from nexus_vllm.eval.report import (
        calibration_table,
        markdown_table,
        plot_bars,
        plot_vs_budget,
        summary_table,
    )
    from nexus_vllm.eval.runner import aggregate, config_dict

    rows = aggregate(records)
    (out / "results.json").write_text(json.dumps(
        {"config": config_dict(cfg), "rows": rows}, indent=1))
    parts = [f"# Results: {out}\n", "Cells: mean [95% bootstrap CI over samples].\n"]
    if calibrate:
        parts += ["## Dense calibration (string match)\n", calibration_table(rows), ""]
        (out / "calibration.md").write_text("\n".join(parts) + "\n")
        return
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None}, key=float)
    protocols = sorted({r["protocol"] for r in records})
    for b in budgets:
        for proto in [*protocols, None] if len(protocols) > 1 else [None]:
            parts += [f"## Summary at budget {b}, {proto or 'all protocols'} "
                      "(pooled over tasks)\n", summary_table(records, budget=b, protocol=proto),
                      ""]
    for metric, title, digits in (("score", "Score (RULER string match, 0-1)", 2),
                                  ("delta_loglik", "Δ answer log-likelihood vs dense (nats)", 2),
                                  ("kl", "KL(dense ‖ method), mean per token (nats)", 3)):
        for b in budgets:
            parts += [f"## {title} at budget {b}\n", markdown_table(rows, metric=metric,
                                                                      budget=b, digits=digits), ""]
    (out / "table.md").write_text("\n".join(parts) + "\n")
    for metric in ("score", "delta_loglik", "kl"):
        if len(budgets) > 1:
            plot_vs_budget(rows, out / f"plot_{metric}.png", metric=metric)
        for b in budgets:
            plot_bars(rows, out / f"bars_{metric}_{b}.png", metric=metric, budget=b)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
