"""Scheduler-side eviction work per engine step, beside vLLM's own ``schedule()``.

    python benchmarks/scheduler/schedule_overhead.py [--tokens 1024,8192,32768]
        [--requests 64,256] [--steps 24]

For each size, ``R`` requests are prefilled to ``L`` tokens through a real
``NexusScheduler`` (vLLM 0.32's ``Scheduler`` underneath, block size 16, budget 1024
tokens, ``streaming`` policy so no scores are needed, no model): their block lists hold
``L / 16`` logical entries, all but about 70 of them null, as a long evicting request's
do. Then every request decodes one token per step and each step is timed, split into:

* **vLLM**: ``Scheduler.schedule()`` + ``update_from_output()`` of vLLM itself (the
  NexusScheduler step minus the eviction work below, and minus applying the worker's
  reply, which runs the policies);
* **ours**: ``EvictionManager.plan_step`` + one admission check (``may_admit`` of a
  waiting request, as vLLM asks while the pool is full) + ``stats()`` (vLLM's
  ``update_from_output`` calls ``make_stats`` every step);
* **ours, full reads**: the same with the live blocks found by reading every block list
  in full, as 8762f6d did (:class:`FullReadLiveBlocks`, kept here as the reference).

The two ``ours`` variants alternate step by step over the same scheduler state, so they
are measured side by side in one run. Prints the median microseconds per step and the
ratios (docs/performance.md, "Scheduler work per step"). Needs vLLM; about 30 s on 2 CPU
cores for the default sizes, most of it importing vLLM and the prefill.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from nexus_vllm.core.budget import hard_limit

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

BLOCK = 16
BUDGET = 1024
CHUNK = 512
# A config vLLM reads the model's shape from; the scheduler runs no model.
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
              "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 65536,
              "torch_dtype": "float32", "rms_norm_eps": 1e-5}


def full_read_live_blocks() -> type:
    """``LiveBlocks`` as 8762f6d had it: every call reads the request's whole list."""
    from nexus_vllm.integration.compat.vllm_compat import BlockPoolView
    from nexus_vllm.integration.scheduler.live_blocks import LiveBlocks

    class FullReadLiveBlocks(LiveBlocks):
        def live_indices(self, st: Any, num_blocks: int | None = None) -> Sequence[int]:
            blocks = self.of(st.req_id)
            if num_blocks is not None:
                blocks = blocks[:num_blocks]
            return [j for j, b in enumerate(blocks) if not BlockPoolView.is_null(b)]

        def live_count(self, st: Any, num_blocks: int | None = None) -> int:
            return len(self.live_indices(st, num_blocks))

    return FullReadLiveBlocks


def make_scheduler(model_dir: pathlib.Path, requests: int, tokens: int) -> Any:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from nexus_vllm.core import EvictionConfig
    from nexus_vllm.integration.scheduler.scheduler import NexusScheduler

    max_len = tokens + 1024
    cfg = EvictionConfig(method="streaming", max_tokens=BUDGET, chunk_size=CHUNK,
                         block_size=BLOCK)
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                        max_model_len=max_len)
    sched = SchedulerConfig(max_num_seqs=requests, max_num_batched_tokens=requests * CHUNK,
                            max_model_len=max_len, enable_chunked_prefill=True,
                            long_prefill_token_threshold=CHUNK, is_encoder_decoder=False)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    vllm_config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                             additional_config={"nexus": cfg.to_dict()})
    # Each request holds at most budget + chunk + one block; one more request's worth spare.
    num_blocks = (requests + 1) * (hard_limit(cfg, tokens, tokens) + 2) + 1
    cache.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32,
                             dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return NexusScheduler(vllm_config=vllm_config, kv_cache_config=kv,
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          block_size=BLOCK, log_stats=True)


def _request(req_id: str, tokens: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, [7] * tokens, SamplingParams(max_tokens=4096, ignore_eos=True),
                   None)


