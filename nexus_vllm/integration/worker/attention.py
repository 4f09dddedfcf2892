"""The attention backend wrapper: one eviction path for every supported backend.

``register_backends()`` (called by the worker before the model is built) re-registers
each supported :class:`AttentionBackendEnum` entry with a subclass of vLLM's own backend
created here, so whichever backend the platform picks (``CPU_ATTN`` on CPU;
``FLASH_ATTN``, ``FLASHINFER`` or ``TRITON_ATTN`` on CUDA, by vLLM's own rules or
``--attention-backend``) comes with two mixins and nothing else changed:

* :class:`NexusMetadataBuilderMixin` hands the ``CommonAttentionMetadata`` to the
  worker's compactor (``compaction.py``), which rewrites the block table and sequence
  lengths of rows with evicted blocks into persistent buffers, before the stock
  ``build``;
* :class:`NexusAttentionImplMixin` hands the newest queries of tracked requests to the
  worker's query ring (``query_ring.py``) before the stock ``forward``
  (:class:`~nexus_vllm.integration.worker.mla.NexusMLAImplMixin` on an MLA backend).

Both mixins live in ``backend_mixins.py``, which ``mla.py`` builds on too; this module
imports both and the mixins import neither.

Neither mixin knows which backend it wraps: compaction works on the backend-neutral
metadata, and the query arrives as ``[tokens, heads, head_size]`` on every backend. The
one declared per-backend fact is where keys live in the KV cache (:func:`key_view`),
like vLLM's own ``get_kv_cache_stride_order``.

Classes are created on first use and are importable by name
(``nexus_vllm.integration.worker.attention.Nexus_FLASH_ATTN``), which is how vLLM's registry
resolves them.
"""

from __future__ import annotations

import torch

from nexus_vllm.integration.worker.backend_mixins import (
    NexusAttentionImplMixin,
    NexusMetadataBuilderMixin,
)
from nexus_vllm.integration.worker.mla import MLA_BACKENDS, NexusMLAImplMixin, latent_key_view

__all__ = [
    "CPU_BACKENDS",
    "CUDA_BACKENDS",
    "NexusAttentionImplMixin",
    "NexusMetadataBuilderMixin",
    "key_view",
    "nexus_backend",
    "register_backends",
    "wrapped_backend_name",
]

# CPU_MLA: multi-head latent attention (``integration/worker/mla.py``).
CPU_BACKENDS = ("CPU_ATTN", "CPU_MLA")
CUDA_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
_PREFIX = "Nexus_"
# The class attribute of a nexus backend naming the vLLM backend it wraps.
_INNER_NAME = "nexus_inner_name"
_CLASSES: dict[str, type] = {}


def key_view(backend_name: str, kv_cache: torch.Tensor, head_size: int,
             isa: str | None = None) -> torch.Tensor:
    """The keys of one layer's KV cache as a ``[num_blocks, Hkv, block_size, D]`` view.

    The CUDA backends of vLLM 0.32 hold ``[num_blocks, Hkv, block_size, 2 * D]`` (in any
    physical stride order) with K in the first ``D`` channels, and read it as
    ``kv_cache.transpose(1, 2).split(D, -1)``. The CPU backend stores the block's keys
    as ``block_size`` rows followed by the values, transposed inside the block for its
    vectorised ISAs; :func:`_cpu_key_view` finds out which with vLLM's own writer.
    """
    if backend_name in MLA_BACKENDS:
        return latent_key_view(kv_cache)
    if backend_name in CUDA_BACKENDS:
        return kv_cache[..., :head_size]
    if backend_name in CPU_BACKENDS:
        return _cpu_key_view(kv_cache, head_size, isa or "vec")
    raise ValueError(f"no key layout known for attention backend {backend_name!r}")


_CPU_KEY_LAYOUTS: dict[tuple[str, int, int, torch.dtype], str] = {}


