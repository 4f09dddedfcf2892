"""KV cache groups: how vLLM 0.32's hybrid KV cache manager lays out a model's layers, and
the blocks a request holds in each group.

A model whose layers all attend to every token has one group of all its layers. A hybrid
model (Gemma 3, gpt-oss: sliding-window layers among full-attention ones) gets groups of
equal layer count sharing one block pool (``vllm/v1/core/kv_cache_utils.py``,
``_get_kv_cache_groups_uniform_page_size``): the group size is the smaller of the two
kinds' layer counts, or the larger when it is under 1.5 times the smaller; each kind splits
into ``ceil(count / size)`` groups, group ``i`` taking its ``i``-th, ``i + n``-th, ...
layers. A block id is one block in every layer of a group, so a block takes one layer's
page times the layers of the largest group on a GPU (``_get_kv_cache_bytes_per_block``;
with pipeline parallelism each stage holds its own layers of each group, and the pool has
the blocks of the stage that fits fewest, ``get_kv_cache_configs``). A model whose layers
all slide with one window has one group of them (``UniformTypeKVCacheSpecs``).

A sliding-window group frees the blocks that leave the window
(``SlidingWindowManager.remove_skipped_blocks``: the first ``computed - window + 1``
tokens' whole blocks, counted on the tokens whose step is done), so a request holds at
most ``ceil((window - 1 + in_flight) / block_size) + 1`` blocks there
(``SlidingWindowSpec.max_admission_blocks_per_request``, with ``in_flight`` the tokens
scheduled and not yet done: vLLM's ``max_in_flight_tokens``, steps in flight x
``--max-num-batched-tokens``), and never more than its sequence's. Stock vLLM's admission
reserves, in each group, the prompt's blocks capped there
(``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` with ``apply_admission_cap``). The
plugin evicts only the full-attention group and reserves each sliding group's window plus
the tokens in flight for the request's phase: vLLM's steps in flight x the step budget
while the prompt is computed (x the chunk, where smaller, when the prompt mode evicts
during the prompt: the server then caps each request's prompt step there), one token per
step in flight once it decodes
(:func:`nexus_vllm.core.budget.window_in_flight_tokens`, run by ``WindowBlocks.allowance``
in ``integration/scheduler/live_blocks.py`` and by :func:`.burst.window_allowance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nexus_vllm.core import cdiv
from nexus_vllm.core.budget import window_max_blocks

from .shape import ModelShape

__all__ = ["KVGroup", "eviction_refusal", "kv_cache_groups", "layers_per_block",
           "pp_stages", "window_held_blocks", "window_max_blocks"]


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group.

    Attributes
    ----------
    layers : tuple of int
        Its layers' indices, ascending.
    window : int or None
        The sliding window in tokens (None: full attention).
    """

    layers: tuple[int, ...]
    window: int | None = None

    @property
    def sliding(self) -> bool:
        return self.window is not None


def kv_cache_groups(model: ModelShape) -> list[KVGroup]:
    """vLLM's KV cache groups for ``model`` with the hybrid KV cache manager on, in vLLM's
    order (the kinds as their first layer comes, then each kind's groups)."""
    full, sliding = model.full_layers, model.sliding_layers
    if not sliding or not full:
        return [KVGroup(tuple(range(model.layers)), model.sliding_window)]
    small, large = sorted((len(full), len(sliding)))
    size = large if large < small * 1.5 else small
    kinds = [(full, None), (sliding, model.sliding_window)]
    kinds.sort(key=lambda kind: kind[0][0])
    groups = []
    for layers, window in kinds:
        count = cdiv(len(layers), size)
        groups += [KVGroup(tuple(layers[i::count]), window) for i in range(count)]
    return groups


def pp_stages(layers: int, pp: int) -> list[range]:
    """The layers of each pipeline stage, as vLLM splits them (``get_pp_indices`` in
    ``vllm/distributed/utils.py``): evenly, one more in each stage but the last from the
    second-last back for the remainder."""
    sizes = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def layers_per_block(groups: Sequence[KVGroup], layers: int, pp: int) -> int:
    """Layers one block spans on the GPU that needs the most: the largest group's layers
    on the largest stage (every layer of an all-full model: ``ceil(layers / pp)``)."""
    return max(sum(1 for i in g.layers if i in stage)
               for stage in pp_stages(layers, pp) for g in groups)


def window_held_blocks(window: int, block_size: int, done: int, allocated: int) -> int:
    """Blocks a request holds in a sliding group with ``allocated`` token slots once
    vLLM has freed what left the window of ``done`` computed tokens
    (``remove_skipped_blocks``: the whole blocks of the first ``done - window + 1``
    tokens)."""
    total = cdiv(allocated, block_size)
    return total - min(total, max(0, done - window + 1) // block_size)


def eviction_refusal(model: ModelShape) -> str | None:
    """Why the plugin refuses to evict on ``model`` (None: it serves it): every layer
    slides (the frontend's ``sliding_window_only``), or vLLM's grouping leaves other than
    one full-attention group (the scheduler's ``kv_cache_groups``)."""
    if model.sliding_layers and not model.full_layers:
        return (f"model {model.name} uses sliding-window attention in every layer (no "
                "full-attention layer to evict from; vLLM already bounds such a cache by "
                "its window): the server refuses it with eviction on (serve it with "
                "--kv-eviction none)")
    full = [g for g in kv_cache_groups(model) if not g.sliding]
    if len(full) != 1:
        return (f"model {model.name}: vLLM's hybrid KV cache manager puts its "
                f"{len(model.full_layers)} full-attention layers in {len(full)} KV cache "
                f"groups (groups of {len(full[0].layers)} layers, set by its "
                f"{len(model.sliding_layers)} sliding-window layers); eviction needs "
                "exactly one full-attention group, so the server refuses it with eviction "
                "on (serve it with --kv-eviction none)")
    return None
