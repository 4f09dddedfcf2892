"""``nexus-vllm plan``: size a deployment before starting it.

From a model's shape and the GPUs, how many KV blocks each GPU holds, and how many
requests of a given length run at once on stock vLLM and with eviction::

    nexus-vllm plan --model llama-3.1-8b --gpu-memory-gib 141 --context 32768 --budget 0.2

**Blocks per GPU** follow vLLM's rule: the memory vLLM may use (``gpu_memory x
gpu_util``) less this GPU's share of the weights (``weights / (tp x pp)``) less an
allowance for activations, CUDA graphs and non-torch memory (``--overhead-gib``, 4 GiB by
default: vLLM profiles it at start-up; for an 8k-token step on 8B-72B models it is a few
GiB), divided by the bytes of one block on one GPU::

    2 (K and V) x ceil(layers / pp) x ceil(kv_heads / tp) x head_size x dtype_bytes x block_size

(KV heads are replicated when ``tp > kv_heads``; the largest pipeline stage sets the
count). ``--pool-blocks N`` skips this and takes vLLM's ``--num-gpu-blocks-override``.
vLLM keeps block 0 as its null block, so ``N - 1`` blocks hold requests.

**Concurrent requests** come from the rules the server runs, not a formula of their
own: :meth:`EvictionConfig.bound_blocks` (what admission reserves for a new request) and
:meth:`EvictionConfig.peak_from` (what an admitted one may still grow to), applied step by
step as the plugin's admission (``integration/scheduler/manager.py``, ``may_admit``) applies them
to a burst of identical requests arriving at once (the capacity benchmark's workload).
The reserve of a running request shrinks as it progresses: an ``end`` request past its
prompt keeps only its decode hard limit, so a burst runs more of them than
``pool // bound``. Stock vLLM 0.32 admits a request when its whole prompt fits in the
free blocks (``scheduler_reserve_full_isl``) and keeps no other reserve (its
``--watermark`` defaults to 0, and so does this plan); it preempts when decode runs out
of blocks. Each request prefills at most ``chunk_size`` tokens a step when its prompt
mode evicts during the prompt (the plugin sets vLLM's ``long_prefill_token_threshold``)
and at most the step's token budget (``--max-num-batched-tokens``) otherwise, as on stock
vLLM; decode adds one token a step.

Only the standard library, ``nexus_vllm.core`` and the budget parser are imported: no
vLLM, so a laptop can plan a GPU deployment.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from nexus_vllm.argtypes import int_at_least
from nexus_vllm.core import ConfigError, EvictionConfig, cdiv
from nexus_vllm.core.admission import admission_room
from nexus_vllm.core.config import PROMPT_MODES
from nexus_vllm.eval.budget import parse_budget

__all__ = ["BUILTIN_MODELS", "ModelShape", "Plan", "SimResult", "kv_pool_blocks", "main",
           "make_plan", "model_shape", "simulate_burst", "split_context",
           "stock_admission_blocks", "stock_bound_blocks"]

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1,
               "float8_e4m3fn": 1, "float8_e5m2": 1}
# The capacity benchmark's request shape (benchmarks/serving/capacity.py defaults): an
# output of 1/64 of the prompt (2048 + 32), and --max-model-len one block past them.
OUTPUT_PER_PROMPT = 64

# Published config.json fields; weights are computed from them (:func:`param_count`):
# 8.03e9, 70.55e9 and 72.71e9 parameters at 2 bytes.
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {"num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
                     "intermediate_size": 14336, "vocab_size": 128256,
                     "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                     "model_type": "llama"},
    "llama-3.1-70b": {"num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "hidden_size": 8192, "head_dim": 128,
                      "intermediate_size": 28672, "vocab_size": 128256,
                      "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                      "model_type": "llama"},
    "qwen2.5-72b": {"num_hidden_layers": 80, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "hidden_size": 8192,
                    "intermediate_size": 29568, "vocab_size": 152064,
                    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                    "model_type": "qwen2"},
}


# -- the model ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What sizing needs of a model.

    Parameters
    ----------
    name : str
        Built-in name or the config's path.
    layers, attention_heads, kv_heads, head_size : int
        Attention shape (``kv_heads`` < ``attention_heads`` with GQA).
    dtype : str
        KV and weight dtype (a key of ``DTYPE_BYTES``).
    weight_bytes : int
        Bytes of all the weights.
    weight_source : str
        Where ``weight_bytes`` comes from (the safetensors index, or estimated from the
        parameter count the config implies).
    """

    name: str
    layers: int
    attention_heads: int
    kv_heads: int
    head_size: int
    dtype: str
    weight_bytes: int
    weight_source: str

    def __post_init__(self) -> None:
        for name in ("layers", "attention_heads", "kv_heads", "head_size", "weight_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(name, f"{name} must be a positive int; got "
                                        f"{getattr(self, name)!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError("dtype", f"dtype must be one of {sorted(DTYPE_BYTES)}; got "
                                       f"{self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


def param_count(config: dict[str, Any]) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its config: embeddings, per layer
    Q/K/V/O (with Q/K/V biases for ``qwen2``), a gated MLP and two norms, the final norm,
    and an LM head unless tied."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    bias = config.get("attention_bias", config.get("model_type") == "qwen2")
    attn = hidden * heads * head * 2 + hidden * kv_heads * head * 2
    if bias:
        attn += heads * head + 2 * kv_heads * head
    layer = attn + 3 * hidden * inter + 2 * hidden
    head_params = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + int(config["num_hidden_layers"]) * layer + hidden + head_params


def _shape_from_config(name: str, config: dict[str, Any],
                       index: dict[str, Any] | None) -> ModelShape:
    heads = int(config["num_attention_heads"])
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    dtype = dtype.removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ConfigError("dtype", f"torch_dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    total = (index or {}).get("metadata", {}).get("total_size")
    if total:
        weight_bytes, source = int(total), "model.safetensors.index.json metadata.total_size"
    else:
        params = param_count(config)
        weight_bytes = params * DTYPE_BYTES[dtype]
        source = f"estimated: {params / 1e9:.2f}e9 parameters from the config x {dtype}"
    return ModelShape(
        name=name, layers=int(config["num_hidden_layers"]), attention_heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_size=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        dtype=dtype, weight_bytes=weight_bytes, weight_source=source)


BUILTIN_MODELS: dict[str, ModelShape] = {
    name: _shape_from_config(name, cfg, None) for name, cfg in BUILTIN_CONFIGS.items()}


def model_shape(spec: str) -> ModelShape:
    """A built-in name, or an HF ``config.json`` (the file or its directory; the
    directory's ``model.safetensors.index.json`` gives the weight bytes when present).

    Raises
    ------
    ConfigError
        Naming ``model`` when ``spec`` is neither, or the config lacks a field.
    """
    if spec.lower() in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec.lower()]
    path = pathlib.Path(spec)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ConfigError("model", f"{spec!r} is neither a built-in model "
                                   f"({', '.join(BUILTIN_MODELS)}) nor a config.json or a "
                                   "directory holding one")
    try:
        config = json.loads(config_path.read_text())
        index_path = config_path.parent / "model.safetensors.index.json"
        index = json.loads(index_path.read_text()) if index_path.is_file() else None
        return _shape_from_config(str(spec), config, index)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ConfigError("model", f"{config_path}: {what}") from None


# -- blocks ------------------------------------------------------------------------------
def block_bytes_per_gpu(model: ModelShape, *, tp: int, pp: int, block_size: int) -> int:
    """Bytes one KV block takes on one GPU: ``2 x ceil(layers / pp) x ceil(kv_heads / tp)
    x head_size x dtype_bytes x block_size``."""
    return (2 * cdiv(model.layers, pp) * cdiv(model.kv_heads, tp) * model.head_size
            * model.dtype_bytes * block_size)


def kv_pool_blocks(model: ModelShape, *, gpu_memory_gib: float, gpu_util: float,
                   overhead_gib: float, tp: int, pp: int, block_size: int) -> dict[str, Any]:
    """vLLM's block count per GPU (the pool of one replica), with the arithmetic."""
    budget = gpu_memory_gib * GIB * gpu_util
    weights = model.weight_bytes / (tp * pp)
    kv_bytes = budget - weights - overhead_gib * GIB
    per_block = block_bytes_per_gpu(model, tp=tp, pp=pp, block_size=block_size)
    return {"usable_memory_bytes": budget, "weight_bytes_per_gpu": weights,
            "overhead_bytes": overhead_gib * GIB, "kv_bytes_per_gpu": kv_bytes,
            "block_bytes_per_gpu": per_block,
            "pool_blocks": max(0, math.floor(kv_bytes / per_block))}


def stock_admission_blocks(prompt_tokens: int, block_size: int) -> int:
    """Free blocks stock vLLM 0.32 needs to admit a request: its whole prompt
    (``scheduler_reserve_full_isl``, on by default)."""
    return cdiv(prompt_tokens, block_size)


def stock_bound_blocks(total_tokens: int, block_size: int) -> int:
    """Blocks a stock vLLM request holds at its end: its whole sequence."""
    return cdiv(total_tokens, block_size)


def split_context(context: int, block_size: int) -> tuple[int, int]:
    """``(prompt, output)`` tokens filling ``context`` (vLLM's ``--max-model-len``) as the
    capacity benchmark does: prompt + output + one block = context, output = prompt / 64
    (rounded down; 2048 + 32 for its 2112)."""
    tokens = context - block_size
    output = max(1, tokens // (OUTPUT_PER_PROMPT + 1))
    return tokens - output, output


# -- the server's admission, step by step --------------------------------------------------
@dataclass
class _Request:
    computed: int = 0      # tokens whose KV is computed
    outputs: int = 0       # tokens sampled
    blocks: int = 0        # blocks held (stock only: evicting requests hold <= reserve)
    tokens_seen: int = 0   # the plugin's st.tokens: computed tokens as of the last plan


@dataclass(frozen=True)
class SimResult:
    """The outcome of :func:`simulate_burst`.

    Attributes
    ----------
    peak_running : int
        Most requests running at once.
    preempted : bool
        Whether a running request ran out of blocks (stock vLLM only; admission by the
        bound never lets an evicting request run out).
    steps : int
        Engine steps simulated.
    """

    peak_running: int
    preempted: bool
    steps: int


def simulate_burst(cfg: EvictionConfig | None, *, usable_blocks: int, block_size: int,
                   prompt_tokens: int, output_tokens: int, requests: int, max_num_seqs: int,
                   max_num_batched_tokens: int | None = None) -> SimResult:
    """``requests`` identical requests arrive at once; run the scheduler's admission until
    no request waits (stock vLLM: until all finish, since it may preempt later).

    Each step, as vLLM 0.32's scheduler with the plugin: running requests first (a prompt
    chunk, or one decode token), then waiting ones in arrival order while the token
    budget and ``max_num_seqs`` allow, stopping at the first one refused. Evicting
    (``cfg`` given): admitted only if the usable blocks, less each running request's
    :meth:`EvictionConfig.peak_from` its progress, cover :meth:`EvictionConfig.bound_blocks`
    (``EvictionManager.may_admit``). Stock (``cfg`` None): admitted only if the free
    blocks cover its whole prompt; a running request that finds no free block is a
    preemption. ``max_num_batched_tokens`` None: no token budget a step (the pool alone
    limits).
    """
    total = prompt_tokens + output_tokens
    # The plugin caps a request's prompt chunk where events fire mid-prompt; otherwise
    # vLLM's step budget alone does (engine_policy.forced_engine_args).
    chunk = cfg.chunk_size if cfg is not None and cfg.evicts_mid_prompt else prompt_tokens
    bound = (cfg.bound_blocks(prompt_tokens, total) if cfg is not None
             else stock_admission_blocks(prompt_tokens, block_size))
    waiting: deque[_Request] = deque(_Request() for _ in range(requests))
    running: list[_Request] = []
    peak, steps = 0, 0

    def reserve(r: _Request) -> int:
        assert cfg is not None
        return cfg.peak_from(r.tokens_seen, prompt_tokens, total)

    while waiting or running:
        if cfg is not None and not waiting:
            break  # admission never fails a running evicting request: the peak is in
        steps += 1
        budget = max_num_batched_tokens or requests * prompt_tokens  # None: no step limit
        scheduled: list[tuple[_Request, int]] = []
        free = usable_blocks - sum(r.blocks for r in running)
        for r in running:
            if budget <= 0:
                break
            n = min(prompt_tokens - r.computed, chunk, budget) if r.computed < prompt_tokens \
                else 1
            if cfg is None:
                need = cdiv(r.computed + n, block_size) - r.blocks
                if need > free:
                    return SimResult(peak, True, steps)
                free -= need
                r.blocks += need
            budget -= n
            scheduled.append((r, n))
        admitted = False
        while waiting and budget > 0 and len(running) < max_num_seqs:
            # Evicting requests' held blocks are within their reserve: the room is the
            # pool less every reserve (the plugin's rule, core.admission).
            room = admission_room(usable_blocks, ((reserve(r), 0) for r in running)) \
                if cfg is not None else free
            if room < bound:
                break
            r = waiting.popleft()
            n = min(prompt_tokens, chunk, budget)
            if cfg is None:
                r.blocks = cdiv(n, block_size)
                free -= r.blocks
            running.append(r)
            budget -= n
            scheduled.append((r, n))
            admitted = True
        peak = max(peak, len(running))
        if not scheduled:
            break  # nothing runs and the first waiting request can never fit
        pure_decode = not admitted and len(scheduled) == len(running) \
            and all(n == 1 for _, n in scheduled)
        for r, n in scheduled:
            r.computed += n
            r.tokens_seen = r.computed
            if r.computed >= prompt_tokens:
                r.outputs += 1
        running = [r for r in running if r.outputs < output_tokens]
        if pure_decode and running:
            # Pure decode and nobody admitted: nothing changes admission until the next
            # request finishes, so jump there (stock: its growth is checked at the end).
            skip = min(output_tokens - r.outputs for r in running) - 1
            if skip > 0:
                steps += skip
                for r in running:
                    r.computed += skip
                    r.tokens_seen = r.computed
                    r.outputs += skip
                if cfg is None:
                    for r in running:
                        r.blocks = max(r.blocks, cdiv(r.computed, block_size))
                    if sum(r.blocks for r in running) > usable_blocks:
                        return SimResult(peak, True, steps)
    return SimResult(peak, False, steps)


# -- the plan --------------------------------------------------------------------------
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
    hard = cfg.hard_limit(max(total, prompt_tokens + 1), prompt_tokens)
    evict_run = simulate_burst(cfg, **sim)
    evicting = {"bound_blocks": bound, "decode_hard_limit_blocks": min(hard, cdiv(total, bs)),
                "concurrent": evict_run.peak_running,
                "guaranteed": min(usable // bound, max_num_seqs),
                "ceiling": min(usable // min(hard, cdiv(total, bs)), max_num_seqs)}
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


# -- command line ------------------------------------------------------------------------
def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _ratio(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"a fraction in (0, 1], got {text}")
    return value


def _budget(text: str) -> float | int:
    try:
        return parse_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nexus-vllm plan",
        description="KV blocks per GPU and concurrent requests with and without eviction, "
                    "from the server's own admission rules (no vLLM needed).")
    p.add_argument("--model", required=True,
                   help=f"built-in ({', '.join(BUILTIN_MODELS)}) or an HF config.json (or "
                        "its directory)")
    p.add_argument("--gpu-memory-gib", type=_positive_float, default=None,
                   help="memory of one GPU, GiB (or give --pool-blocks)")
    p.add_argument("--gpu-util", type=_ratio, default=0.9,
                   help="vLLM's --gpu-memory-utilization (default 0.9)")
    p.add_argument("--overhead-gib", type=_non_negative_float, default=4.0,
                   help="per GPU, for activations, CUDA graphs and non-torch memory, which "
                        "vLLM profiles at start-up (default 4)")
    p.add_argument("--tp", type=int_at_least(1), default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int_at_least(1), default=1, help="pipeline parallel size")
    p.add_argument("--block-size", type=int_at_least(1), default=16,
                   help="tokens per KV block (default 16, vLLM's on GPU)")
    p.add_argument("--pool-blocks", type=int_at_least(2), default=None,
                   help="vLLM's --num-gpu-blocks-override: skip the memory arithmetic")
    p.add_argument("--context", type=int_at_least(1), required=True,
                   help="--max-model-len, tokens")
    p.add_argument("--prompt-tokens", type=int_at_least(1), default=None,
                   help="prompt per request (default: with --output-tokens, the context "
                        "less one block, split 64:1 as the capacity benchmark does)")
    p.add_argument("--output-tokens", type=int_at_least(1), default=None,
                   help="output per request (default: see --prompt-tokens)")
    p.add_argument("--budget", type=_budget, required=True,
                   help="a keep ratio in (0, 1] like 0.2, or tokens like 4096")
    p.add_argument("--method", default="nexus", help="eviction policy (default nexus)")
    default_mode = EvictionConfig.prompt_mode  # the server's default
    p.add_argument("--prompt-mode", choices=PROMPT_MODES, default=default_mode,
                   help=f"when the budget holds (default {default_mode}, as the server's)")
    p.add_argument("--prefill-budget", type=int_at_least(1), default=None,
                   help="prompt_mode end: tokens kept while the prompt is computed")
    p.add_argument("--chunk-size", type=int_at_least(1), default=512,
                   help="prefill chunk of evicting requests, tokens (default 512)")
    p.add_argument("--max-num-seqs", type=int_at_least(1), default=1024,
                   help="vLLM's cap on running requests (default 1024, vLLM 0.32's on "
                        "H100/H200); the burst has this many requests")
    p.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=None,
                   help="vLLM's token budget per step (default: none, so the KV pool "
                        "alone sets the concurrency; vLLM's on H100/H200 is 8192, and with "
                        "short answers prefill throughput can bind before the pool)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def plan_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Plan:
    """Validate the flags (each error names its flag) and make the plan."""
    try:
        model = model_shape(args.model)
    except ConfigError as exc:
        parser.error(f"--model: {exc}")
    if model.attention_heads % args.tp:
        parser.error(f"--tp {args.tp}: must divide the {model.attention_heads} attention "
                     "heads (vLLM's rule)")
    if args.pool_blocks is None and args.gpu_memory_gib is None:
        parser.error("--gpu-memory-gib: required unless --pool-blocks is given")
    if (args.prompt_tokens is None) != (args.output_tokens is None):
        parser.error("--prompt-tokens and --output-tokens: give both or neither")
    if args.prompt_tokens is None:
        if args.context <= args.block_size + 1:
            parser.error(f"--context {args.context}: must exceed one block "
                         f"({args.block_size}) plus a token")
        prompt, output = split_context(args.context, args.block_size)
    else:
        prompt, output = args.prompt_tokens, args.output_tokens
        if prompt + output > args.context:
            parser.error(f"--context {args.context}: shorter than --prompt-tokens + "
                         f"--output-tokens = {prompt + output}")
    try:
        cfg = EvictionConfig.from_budget(
            args.method, args.budget, prompt_mode=args.prompt_mode,
            prefill_budget=args.prefill_budget, chunk_size=args.chunk_size,
            block_size=args.block_size)
    except ConfigError as exc:
        flag = {"method": "--method", "max_tokens": "--budget", "keep_ratio": "--budget",
                "budget": "--budget"}.get(exc.field, f"--{exc.field.replace('_', '-')}")
        parser.error(f"{flag}: {exc}")
    if cfg.method == "none":
        parser.error("--method: 'none' does not evict; the stock column is that plan")
    inputs = {k: v for k, v in vars(args).items() if k != "json"}
    try:
        return make_plan(model, cfg, pool_blocks=args.pool_blocks,
                         gpu_memory_gib=args.gpu_memory_gib, gpu_util=args.gpu_util,
                         overhead_gib=args.overhead_gib, tp=args.tp, pp=args.pp,
                         context=args.context, prompt_tokens=prompt, output_tokens=output,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, inputs=inputs)
    except ConfigError as exc:
        parser.error(f"--{exc.field.replace('_', '-')}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    plan = plan_from_args(args, parser)
    if plan.memory is not None and plan.pool_blocks < 2:
        left = plan.memory["kv_bytes_per_gpu"] / GIB
        print(f"nexus-vllm plan: no memory left for KV: {left:.2f} GiB per GPU after the "
              "weights and the overhead", file=sys.stderr)
        return 1
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
