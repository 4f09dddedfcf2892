"""The plan: one replica's blocks and its concurrency with and without eviction
(:func:`make_plan`), and the text ``nexus-vllm plan`` prints (:func:`format_plan`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from nexus_vllm.core import ConfigError, EvictionConfig, cdiv

from .burst import simulate_burst, stock_admission_blocks, stock_bound_blocks
from .memory import GIB, kv_pool_blocks
from .shape import DTYPE_BYTES, ModelShape

__all__ = ["Plan", "format_plan", "make_plan"]


@dataclass(frozen=True)
class Plan:
    """Inputs and results of one ``nexus-vllm plan`` (``--json`` prints :meth:`to_dict`)."""

    inputs: dict[str, Any]
    model: dict[str, Any]
    memory: dict[str, Any] | None
    pool_blocks: int
    usable_blocks: int
    prompt_tokens: int
    output_tokens: int
    eviction: dict[str, Any]
    stock: dict[str, Any]
    evicting: dict[str, Any]
    ratio: float | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_plan(model: ModelShape, cfg: EvictionConfig, *, pool_blocks: int | None,
              gpu_memory_gib: float | None, gpu_util: float, overhead_gib: float, tp: int,
              pp: int, context: int, prompt_tokens: int, output_tokens: int,
              max_num_seqs: int, max_num_batched_tokens: int | None,
              inputs: dict[str, Any] | None = None) -> Plan:
    """Blocks and concurrency for one replica (``tp x pp`` GPUs).

    ``pool_blocks`` (vLLM's ``--num-gpu-blocks-override``) skips the memory arithmetic;
    otherwise ``gpu_memory_gib`` is needed.
    """
    bs = cfg.block_size
    memory = None
    if pool_blocks is None:
        if gpu_memory_gib is None:
            raise ConfigError("gpu_memory_gib", "give --gpu-memory-gib or --pool-blocks")
        memory = kv_pool_blocks(model, gpu_memory_gib=gpu_memory_gib, gpu_util=gpu_util,
                                overhead_gib=overhead_gib, tp=tp, pp=pp, block_size=bs)
        pool_blocks = int(memory["pool_blocks"])
    usable = max(0, pool_blocks - 1)  # block 0 is vLLM's null block
    total = prompt_tokens + output_tokens
    notes = []
    if usable < cdiv(context, bs):
        notes.append(f"vLLM will not start: one --max-model-len {context} request needs "
                     f"{cdiv(context, bs)} blocks, the pool has {usable}")
    sim: dict[str, Any] = {
        "usable_blocks": usable, "block_size": bs, "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens, "requests": max_num_seqs,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
    stock_bound = stock_bound_blocks(total, bs)
    stock_run = simulate_burst(None, **sim)
    stock_guaranteed = min(usable // stock_bound, max_num_seqs)
    stock = {"admission_blocks": stock_admission_blocks(prompt_tokens, bs),
             "bound_blocks": stock_bound, "peak_running": stock_run.peak_running,
             "preempts": stock_run.preempted, "guaranteed": stock_guaranteed,
             # Preemption-free: the burst's peak, or if it preempts, what fits whole.
             "concurrent": stock_guaranteed if stock_run.preempted else stock_run.peak_running}
    bound = cfg.bound_blocks(prompt_tokens, total)
    decode_peak = cfg.decode_peak_blocks(prompt_tokens, total)
    evict_run = simulate_burst(cfg, **sim)
    evicting = {"bound_blocks": bound, "decode_hard_limit_blocks": decode_peak,
                "concurrent": evict_run.peak_running,
                "guaranteed": min(usable // bound, max_num_seqs),
                "ceiling": min(usable // decode_peak, max_num_seqs)}
    if evict_run.peak_running >= max_num_seqs:
        notes.append(f"--max-num-seqs {max_num_seqs} caps the requests with eviction")
    ratio = evicting["concurrent"] / stock["concurrent"] if stock["concurrent"] else None
    eviction = {"method": cfg.method, "max_tokens": cfg.max_tokens,
                "keep_ratio": cfg.keep_ratio, "prompt_mode": cfg.prompt_mode,
                "prefill_budget": cfg.prefill_budget, "chunk_size": cfg.chunk_size,
                "block_size": bs, "budget_blocks": cfg.budget_blocks(total)}
    return Plan(inputs=inputs or {}, model=asdict(model), memory=memory,
                pool_blocks=pool_blocks, usable_blocks=usable, prompt_tokens=prompt_tokens,
                output_tokens=output_tokens, eviction=eviction, stock=stock,
                evicting=evicting, ratio=ratio, notes=notes)


def format_plan(plan: Plan) -> str:
    """The plan as the text ``nexus-vllm plan`` prints."""
    m, i, e, s, v = plan.model, plan.inputs, plan.eviction, plan.stock, plan.evicting
    tp, pp = i.get("tp", 1), i.get("pp", 1)
    lines = [f"model {m['name']}: {m['layers']} layers, {m['kv_heads']} KV heads x "
             f"{m['head_size']}, {m['dtype']}; weights {m['weight_bytes'] / 1e9:.2f} GB "
             f"({m['weight_source']})"]
    if plan.memory is not None:
        mem = plan.memory
        lines += [
            f"per GPU (tp={tp}, pp={pp}): {i['gpu_memory_gib']} GiB x {i['gpu_util']} - "
            f"weights {mem['weight_bytes_per_gpu'] / GIB:.2f} GiB - overhead "
            f"{mem['overhead_bytes'] / GIB:.2f} GiB = {mem['kv_bytes_per_gpu'] / GIB:.2f} GiB "
            "for KV",
            f"bytes per block per GPU: 2 x {cdiv(m['layers'], pp)} layers x "
            f"{cdiv(m['kv_heads'], tp)} KV heads x {m['head_size']} x "
            f"{DTYPE_BYTES[m['dtype']]} B x {e['block_size']} tokens = "
            f"{mem['block_bytes_per_gpu'] / 2**20:.3f} MiB"]
    lines += [
        f"KV blocks per GPU: {plan.pool_blocks} ({plan.usable_blocks} usable, "
        f"{plan.usable_blocks * e['block_size']} tokens)",
        f"requests: {plan.prompt_tokens} prompt + {plan.output_tokens} output tokens",
        f"eviction: {e['method']}, budget "
        + (f"{e['max_tokens']} tokens" if e["max_tokens"] is not None
           else f"{e['keep_ratio']} of the tokens seen")
        + f", prompt_mode {e['prompt_mode']}"
        + (f", prefill_budget {e['prefill_budget']}" if e["prefill_budget"] else "")
        + f", chunk {e['chunk_size']}: bound {v['bound_blocks']} blocks per request, "
          f"decode hard limit {v['decode_hard_limit_blocks']}",
        f"concurrent requests (a burst of {i.get('max_num_seqs')} at once, the server's "
        "admission step by step):",
        f"  without eviction (stock vLLM): {s['concurrent']}"
        + (" (the burst preempts; this many fit whole)" if s["preempts"] else ""),
        f"  with eviction:                 {v['concurrent']}",
        "  ratio:                         "
        + (f"{plan.ratio:.2f}x" if plan.ratio is not None else "- (stock fits none)"),
        f"  ceiling (all at the decode hard limit, budget + one decode interval): "
        f"{v['ceiling']}",
        f"  guaranteed (all at their bound at once): {v['guaranteed']}",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)

