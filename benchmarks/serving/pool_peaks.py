"""Each request's blocks in vLLM's own block pool, against the bound admission reserves.

Runs an evicting engine in this process (vLLM's ``LLM``, the flags a capacity server gets)
and reads vLLM's block lists after every ``schedule()``: vLLM allocates a step's blocks
only there and eviction only frees, so the largest count read is the most blocks the
request ever held in the pool. Nothing is read from the plugin's gauges; they are printed
beside it for comparison. Per request:

* ``prompt``: its prompt in tokens as vLLM counts it (``num_prompt_tokens``: after the
  server's tokenizer, special tokens included);
* ``pool peak``: the most blocks of its full-attention block list that were not null;
* ``bound``: ``budget.bound_blocks`` of its prompt and longest sequence (what
  admission reserved for it);
* ``plugin peak``: the plugin's own per-request peak (``vllm:nexus_request_peak_live_blocks``).

It also checks, after every step, that the pool's used blocks are the requests' blocks
(prefix caching is off): nothing held outside the lists read.

    python benchmarks/serving/pool_peaks.py --prompt-lens 992,1023,1024,1025,1056 \\
        --budget 256 --output-len 48                 # SmolLM2, token ids, one at a time
    python benchmarks/serving/pool_peaks.py --model TINY --budget 224 --output-len 16 \\
        --random-input-len 1024 --num-prompts 2 --seed 1   # the capacity smoke's prompts

``--random-input-len`` makes the prompts as ``vllm bench serve --dataset-name random
--seed SEED`` does (text, re-encoded by the server's tokenizer), which the capacity smoke
sends (``capacity.py --smoke``: seed 1 at concurrency 1, seed 2 at 2).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="HF model name or path (default: the embedded SmolLM2 checkpoint)")
    p.add_argument("--method", default="nexus")
    p.add_argument("--prompt-mode", default="end", choices=("stream", "end", "keep"))
    p.add_argument("--budget", type=int, default=256, help="--kv-budget, tokens")
    p.add_argument("--chunk", type=int, default=64, help="--kv-chunk-size, tokens")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--prompt-lens", default=None,
                   help="comma-separated prompt lengths: random token ids, sent as ids")
    p.add_argument("--random-input-len", type=int, default=None,
                   help="vllm bench serve's random prompts of this length (text)")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests running at once (--max-num-seqs)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest prompt + output + one block")
    p.add_argument("--pool-blocks", type=int, default=None,
                   help="--num-gpu-blocks-override (default: two requests of "
                        "--max-model-len plus the null block)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--json", type=pathlib.Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    if (args.prompt_lens is None) == (args.random_input_len is None):
        p.error("give one of --prompt-lens and --random-input-len")
    return args


def random_prompts(model: str, input_len: int, output_len: int, num: int,
                   seed: int) -> list[str]:
    """The prompts ``vllm bench serve --dataset-name random`` sends with these settings."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    bench = parser.parse_args(["--model", model, "--dataset-name", "random",
                               "--random-input-len", str(input_len), "--random-output-len",
                               str(output_len), "--num-prompts", str(num), "--seed",
                               str(seed)])
    return [str(s.prompt) for s in get_samples(bench, get_tokenizer(model))]


def token_prompts(lens: list[int], vocab: int, seed: int) -> list[dict[str, list[int]]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    # Ordinary ids (above the first few, where special tokens live).
    return [{"prompt_token_ids": rng.integers(10, vocab, size=n).tolist()} for n in lens]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    from nexus_vllm.integration.testing.pool_watch import PoolWatch

    model = args.model
    if model is None:
        from nexus_vllm.models import default_model_path

        model = str(default_model_path())
    bs = args.block_size
    prompts: list[Any]
    if args.prompt_lens is not None:
        lens = [int(n) for n in args.prompt_lens.split(",")]
        vocab = int(AutoConfig.from_pretrained(model).vocab_size)
        prompts = token_prompts(lens, vocab, args.seed)
        longest = max(lens)
    else:
        prompts = random_prompts(model, args.random_input_len, args.output_len,
                                 args.num_prompts, args.seed)
        longest = 2 * args.random_input_len  # re-encoded text may run a little longer
    max_len = args.max_model_len or longest + args.output_len + bs
    pool = args.pool_blocks or 2 * -(-max_len // bs) + 1
    nexus = {"method": args.method, "max_tokens": args.budget, "chunk_size": args.chunk,
             "prompt_mode": args.prompt_mode}
    gpu = torch.cuda.is_available()
    engine: dict[str, Any] = dict(
        model=model, max_model_len=max_len, max_num_seqs=args.concurrency, block_size=bs,
        num_gpu_blocks_override=pool, enable_prefix_caching=False,
        additional_config={"nexus": nexus})
    if not gpu:
        engine.update(enforce_eager=True, dtype="float32", distributed_executor_backend="uni")
    if args.max_num_batched_tokens:
        engine["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(**engine)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    watch = PoolWatch(scheduler).wrap()
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = sorted(watch.rows.values(), key=lambda r: r.arrival)  # the prompts' order
    sched_cfg = scheduler.scheduler_config
    print(f"{type(scheduler).__name__}, {scheduler.nexus_manager.steps_in_flight} step(s) in "
          f"flight, block {bs}, budget {args.budget}, prompt_mode {args.prompt_mode}, "
          f"prefill cap {sched_cfg.long_prefill_token_threshold or 'none'}, step budget "
          f"{sched_cfg.max_num_batched_tokens}, {watch.reads} steps, pool used != sum of "
          f"request blocks after {len(watch.mismatches)} of them")
    print("| prompt tokens | output tokens | prompt blocks | pool peak | bound | plugin peak |")
    print("|---:|---:|---:|---:|---:|---:|")
    table = []
    for row, out in zip(rows, outs):
        output = len(out.outputs[0].token_ids)
        print(f"| {row.prompt} | {output} | {-(-row.prompt // bs)} | {row.peak} | "
              f"{row.bound} | {row.plugin_peak} |")
        table.append({"prompt": row.prompt, "output": output, "pool_peak": row.peak,
                      "bound": row.bound, "plugin_peak": row.plugin_peak})
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=1))
    return 1 if watch.over_bound() or watch.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
