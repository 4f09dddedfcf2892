"""The sizing: one replica's blocks and its concurrency with and without eviction
(:func:`size_replica`), and the text ``nexus-vllm size`` prints (:func:`format_sizing`).

A hybrid sliding-window model is sized group by group (:mod:`.groups`): the pool by the
largest group's layers per block, and each request by its blocks in every group (the
full-attention group's by the eviction rules, each sliding group's by its window).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TypedDict

from nexus_vllm.core import ConfigError, EvictionConfig, cdiv
from nexus_vllm.core.budget import (
    bound_blocks,
    budget_blocks,
    decode_peak_blocks,
    evicts_mid_prompt,
    window_in_flight_tokens,
)

from .burst import simulate_burst, stock_admission_blocks, stock_bound_blocks, window_allowance
from .groups import KVGroup, eviction_refusal, kv_cache_groups, window_max_blocks
from .memory import GIB, PoolMemory, kv_pool_blocks
from .shape import DTYPE_BYTES, ModelShape

__all__ = ["HYBRID_STEP_TOKENS", "BurstArgs", "EvictingColumn", "EvictionSummary", "GroupRow",
           "Sizing", "SizingInputs", "StockColumn", "format_sizing", "size_replica"]

# vLLM 0.32's --max-num-batched-tokens for its API server on H100/H200: a step in flight
# that a sliding-window group holds beyond its window, when the flag is not given.
HYBRID_STEP_TOKENS = 8192


class SizingInputs(TypedDict, total=False):
    """The flags a sizing was made with (``nexus-vllm size``'s, but ``--json``)."""

    model: str
    gpu_memory_gib: float | None
    gpu_util: float
    overhead_gib: float
    tp: int
    pp: int
    block_size: int
    pool_blocks: int | None
    context: int
    prompt_tokens: int | None
    output_tokens: int | None
    budget: float | int
    method: str
    prompt_mode: str
    prefill_budget: int | None
    chunk_size: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    steps_in_flight: int | None


class BurstArgs(TypedDict):
    """The burst a sizing simulates: :func:`simulate_burst`'s keyword arguments."""

    usable_blocks: int
    block_size: int
    prompt_tokens: int
    output_tokens: int
    requests: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    full_groups: int
    windows: list[int]
    steps_in_flight: int
    in_flight_tokens: int
    max_model_len: int


class StockColumn(TypedDict):
    """Stock vLLM's blocks per request and concurrency."""

    admission_blocks: int
    bound_blocks: int
    peak_running: int
    preempts: bool
    guaranteed: int
    concurrent: int


class EvictingColumn(TypedDict):
    """The evicting server's blocks per request and concurrency."""

    bound_blocks: int
    decode_hard_limit_blocks: int
    concurrent: int
    guaranteed: int
    ceiling: int


class EvictionSummary(TypedDict):
    """The eviction config a sizing is for."""

    method: str
    max_tokens: int | None
    keep_ratio: float | None
    prompt_mode: str
    prefill_budget: int | None
    chunk_size: int
    block_size: int
    budget_blocks: int


class _GroupBlocks(TypedDict):
    kind: str  # "full_attention" or "sliding_window"
    window: int | None
    layers: list[int]
    evicted: bool
    stock_admission_blocks: int
    stock_blocks: int
    evicting_bound_blocks: int
    evicting_decode_hard_limit_blocks: int


class GroupRow(_GroupBlocks, total=False):
    """One KV cache group's blocks per request; the steps in flight a sliding group's
    count (absent for the full-attention group)."""

    step_tokens: int
    steps_in_flight: int
    in_flight_tokens: int
    evicting_prompt_step_tokens: int
    evicting_in_flight_tokens: int


@dataclass(frozen=True)
class Sizing:
    """Inputs and results of one ``nexus-vllm size`` (``--json`` prints :meth:`to_dict`)."""

    inputs: SizingInputs
    model: ModelShape
    memory: PoolMemory | None
    pool_blocks: int
    usable_blocks: int
    prompt_tokens: int
    output_tokens: int
    eviction: EvictionSummary
    stock: StockColumn
    evicting: EvictingColumn
    ratio: float | None
    notes: list[str] = field(default_factory=list)
    kv_cache_groups: list[GroupRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _notes(model: ModelShape, cfg: EvictionConfig, hybrid: bool,
           max_num_batched_tokens: int | None) -> tuple[list[str], int | None]:
    """The sizing's notes on ``model`` (MLA; a hybrid model's step budget) and the step
    budget it runs with (a hybrid model's default: :data:`HYBRID_STEP_TOKENS`)."""
    notes = []
    if model.mla:
        notes.append(
            "MLA: vLLM's CPU platform turns chunked prefill (and prefix caching) off for "
            "MLA (CPU_MLA backend), so there each prompt is computed whole and the server "
            "refuses prompt_mode stream and a prefill budget (use end or keep); on GPU the "
            "server refuses eviction on MLA for now (vLLM's CUDA MLA backends are not "
            "wrapped yet): the eviction column is what the rules give once they are"
            + (". This sizing's prompt mode evicts during the prompt: refused on CPU"
               if evicts_mid_prompt(cfg) else ""))
    if hybrid and max_num_batched_tokens is None:
        max_num_batched_tokens = HYBRID_STEP_TOKENS
        notes.append(f"--max-num-batched-tokens {HYBRID_STEP_TOKENS} (vLLM's on H100/H200), as "
                     "a sliding-window group holds the steps in flight beyond its window "
                     "while the prompt is computed; the budget also paces the burst's "
                     "prefills")
    return notes, max_num_batched_tokens


def _window_reserve(cfg: EvictionConfig, sim: BurstArgs, step: int, of: list[int],
                    tokens: int | None = None) -> int:
    """The window groups ``of`` as the plugin's admission reserves them for a request of
    the burst ``sim`` that has seen ``tokens`` (None: a new one): k steps in flight while
    the prompt is computed (each at most a chunk where the prompt mode evicts
    mid-prompt), k decode tokens once it decodes (:func:`window_allowance`)."""
    prompt_tokens = sim["prompt_tokens"]
    return window_allowance(prompt_tokens + sim["output_tokens"], sim["block_size"], of,
                            step, sim["steps_in_flight"], tokens=tokens or 0,
                            prefill_end=None if tokens is None else prompt_tokens, cfg=cfg)


def _stock(sim: BurstArgs, step: int) -> StockColumn:
    """Stock vLLM's column for the burst ``sim`` (:func:`simulate_burst`'s arguments),
    ``step`` tokens a step."""
    bs, prompt_tokens = sim["block_size"], sim["prompt_tokens"]
    total = prompt_tokens + sim["output_tokens"]
    full_groups, windows, k = sim["full_groups"], sim["windows"], sim["steps_in_flight"]
    stock_bound = stock_bound_blocks(total, bs, full_groups=full_groups, windows=windows,
                                     step_tokens=step, steps_in_flight=k)
    stock_run = simulate_burst(None, **sim)
    stock_guaranteed = min(sim["usable_blocks"] // stock_bound, sim["max_num_seqs"])
    return {"admission_blocks": stock_admission_blocks(
                prompt_tokens, bs, full_groups=full_groups, windows=windows,
                in_flight_tokens=sim["in_flight_tokens"], max_model_len=sim["max_model_len"]),
            "bound_blocks": stock_bound, "peak_running": stock_run.peak_running,
            "preempts": stock_run.preempted, "guaranteed": stock_guaranteed,
            # Preemption-free: the burst's peak, or if it preempts, what fits whole.
            "concurrent": stock_guaranteed if stock_run.preempted else stock_run.peak_running}


def _group_row(g: KVGroup, cfg: EvictionConfig, sim: BurstArgs, step: int,
               allowance: Callable[..., int], prompt_step: int) -> GroupRow:
    """One KV-cache group's row: its blocks per request, stock and evicting, for the burst
    ``sim``; ``allowance`` the window groups' evicting reserve."""
    bs, prompt_tokens, k = sim["block_size"], sim["prompt_tokens"], sim["steps_in_flight"]
    total, in_flight = prompt_tokens + sim["output_tokens"], sim["in_flight_tokens"]
    if g.window is None:
        return {"kind": "full_attention", "window": None, "layers": list(g.layers),
                "evicted": True, "stock_admission_blocks": cdiv(prompt_tokens, bs),
                "stock_blocks": cdiv(total, bs),
                "evicting_bound_blocks": bound_blocks(cfg, prompt_tokens, total),
                "evicting_decode_hard_limit_blocks":
                    decode_peak_blocks(cfg, prompt_tokens, total)}
    return {"kind": "sliding_window", "window": g.window, "layers": list(g.layers),
            "evicted": False, "stock_admission_blocks": stock_admission_blocks(
                prompt_tokens, bs, full_groups=0, windows=[g.window],
                in_flight_tokens=in_flight, max_model_len=sim["max_model_len"]),
            "stock_blocks": window_allowance(total, bs, [g.window], step, k),
            "evicting_bound_blocks": allowance([g.window]),
            "evicting_decode_hard_limit_blocks": allowance([g.window], prompt_tokens + k),
            "step_tokens": step, "steps_in_flight": k, "in_flight_tokens": in_flight,
            "evicting_prompt_step_tokens": prompt_step,
            "evicting_in_flight_tokens": k * prompt_step}


def size_replica(model: ModelShape, cfg: EvictionConfig, *, pool_blocks: int | None,
              gpu_memory_gib: float | None, gpu_util: float, overhead_gib: float, tp: int,
              pp: int, context: int, prompt_tokens: int, output_tokens: int,
              max_num_seqs: int, max_num_batched_tokens: int | None,
              inputs: SizingInputs | None = None,
              steps_in_flight: int | None = None) -> Sizing:
    """Blocks and concurrency for one replica (``tp x pp`` GPUs).

    ``pool_blocks`` (vLLM's ``--num-gpu-blocks-override``) skips the memory arithmetic;
    otherwise ``gpu_memory_gib`` is needed. A model with sliding-window groups computes
    ``max_num_batched_tokens`` (None: :data:`HYBRID_STEP_TOKENS`) tokens a step, and vLLM
    keeps ``steps_in_flight`` (None: ``pp + 1``, vLLM 0.32's on GPU: async scheduling
    with model runner V2) steps in flight, whose tokens a sliding-window group holds
    beyond its window, stock and with eviction.

    Raises
    ------
    ConfigError
        Naming ``model`` when the plugin refuses to evict on it
        (:func:`.groups.eviction_refusal`); naming ``gpu_memory_gib`` when neither it
        nor ``pool_blocks`` is given.
    """
    refusal = eviction_refusal(model)
    if refusal is not None:
        raise ConfigError("model", refusal)
    bs = cfg.block_size
    groups = kv_cache_groups(model)
    windows = [g.window for g in groups if g.window is not None]
    full_groups = len(groups) - len(windows)
    notes, max_num_batched_tokens = _notes(model, cfg, bool(windows), max_num_batched_tokens)
    step = max_num_batched_tokens or prompt_tokens
    k = pp + 1 if steps_in_flight is None else steps_in_flight
    in_flight = k * step
    memory = None
    if pool_blocks is None:
        if gpu_memory_gib is None:
            raise ConfigError("gpu_memory_gib", "give --gpu-memory-gib or --pool-blocks")
        memory = kv_pool_blocks(model, gpu_memory_gib=gpu_memory_gib, gpu_util=gpu_util,
                                overhead_gib=overhead_gib, tp=tp, pp=pp, block_size=bs)
        pool_blocks = int(memory["pool_blocks"])
    usable = max(0, pool_blocks - 1)  # block 0 is vLLM's null block
    total = prompt_tokens + output_tokens
    # vLLM's start-up check (get_kv_cache_configs): one --max-model-len request, every
    # group at its most (a sliding group: its window plus the tokens in flight).
    if usable < (one := full_groups * cdiv(context, bs) + sum(
            window_max_blocks(w, bs, in_flight, context) for w in windows)):
        notes.append(f"vLLM will not start: one --max-model-len {context} request needs "
                     f"{one} blocks, the pool has {usable}")
    sim: BurstArgs = {
        "usable_blocks": usable, "block_size": bs, "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens, "requests": max_num_seqs,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "full_groups": full_groups, "windows": windows, "steps_in_flight": k,
        "in_flight_tokens": in_flight, "max_model_len": context}
    stock = _stock(sim, step)
    allowance = functools.partial(_window_reserve, cfg, sim, step)
    prompt_step = window_in_flight_tokens(step, k, server_cfg=cfg) // k
    bound = bound_blocks(cfg, prompt_tokens, total) + allowance(windows)
    # From prompt + k tokens on, a request's reserve is its decode's.
    decode_peak = decode_peak_blocks(cfg, prompt_tokens, total) \
        + allowance(windows, prompt_tokens + k)
    evict_run = simulate_burst(cfg, **sim)
    evicting: EvictingColumn = {"bound_blocks": bound, "decode_hard_limit_blocks": decode_peak,
                "concurrent": evict_run.peak_running,
                "guaranteed": min(usable // bound, max_num_seqs),
                "ceiling": min(usable // decode_peak, max_num_seqs)}
    if evict_run.peak_running >= max_num_seqs:
        notes.append(f"--max-num-seqs {max_num_seqs} caps the requests with eviction")
    ratio = evicting["concurrent"] / stock["concurrent"] if stock["concurrent"] else None
    eviction: EvictionSummary = {"method": cfg.method, "max_tokens": cfg.max_tokens,
                "keep_ratio": cfg.keep_ratio, "prompt_mode": cfg.prompt_mode,
                "prefill_budget": cfg.prefill_budget, "chunk_size": cfg.chunk_size,
                "block_size": bs, "budget_blocks": budget_blocks(cfg, total)}
    return Sizing(inputs=inputs or {}, model=model, memory=memory,
                pool_blocks=pool_blocks, usable_blocks=usable, prompt_tokens=prompt_tokens,
                output_tokens=output_tokens, eviction=eviction, stock=stock,
                evicting=evicting, ratio=ratio, notes=notes, kv_cache_groups=[
                    _group_row(g, cfg, sim, step, allowance, prompt_step) for g in groups])


def format_sizing(sizing: Sizing) -> str:
    """The sizing as the text ``nexus-vllm size`` prints."""
    m, i, e, s, v = sizing.model, sizing.inputs, sizing.eviction, sizing.stock, sizing.evicting
    tp, pp = i.get("tp", 1), i.get("pp", 1)
    attention = (f"MLA, one latent row of {m.head_size} per token per layer (K only)"
                 if m.mla else f"{m.kv_heads} KV heads x {m.head_size}")
    lines = [f"model {m.name}: {m.layers} layers, {attention}, {m.dtype}; weights "
             f"{m.weight_bytes / 1e9:.2f} GB ({m.weight_source})"]
    if sizing.memory is not None:
        mem = sizing.memory
        per_token = (f"{m.head_size} (the latent row, whole on every TP rank)" if m.mla
                     else f"{cdiv(m.kv_heads, tp)} KV heads x {m.head_size}")
        lines += [
            f"per GPU (tp={tp}, pp={pp}): {i['gpu_memory_gib']} GiB x {i['gpu_util']} - "
            f"weights {mem['weight_bytes_per_gpu'] / GIB:.2f} GiB - overhead "
            f"{mem['overhead_bytes'] / GIB:.2f} GiB = {mem['kv_bytes_per_gpu'] / GIB:.2f} GiB "
            "for KV",
            "bytes per block per GPU: " + ("" if m.mla else "2 x ")
            + f"{mem['layers_per_block']} layers"
            + (" (the largest KV cache group's)" if len(sizing.kv_cache_groups) > 1
               else "") + f" x {per_token} x "
            f"{DTYPE_BYTES[m.dtype]} B x {e['block_size']} tokens = "
            f"{mem['block_bytes_per_gpu'] / 2**20:.3f} MiB"]
    lines += [
        f"KV blocks per GPU: {sizing.pool_blocks} ({sizing.usable_blocks} usable, "
        + (f"{sizing.usable_blocks * e['block_size']} tokens)"
           if len(sizing.kv_cache_groups) <= 1 else
           f"one pool for its {len(sizing.kv_cache_groups)} KV cache groups: a block holds "
           f"{e['block_size']} tokens of one group's layers)"),
        *_group_lines(sizing),
        f"requests: {sizing.prompt_tokens} prompt + {sizing.output_tokens} output tokens",
        f"eviction: {e['method']}, budget "
        + (f"{e['max_tokens']} tokens" if e["max_tokens"] is not None
           else f"{e['keep_ratio']} of the tokens seen")
        + f", prompt_mode {e['prompt_mode']}"
        + (f", prefill_budget {e['prefill_budget']}" if e["prefill_budget"] else "")
        + f", chunk {e['chunk_size']}: bound {v['bound_blocks']} blocks per request, "
          f"decode hard limit {v['decode_hard_limit_blocks']}"
        + (" (all groups)" if len(sizing.kv_cache_groups) > 1 else ""),
        f"concurrent requests (a burst of {i.get('max_num_seqs')} at once, the server's "
        "admission step by step):",
        f"  without eviction (stock vLLM): {s['concurrent']}"
        + (" (the burst preempts; this many fit whole)" if s["preempts"] else ""),
        f"  with eviction:                 {v['concurrent']}",
        "  ratio:                         "
        + (f"{sizing.ratio:.2f}x" if sizing.ratio is not None else "- (stock fits none)"),
        f"  ceiling (all at the decode hard limit, budget + one decode interval): "
        f"{v['ceiling']}",
        f"  guaranteed (all at their bound at once): {v['guaranteed']}",
    ]
    lines += [f"note: {n}" for n in sizing.notes]
    return "\n".join(lines)


def _group_lines(sizing: Sizing) -> list[str]:
    """The KV cache groups and a request's blocks in each (nothing for one group)."""
    groups = sizing.kv_cache_groups
    if len(groups) <= 1:
        return []
    full = [g for g in groups if not g["window"]]
    sliding = [g for g in groups if g["window"]]
    f, w = full[0], sliding[0]
    counts = ", ".join(str(len(g["layers"])) for g in sliding)
    return [
        f"KV cache groups (vLLM's hybrid KV cache manager): {len(groups)}, sharing the "
        f"pool: {len(full)} full attention ({len(f['layers'])} layers, evicted), "
        f"{len(sliding)} sliding window {w['window']} tokens ({counts} layers, left to "
        "vLLM)",
        f"blocks per request: full-attention group: stock {f['stock_admission_blocks']} "
        f"at admission, {f['stock_blocks']} at the end; with eviction bound "
        f"{f['evicting_bound_blocks']}, decode hard limit "
        f"{f['evicting_decode_hard_limit_blocks']}",
        f"                    each sliding group: stock {w['stock_blocks']} while the "
        f"prompt is computed (its window plus the {w['in_flight_tokens']} tokens in flight: "
        f"{w['steps_in_flight']} steps of {w['step_tokens']}), admission reserves "
        f"{w['stock_admission_blocks']}; with eviction {w['evicting_bound_blocks']} "
        f"while the prompt is computed (its window plus {w['steps_in_flight']} steps of "
        f"{w['evicting_prompt_step_tokens']}"
        + (", the chunk each request's prompt step is capped at"
           if w["evicting_prompt_step_tokens"] < w["step_tokens"] else "")
        + f"), {w['evicting_decode_hard_limit_blocks']} reserved once decoding (its window "
        f"plus {w['steps_in_flight']} decode tokens)",
    ]