def cpu_key_layout(isa: str, head_size: int, block_size: int, dtype: torch.dtype) -> str:
    """``"row"`` ([block_size, D] keys) or ``"transposed"`` ([D, block_size]): found once
    per configuration by writing known keys with vLLM's CPU cache writer and reading them
    back, so a layout change in a new vLLM release fails loudly instead of scoring
    garbage."""
    from nexus_vllm.integration.compat.vllm_compat import cpu_key_layout_probe

    cache_key = (isa, head_size, block_size, dtype)
    if cache_key not in _CPU_KEY_LAYOUTS:
        kv = cpu_key_layout_probe(head_size, block_size, dtype, isa)
        want = torch.arange(block_size * head_size, dtype=torch.float32).to(dtype)
        for name in ("row", "transposed"):
            if torch.equal(_cpu_key_view_as(kv, name)[0, 0], want.view(block_size, head_size)):
                _CPU_KEY_LAYOUTS[cache_key] = name
                break
        else:
            raise RuntimeError(
                f"nexus-vllm: unknown CPU key-cache layout for isa={isa!r}, dtype={dtype}; "
                "block scoring cannot read keys (supported: row, transposed)")
    return _CPU_KEY_LAYOUTS[cache_key]


def _cpu_key_view_as(kv_cache: torch.Tensor, layout: str) -> torch.Tensor:
    nb, hkv, bs, two_d = kv_cache.shape
    d = two_d // 2
    if layout == "row":
        return kv_cache.view(nb, hkv, 2 * bs, d)[:, :, :bs, :]
    base = kv_cache.view(nb, hkv, 2 * bs * d)
    s0, s1, _ = base.stride()
    return base.as_strided((nb, hkv, d, bs), (s0, s1, bs, 1)).transpose(-1, -2)


def _cpu_key_view(kv_cache: torch.Tensor, head_size: int, isa: str) -> torch.Tensor:
    layout = cpu_key_layout(isa, head_size, kv_cache.shape[2], kv_cache.dtype)
    return _cpu_key_view_as(kv_cache, layout)


def nexus_backend(inner_name: str) -> type:
    """vLLM's backend ``inner_name`` (its default class, not a registry override) with
    the two eviction mixins; one class per name and process."""
    cls = _CLASSES.get(_PREFIX + inner_name)
    if cls is not None:
        return cls
    if inner_name not in CPU_BACKENDS + CUDA_BACKENDS:
        raise ValueError(f"nexus-vllm has no eviction support for attention backend "
                         f"{inner_name!r}; supported: {', '.join(CPU_BACKENDS + CUDA_BACKENDS)}")
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    inner = resolve_obj_by_qualname(AttentionBackendEnum[inner_name].value)
    inner_builder = inner.get_builder_cls()
    inner_impl = inner.get_impl_cls()
    builder = _named(f"NexusBuilder_{inner_name}",
                     (NexusMetadataBuilderMixin, inner_builder), {})
    # An MLA impl is driven by its layer's forward_impl (forward_mha / forward_mqa).
    impl_mixin = NexusMLAImplMixin if inner_name in MLA_BACKENDS else NexusAttentionImplMixin
    impl = _named(f"NexusImpl_{inner_name}", (impl_mixin, inner_impl), {})
    backend = _named(_PREFIX + inner_name, (inner,), {
        "get_builder_cls": staticmethod(lambda: builder),
        "get_impl_cls": staticmethod(lambda: impl),
        _INNER_NAME: inner_name,
    })
    return backend


def wrapped_backend_name(backend: object) -> str:
    """The name of the vLLM backend (``CPU_ATTN``, ``FLASH_ATTN``, ...) that a nexus
    backend class from :func:`nexus_backend` wraps."""
    return str(getattr(backend, _INNER_NAME))


def _named(name: str, bases: tuple[type, ...], attrs: dict[str, object]) -> type:
    cls = type(name, bases, {"__module__": __name__, "__qualname__": name, **attrs})
    _CLASSES[name] = cls
    return cls


def __getattr__(name: str) -> type:
    # vLLM resolves backends by dotted path (PEP 562 module attribute).
    if name in _CLASSES:
        return _CLASSES[name]
    for prefix in (_PREFIX, "NexusBuilder_", "NexusImpl_"):
        if name.startswith(prefix):
            nexus_backend(name[len(prefix):])
            return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_backends(names: tuple[str, ...]) -> None:
    """Point vLLM's registry entries ``names`` at their nexus subclasses (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name in names:
        nexus_backend(name)
        register_backend(AttentionBackendEnum[name], f"{__name__}.{_PREFIX}{name}")
