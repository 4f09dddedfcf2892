"""The transformers side of a :class:`~nexus_vllm.hf.streaming.StreamingSession`: the
attention hook that captures its queries, and what it reads from a model and its cache.

The queries are captured through transformers' public attention hook: the session's
model attends with :data:`CAPTURE_ATTENTION`, registered with
``transformers.AttentionInterface`` and chosen with ``model.set_attn_implementation``. It is
SDPA plus a callback that each session passes with its own forward (``nexus_capture``, a
keyword argument transformers hands down to every attention call), so no session is held
in a global and a forward without the callback is plain SDPA. A model with learned
attention sinks (gpt-oss: one logit per head in each row's softmax, which transformers'
SDPA leaves out, so it only attends eagerly) attends with :data:`CAPTURE_ATTENTION_SINKS`
instead: the same callback, then the model's own eager attention, sinks included.
Scoring leaves the sink out either way, as the server's scorer does: a block's mass is
its share of the row's mass over the cached keys.

Hybrid models (full-attention layers interleaved with sliding-window ones, each kind with
its own cache layer: ``DynamicLayer`` and ``DynamicSlidingWindowLayer``) follow the
server's rules: only the full-attention layers' caches are evicted and scored; the sliding
layers keep transformers' own window cache untouched. transformers builds one mask per
layer kind, each from the first cache layer of that kind (``get_mask_sizes`` and
``get_query_offset``): the full-attention mask from the evicted layer's physical length
(every kept token visible), the sliding mask from the sliding layer's logical
``cumulative_length`` (a query at position ``p`` sees keys at positions
``> p - sliding_window``, vLLM's sliding window), so both stay right after an eviction.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from nexus_vllm.core import Rotary
from nexus_vllm.hf.mla import is_mla_attention, latent_query

if TYPE_CHECKING:
    from transformers import Cache, PretrainedConfig, PreTrainedModel

__all__ = ["CAPTURE_ATTENTION", "CAPTURE_ATTENTION_SINKS", "attention_inputs",
           "has_attention_sinks", "rotary_of", "sliding_layers", "use_capture_attention",
           "with_head_mask"]

# The attention implementation of a session's model (see the module docstring).
CAPTURE_ATTENTION = "nexus_capture_sdpa"
# The same for a model whose attention has learned sinks (eager attention).
CAPTURE_ATTENTION_SINKS = "nexus_capture_eager_sinks"
_registered = False
_register_lock = threading.Lock()


# The attention functions below are transformers' callbacks (AttentionInterface): the
# module and the keywords are whatever its layers pass, untyped as transformers has them.
def _capture_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, *,
                       nexus_capture: Callable[[int, torch.Tensor], torch.Tensor | None]
                       | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SDPA that first hands the layer's post-RoPE queries ``[1, Hq, n, D]`` to the
    forward's ``nexus_capture`` callback (one session's), when there is one; a callback
    that returns a per-KV-head live mask of the cached slots (head granularity) has the
    dead entries masked out of this layer's attention (:func:`with_head_mask`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if nexus_capture is not None:
        # MLA (DeepSeek): the query absorbed into the latent the cache holds (hf/mla.py).
        live = nexus_capture(int(module.layer_idx),
                             latent_query(module, query) if is_mla_attention(module) else query)
        if live is not None:
            attention_mask = with_head_mask(attention_mask, live, query.shape[1],
                                            query.shape[2], key.shape[2])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def with_head_mask(attention_mask: torch.Tensor | None, live: torch.Tensor,
                   num_query_heads: int, num_queries: int, num_keys: int) -> torch.Tensor:
    """SDPA's boolean mask ``[1, Hq, n, S]`` with each KV head's dead cached entries
    masked: ``live`` (BoolTensor[Hkv, C]) covers the ``C = S - n`` cached slots, the
    ``n`` new tokens attend causally (transformers' own mask when it built one)."""
    cached = num_keys - num_queries
    base = attention_mask
    if base is None:
        base = torch.ones(num_queries, num_keys, dtype=torch.bool, device=live.device)
        base[:, cached:] = torch.ones(num_queries, num_queries, dtype=torch.bool,
                                      device=live.device).tril()
        base = base.view(1, 1, num_queries, num_keys)
    elif base.dtype != torch.bool:
        raise ValueError("per-head masks apply to SDPA's boolean masks only")
    per_head = torch.ones(live.shape[0], num_keys, dtype=torch.bool, device=live.device)
    per_head[:, :cached] = live
    per_head = per_head.repeat_interleave(num_query_heads // live.shape[0], dim=0)
    return base[..., :num_keys] & per_head.view(1, num_query_heads, 1, num_keys)


def _capture_attention_sinks(module: Any, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                             nexus_capture: Callable[[int, torch.Tensor], torch.Tensor | None]
                             | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_capture_attention` for a layer with learned sinks: the callback, then the
    layer's own ``eager_attention_forward`` (its modeling module's, which adds the sink
    logit ``s_aux`` to every row's softmax)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__} has attention sinks but its module has no "
                         "eager_attention_forward to attend with")
    if nexus_capture is not None:
        nexus_capture(int(module.layer_idx), query)
    out: tuple[torch.Tensor, torch.Tensor | None] = eager(module, query, key, value, attention_mask, **kwargs)
    return out


def _register() -> None:
    """Register the capturing attention functions and their mask builders, once."""
    global _registered
    with _register_lock:
        if _registered:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

        AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
        # Without a mask entry transformers skips mask creation for unknown implementations,
        # and SDPA would then apply an upper-left causal mask: wrong for chunks after a past.
        ALL_MASK_ATTENTION_FUNCTIONS.register(CAPTURE_ATTENTION, sdpa_mask)
        # Eager attention adds its mask to the logits: the float mask.
        AttentionInterface.register(CAPTURE_ATTENTION_SINKS, _capture_attention_sinks)
        ALL_MASK_ATTENTION_FUNCTIONS.register(CAPTURE_ATTENTION_SINKS, eager_mask)
        _registered = True


def has_attention_sinks(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention layers have learned sinks (a ``sinks`` parameter,
    transformers' gpt-oss)."""
    return any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter)
               for m in model.modules())


def use_capture_attention(model: PreTrainedModel) -> None:
    """Make ``model`` attend with :data:`CAPTURE_ATTENTION` (``set_attn_implementation``;
    idempotent). Only an SDPA model is switched: the capture is SDPA, so the model's
    outputs stay the same for every caller; another implementation's would change. A
    model with attention sinks (:func:`has_attention_sinks`; transformers gives it eager
    attention only) is switched from ``eager`` to :data:`CAPTURE_ATTENTION_SINKS`, its
    own eager attention behind the capture."""
    _register()
    current = model.config._attn_implementation
    if current in (CAPTURE_ATTENTION, CAPTURE_ATTENTION_SINKS):
        return
    sinks = has_attention_sinks(model)
    wanted = "eager" if sinks else "sdpa"
    if current != wanted:
        what = "its eager attention (attention sinks)" if sinks else "SDPA"
        raise ValueError(f"StreamingSession captures queries through {what}; load the model "
                         f"with attn_implementation={wanted!r} (it has {current!r})")
    with _register_lock:
        model.set_attn_implementation(CAPTURE_ATTENTION_SINKS if sinks else CAPTURE_ATTENTION)


def rotary_of(model: PreTrainedModel, positions: int) -> Rotary:
    """A transformers model's rotary embedding as a :class:`Rotary` table of ``positions``
    rows (its ``rotary_emb``: ``inv_freq`` and ``attention_scaling``; Llama-style
    rotate-half pairs). A model with one rotary per layer type (Gemma 3:
    ``full_attention_inv_freq``, ``sliding_attention_inv_freq``) gives its full-attention
    table: only full-attention layers are scored."""
    base = getattr(model, "model", model)
    emb = getattr(base, "rotary_emb", None)
    inv_freq = getattr(emb, "inv_freq", None)
    scaling = getattr(emb, "attention_scaling", 1.0)
    if inv_freq is None:
        inv_freq = getattr(emb, "full_attention_inv_freq", None)
        scaling = getattr(emb, "full_attention_attention_scaling", 1.0)
    if inv_freq is None:
        raise ValueError(f"{type(model).__name__} has no rotary_emb.inv_freq: evidence that "
                         "un-rotates queries (expected_attention) needs a RoPE model")
    head_size = int(getattr(model.config, "head_dim", 0)
                    or model.config.hidden_size // model.config.num_attention_heads)
    return Rotary.from_inv_freq(inv_freq, positions, head_size=head_size,
                                scaling=float(scaling))



@contextlib.contextmanager
def attention_inputs(model: PreTrainedModel, layers: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """While the block runs: each of ``layers``' attention input (its input norm's output,
    ``[T, D]``) of the one forward inside, by layer index (empty for no layers)."""
    inputs: dict[int, torch.Tensor] = {}
    if not layers:
        yield inputs
        return
    decoder = model.get_decoder().layers

    def keep(li: int) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: object, out: torch.Tensor) -> None:
            inputs[li] = out[0].detach()
        return hook

    handles = [decoder[li].input_layernorm.register_forward_hook(keep(li)) for li in layers]
    try:
        yield inputs
    finally:
        for h in handles:
            h.remove()



def sliding_layers(cache: Cache, model_config: PretrainedConfig, *, evicting: bool) -> list[bool]:
    """Per cache layer: whether it is a sliding-window layer.

    Parameters
    ----------
    cache : transformers DynamicCache
        Built from the model's config (one layer object per decoder layer).
    model_config : transformers PretrainedConfig
    evicting : bool
        Refuse what eviction cannot handle: another cache layer kind (chunked attention,
        linear attention, ...) or no full-attention layer at all (the server refuses a
        model with a sliding window in every layer as well: nothing to evict that the
        window does not already drop).
    """
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    text_config = model_config.get_text_config(decoder=True)
    types = getattr(text_config, "layer_types", None) or []
    flags = []
    for i, layer in enumerate(cache.layers):
        kind = types[i] if i < len(types) else None
        if type(layer) is DynamicLayer:
            flags.append(False)
        elif type(layer) is DynamicSlidingWindowLayer and kind in (None, "sliding_attention"):
            flags.append(True)
        elif evicting:
            raise ValueError(f"StreamingSession evicts full-attention and sliding-window "
                             f"layers only; layer {i} is {type(layer).__name__} ({kind})")
        else:
            flags.append(bool(getattr(layer, "is_sliding", False)))
    if evicting and all(flags):
        raise ValueError("every layer of this model attends through a sliding window: "
                         "nothing to evict that the window does not already drop")
    return flags