def _runner_output(scheduler_output: Any, requests: dict[str, Any]) -> Any:
    """The model runner's output of a step: a token for every request whose prompt is
    done, nothing for a partial prefill chunk; with the worker's acknowledgement."""
    from vllm.v1.outputs import ModelRunnerOutput

    from nexus_vllm.integration.protocol import WorkerReply, attach_reply, read_plan

    ids = list(scheduler_output.num_scheduled_tokens)
    sampled = [[] if requests[r].num_computed_tokens < requests[r].num_prompt_tokens
               else [7] for r in ids]
    out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=sampled)
    plan = read_plan(scheduler_output)
    return attach_reply(out, WorkerReply(step_id=None if plan is None else plan.step_id))


class Timed:
    """Wraps a bound method; ``take()`` returns the seconds spent in it since last time."""

    def __init__(self, obj: Any, name: str) -> None:
        self.fn: Callable[..., Any] = getattr(obj, name)
        self.spent = 0.0
        setattr(obj, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.spent += time.perf_counter() - t0

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def measure(model_dir: pathlib.Path, requests: int, tokens: int,
            steps: int) -> dict[str, float]:
    from vllm.v1.request import RequestStatus

    from nexus_vllm.integration.scheduler.live_blocks import LiveBlocks

    sched = make_scheduler(model_dir, requests, tokens)
    mgr = sched.nexus_manager
    for i in range(requests):
        sched.add_request(_request(f"r{i}", tokens))
    # Prefill (chunks of 512 tokens, an eviction event after each) up to L tokens.
    while any(r.num_computed_tokens < tokens for r in sched.requests.values()):
        out = sched.schedule()
        sched.update_from_output(out, _runner_output(out, sched.requests))
    probe = _request("waiting", tokens)
    probe.status = RequestStatus.WAITING
    timers = {name: Timed(mgr, name) for name in ("plan_step", "apply_reply", "stats")}
    variants = {"ours": LiveBlocks, "ours, full reads": full_read_live_blocks()}
    samples: dict[str, list[float]] = {k: [] for k in ("vllm", *variants)}
    for step in range(steps + 2 * len(variants)):
        name = list(variants)[step % len(variants)]
        mgr.blocks.__class__ = variants[name]
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.update_from_output(out, _runner_output(out, sched.requests))
        step_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        mgr.may_admit(probe)
        admit_s = time.perf_counter() - t1
        plan_s, apply_s, stats_s = (timers[k].take() for k in timers)
        if step >= 2 * len(variants):  # the first steps of each warm up
            samples["vllm"].append(step_s - plan_s - apply_s - stats_s)
            samples[name].append(plan_s + admit_s + stats_s)
    blocks = [len(mgr.blocks.of(r)) for r in sched.requests]
    live = [mgr.blocks.live_count(st) for r, st in mgr.states.items() if r in sched.requests]
    result = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    result.update(logical_blocks=statistics.mean(blocks), live_blocks=statistics.mean(live))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1024,8192,32768",
                   help="comma-separated sequence lengths L")
    p.add_argument("--requests", default="64,256", help="comma-separated request counts R")
    p.add_argument("--steps", type=int, default=24, help="timed decode steps per size")
    p.add_argument("--json", type=pathlib.Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = pathlib.Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
        for tokens in (int(t) for t in args.tokens.split(",")):
            for requests in (int(r) for r in args.requests.split(",")):
                row = measure(model_dir, requests, tokens, args.steps)
                row.update(tokens=tokens, requests=requests)
                rows.append(row)
                print(f"measured L={tokens} R={requests}", file=sys.stderr, flush=True)
    print("| L tokens | R | logical / live blocks per request | vLLM schedule+update "
          "us/step | ours us/step | ours, full reads us/step | ours / vLLM | "
          "full reads / vLLM | full reads / ours |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        v, new, old = r["vllm"], r["ours"], r["ours, full reads"]
        print(f"| {r['tokens']} | {r['requests']} | {r['logical_blocks']:.0f} / "
              f"{r['live_blocks']:.0f} | {v:.0f} | {new:.0f} | {old:.0f} | "
              f"{new / v:.2f} | {old / v:.2f} | {old / new:.1f}x |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
