"""Attention backend with evicted blocks compacted out, and the query/score hook.

The worker's block table stays *logical*: an evicted entry holds the null block id 0, so
slot mapping, positions and RoPE are unchanged. The metadata builder drops those entries
from each row and shortens ``seq_len`` by the evicted tokens before the stock builder
runs; evicted blocks always precede the current chunk, so causal alignment (query ``i``
at ``seq_len - query_len + i``) still holds and the stock kernel runs unchanged.

On CPU this subclasses ``CPUAttentionBackend`` (KV layout ``[num_blocks, Hkv, block_size,
2 * head_size]``, keys in the first half of each block's rows) and is registered over the
``CPU_ATTN`` enum by :class:`nexus_vllm.integration.worker.NexusWorker`, because the CPU
platform ignores ``--attention-backend``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from nexus_vllm.integration.channel import worker_state

logger = init_logger(__name__)

__all__ = [
    "NexusCPUAttentionBackend",
    "NexusCPUAttentionBackendImpl",
    "NexusCPUAttentionMetadataBuilder",
    "compact_block_table",
]

BACKEND_PATH = "nexus_vllm.integration.backend.NexusCPUAttentionBackend"


def compact_block_table(
    block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Drop null (0) entries inside each row's logical range.

    Parameters
    ----------
    block_table : Tensor[R, M] int32
        Logical block tables; evicted entries hold 0.
    seq_lens : Tensor[R] int
        Logical sequence lengths (tokens).
    block_size : int

    Returns
    -------
    (Tensor[R, M], Tensor[R]) or None
        The compacted table (live ids first, zeros after) and the live sequence lengths
        (``seq_len - evicted_blocks * block_size``); None when nothing is evicted, so
        callers can keep the original tensors.
    """
    from nexus_vllm.kernels import compact_block_tables

    num_rows = seq_lens.shape[0]
    table = block_table[:num_rows]
    nblk = (seq_lens.to(torch.int64) + block_size - 1) // block_size
    cols = torch.arange(table.shape[1], device=table.device)
    if not bool(((table == 0) & (cols[None, :] < nblk[:, None])).any()):
        return None
    out = block_table.clone()
    _, new_lens = compact_block_tables(table, seq_lens, block_size, null_block=0,
                                       out_tables=out[:num_rows], backend=_backend(table))
    return out, new_lens


def _backend(t: torch.Tensor) -> str:
    # vLLM disables Triton on CPU: use the kernels' torch fallback there explicitly (so a
    # stray TRITON_INTERPRET=1 cannot select the 100x slower interpreter).
    return "torch" if t.device.type == "cpu" else "auto"


_KEY_LAYOUTS: dict[tuple[str, int, int, torch.dtype], str] = {}


def key_layout(isa: str, head_size: int, block_size: int, dtype: torch.dtype) -> str:
    """How the CPU kernels store keys inside a block: ``"row"`` ([block_size, D]) or
    ``"transposed"`` ([D, block_size], what the ``vec`` ISAs use).

    Found once per configuration by writing known keys with vLLM's own
    ``cpu_attn_reshape_and_cache`` into a scratch block and reading them back, so a
    layout change in a new vLLM release fails loudly here instead of scoring garbage.
    """
    key = (isa, head_size, block_size, dtype)
    if key not in _KEY_LAYOUTS:
        from vllm import _custom_ops as ops

        kv = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
        kc, vc = kv.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
        probe = torch.arange(block_size * head_size, dtype=torch.float32).to(dtype)
        probe = probe.view(block_size, 1, head_size)
        ops.cpu_attn_reshape_and_cache(probe, torch.zeros_like(probe), kc, vc,
                                       torch.arange(block_size, dtype=torch.int64), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        for name in ("row", "transposed"):
            if torch.equal(_key_view(kv, name)[0, 0], probe[:, 0]):
                _KEY_LAYOUTS[key] = name
                break
        else:
            raise RuntimeError(
                f"nexus-vllm: unknown CPU key-cache layout for isa={isa!r}, dtype={dtype}; "
                "block scoring cannot read keys (supported: row, transposed)")
    return _KEY_LAYOUTS[key]


def _key_view(kv_cache: torch.Tensor, layout: str) -> torch.Tensor:
    """Keys of a CPU KV cache ``[nb, Hkv, bs, 2 * D]`` as ``[nb, Hkv, bs, D]`` (a view)."""
    nb, hkv, bs, two_d = kv_cache.shape
    d = two_d // 2
    if layout == "row":
        return kv_cache.view(nb, hkv, 2 * bs, d)[:, :, :bs, :]
    base = kv_cache.view(nb, hkv, 2 * bs * d)
    s0, s1, _ = base.stride()
    return base.as_strided((nb, hkv, d, bs), (s0, s1, bs, 1)).transpose(-1, -2)


class NexusCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """Compacts evicted entries out of the block table before the stock build."""

    def build(self, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> Any:
        state = worker_state()
        if state.active and state.any_evicted:
            cm = common_attn_metadata
            compacted = compact_block_table(cm.block_table_tensor, cm.seq_lens,
                                            self.block_size)
            if compacted is not None:
                table, lens = compacted
                common_attn_metadata = dataclasses.replace(
                    cm, block_table_tensor=table, seq_lens=lens,
                    max_seq_len=int(lens.max()) if lens.numel() else 0,
                )
        return super().build(common_prefix_len, common_attn_metadata, fast_build)


class NexusCPUAttentionBackendImpl(CPUAttentionBackendImpl):
    """Stock CPU attention, plus the query window / block scoring hook."""

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                              output_scale, output_block_scale)
        state = worker_state()
        if (state.active and attn_metadata is not None
                and self.attn_type == AttentionType.DECODER and kv_cache.numel() > 0):
            layout = key_layout(getattr(layer, "isa", "vec"), self.head_size,
                                kv_cache.shape[2], kv_cache.dtype)
            key_cache = _key_view(kv_cache, layout)
            n = attn_metadata.num_actual_tokens
            try:
                state.observe(
                    getattr(layer, "layer_name", ""), query[:n], key_cache,
                    attn_metadata.block_table, attn_metadata.seq_lens,
                    attn_metadata.query_start_loc, self.num_heads, self.head_size,
                )
            except Exception:
                # Scoring must never take the engine down: drop this step's scores (the
                # scheduler then skips the event) and say so loudly.
                logger.exception("nexus-vllm: block scoring failed; skipping this step")
                state.drop_scores()
        return out


class NexusCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with block-table compaction (registered over ``CPU_ATTN``)."""

    @staticmethod
    def get_impl_cls() -> type[NexusCPUAttentionBackendImpl]:
        return NexusCPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls() -> type[NexusCPUAttentionMetadataBuilder]:
        return NexusCPUAttentionMetadataBuilder
