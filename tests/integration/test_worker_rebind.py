"""``NexusWorker.extend_kv_cache`` (vLLM 0.34's extensible KV cache): after vLLM replaces
every layer's KV tensors, the scorer reads the new ones.

The worker is built without vLLM's ``__init__`` (no model, no device): only what
``_bind`` reads is set, with stand-ins for the layers whose KV cache the (stand-in) base
``extend_kv_cache`` swaps the way 0.34's ``v1/worker/extensible_kv_cache.py`` does.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.integration.conftest import HAS_VLLM
from tests.integration.fakes import FakeRunner, adapter, make_state

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")


def _layer(i: int, blocks: int) -> Any:
    from nexus_vllm.integration.worker.attention import NexusAttentionImplMixin

    impl = type("Impl", (NexusAttentionImplMixin,), {})()
    impl.head_size = 8
    layer = SimpleNamespace(kv_cache=torch.zeros(blocks, 2, 32, 16), impl=impl,
                            attn_backend=SimpleNamespace(nexus_inner_name="FLASH_ATTN"))
    return SimpleNamespace(name=f"model.layers.{i}.self_attn.attn", layer=layer, impl=impl,
                           kv_cache=layer.kv_cache)


def test_key_views_follow_the_extended_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from nexus_vllm.integration.worker import worker as worker_mod

    layers = [_layer(0, 4), _layer(1, 4)]

    class Views:  # attention_layers(vllm_config): re-read on every call, like vLLM's
        def __call__(self, _config: Any) -> list[Any]:
            return [SimpleNamespace(name=v.name, layer=v.layer, impl=v.impl,
                                    kv_cache=v.layer.kv_cache) for v in layers]

    def extend_kv_cache(self: Any, num_blocks: int) -> None:
        for v in layers:  # vLLM 0.34 allocates new tensors and re-binds each layer
            v.layer.kv_cache = torch.zeros(num_blocks, 2, 32, 16)

    monkeypatch.setattr(worker_mod, "attention_layers", Views())
    monkeypatch.setattr(worker_mod, "attention_groups", lambda runner: [])
    monkeypatch.setattr(worker_mod._BaseWorker, "extend_kv_cache", extend_kv_cache,
                        raising=False)
    worker = worker_mod.NexusWorker.__new__(worker_mod.NexusWorker)
    runner = FakeRunner({"a": [1, 2]})
    worker.model_runner = runner
    worker.vllm_config = SimpleNamespace()
    worker.nexus_state = make_state(runner)
    worker._nexus_scored = frozenset({0, 1})
    worker._bind(adapter(runner))
    before = [k.key_cache for k in worker.nexus_state.ring.layer_keys]
    assert [k.shape[0] for k in before] == [4, 4]

    worker.extend_kv_cache(12)
    after = worker.nexus_state.ring.layer_keys
    assert [k.key_cache.shape[0] for k in after] == [12, 12]
    for view, keys in zip(layers, after):
        assert keys.key_cache.data_ptr() == view.layer.kv_cache.data_ptr()
        assert view.impl.nexus_ring is worker.nexus_state.ring
