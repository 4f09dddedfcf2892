"""Streaming KV-cache eviction on a Hugging Face transformers model (Llama family, and
hybrid sliding-window models such as Gemma 3).

A :class:`StreamingSession` owns a ``DynamicCache`` for one sequence (batch size 1). Tokens
are fed with explicit logical ``position_ids`` (tokens seen so far), while the cache holds
only the kept tokens: evicted tokens keep their original RoPE positions and nothing is
re-rotated. The causal mask is derived by transformers from the *physical* cache length,
which is correct because every cached token precedes the new ones.

Evidence for an eviction event is the post-RoPE query rows of the newest ``W`` tokens per
layer, scored against the cached keys of the layers ``>= skip_layers`` with
``nexus_vllm.core.block_attention_mass`` and combined over heads and layers by the
config's ``attention_reduce`` (their maximum by default); the decision (which blocks of
``block_size`` tokens to keep) is shared by every layer and head, as in the vLLM plugin.

Hybrid models (full-attention layers interleaved with sliding-window ones, each kind with
its own cache layer: ``DynamicLayer`` and ``DynamicSlidingWindowLayer``) follow the
server's rules: only the full-attention layers' caches are evicted and scored; the sliding
layers keep transformers' own window cache untouched. transformers builds one mask per
layer kind, each from the first cache layer of that kind (``get_mask_sizes`` and
``get_query_offset``): the full-attention mask from the evicted layer's physical length
(every kept token visible), the sliding mask from the sliding layer's logical
``cumulative_length`` (a query at position ``p`` sees keys at positions
``> p - sliding_window``, vLLM's sliding window), so both stay right after an eviction.

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
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nexus_vllm.core import (
    EvictionConfig,
    EvictionTrigger,
    Evidence,
    Rotary,
    evidence_kind,
    num_blocks_for,
)
from nexus_vllm.core._validate import ConfigError
from nexus_vllm.core.evidence import DenseLayer, DenseSequence
from nexus_vllm.core.head_paged import (
    HeadEvidence,
    forced_positions,
    head_budget_blocks,
    head_expected_attention,
    head_key_norms,
    head_tokens_held,
    head_window_attention,
    load_head_profile,
    select_head_units,
)
from nexus_vllm.core.head_scorer import HeadScorer, load_head_scorer, shipped_head_scorers
from nexus_vllm.hf.mla import is_mla_attention, latent_keys, latent_query, latent_rotary

__all__ = ["CAPTURE_ATTENTION", "CAPTURE_ATTENTION_SINKS", "EvictionEvent", "StreamingSession",
           "has_attention_sinks", "make_config", "rotary_of", "use_capture_attention",
           "with_head_mask"]

# The attention implementation of a session's model (see the module docstring).
CAPTURE_ATTENTION = "nexus_capture_sdpa"
# The same for a model whose attention has learned sinks (eager attention).
CAPTURE_ATTENTION_SINKS = "nexus_capture_eager_sinks"
_registered = False
_register_lock = threading.Lock()
# Rows of a rotary table for a config without max_position_embeddings.
_ROTARY_ROWS = 1 << 15
# A prompt length no stream reaches: the prompt has not ended yet.
_UNKNOWN = 1 << 62



def _capture_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Any, *,
                       nexus_capture: Callable[[int, torch.Tensor], torch.Tensor | None]
                       | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, Any]:
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
                             value: torch.Tensor, attention_mask: Any, *,
                             nexus_capture: Callable[[int, torch.Tensor], torch.Tensor | None]
                             | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """:func:`_capture_attention` for a layer with learned sinks: the callback, then the
    layer's own ``eager_attention_forward`` (its modeling module's, which adds the sink
    logit ``s_aux`` to every row's softmax)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__} has attention sinks but its module has no "
                         "eager_attention_forward to attend with")
    if nexus_capture is not None:
        nexus_capture(int(module.layer_idx), query)
    out: tuple[torch.Tensor, Any] = eager(module, query, key, value, attention_mask, **kwargs)
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


def has_attention_sinks(model: Any) -> bool:
    """Whether ``model``'s attention layers have learned sinks (a ``sinks`` parameter,
    transformers' gpt-oss)."""
    return any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter)
               for m in model.modules())


def use_capture_attention(model: Any) -> None:
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


def rotary_of(model: Any, positions: int) -> Rotary:
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


def make_config(method: str, budget: float | int | None, **knobs: Any) -> EvictionConfig | None:
    """Build the :class:`EvictionConfig` for ``method`` at ``budget`` (``None`` for dense).

    Parameters
    ----------
    method : str
        ``"dense"`` (no eviction) or any ``EvictionConfig.method``.
    budget : float or int
        A float in (0, 1] is the kept fraction of tokens seen (``keep_ratio``); an int is a
        token count (``max_tokens``). Ignored for dense.
    **knobs
        Any other ``EvictionConfig`` field (block_size, window, sampler, ...).
    """
    if method in ("dense", "none"):
        return None
    if budget is None:
        raise ValueError("budget must be a float in (0, 1] or a positive int, got None")
    return EvictionConfig.from_budget(method, budget, **knobs)


@dataclass(frozen=True)
class EvictionEvent:
    """One eviction: when it fired and what the cache held afterwards."""

    seen: int  # logical tokens fed when the event fired
    prefill: bool
    blocks_before: int
    blocks_after: int
    budget_blocks: int
    kept_positions: torch.Tensor  # LongTensor[T_after], logical positions still cached
    # What the policy read: the logical ids of the live blocks it scored (LongTensor[N],
    # in cache order) and each evidence kind as gathered over them (``mass``: Tensor[W, N]
    # combined over heads and layers by the config's attention_reduce;
    # Evidence.from_gathered reads them back; empty for score-free policies).
    live_blocks: torch.Tensor | None = None
    gathered: dict[str, torch.Tensor] = field(default_factory=dict)
    prompt_end: bool = False  # the event after the prompt's last token
    # Head granularity: BoolTensor[full layers, Hkv, T_after], what each head holds.
    head_live: torch.Tensor | None = None

    @property
    def mass(self) -> torch.Tensor | None:
        return self.gathered.get("mass")


class StreamingSession:
    """One sequence streamed through ``model`` with block eviction under a budget.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A decoder-only Llama-family model (q/k/v attention modules with ``layer_idx``), or
        a hybrid one whose cache mixes full-attention and sliding-window layers (Gemma 3):
        only the full-attention layers are evicted and scored.
    config : EvictionConfig or None
        ``None`` keeps everything (dense).
    request_seed : int
        Mixed with ``config.seed`` into the per-request generator.
    record_events : bool
        Keep an :class:`EvictionEvent` per event in ``self.events`` (tests, statistics).
    prompt_tokens : int, optional
        The prompt's length, where prefill ends (``prompt_mode`` ``end`` and ``keep`` read
        it); None: not known yet, every token fed counts as prompt until
        :meth:`set_prompt_tokens`.
    capture_rows : int
        Query rows to keep per layer besides what ``config`` scores (a dense session that
        :meth:`with_config` later turns into an evicting one).
    """

    def __init__(self, model: Any, config: EvictionConfig | None, *, request_seed: int = 0,
                 record_events: bool = False, prompt_tokens: int | None = None,
                 capture_rows: int = 0) -> None:
        from transformers import DynamicCache

        use_capture_attention(model)
        self.model = model
        self.config = config
        self.cache: Any = DynamicCache(config=model.config)
        self.num_layers = int(model.config.num_hidden_layers)
        # Which cache layers are sliding-window ones (transformers' own window cache, never
        # evicted) and which attend fully (evicted, scored, counted by the budget).
        self._sliding = _sliding_layers(self.cache, model.config, evicting=config is not None)
        self._full = [i for i, s in enumerate(self._sliding) if not s]
        self.seen = 0
        self.positions = torch.empty(0, dtype=torch.long)
        self.state: dict[str, Any] = {}
        self.generator = config.generator(request_seed) if config is not None else None
        self.events: list[EvictionEvent] = []
        self.record_events = record_events
        self.num_events = 0
        # The vLLM plugin's rule for when events fire (nexus_vllm.core.trigger).
        self.trigger = EvictionTrigger(config, _UNKNOWN if prompt_tokens is None
                                       else int(prompt_tokens))
        keep = max(config.window, config.prompt_window) if config is not None else 0
        self._query_keep = max(keep, int(capture_rows))
        self._queries: list[torch.Tensor | None] = [None] * self.num_layers
        self._rotary: Rotary | None = None
        # Multi-head latent attention: the cache holds latent rows, scored with latent
        # queries (hf/mla.py).
        self._latent = any(is_mla_attention(m) for m in model.modules())
        # Head granularity: which entries each (full layer, KV head) holds over the cache
        # slots, and the best score each entry has had (core/head_paged.py).
        self._heads: HeadLedger | None = None
        if config is not None and config.granularity == "head":
            self._heads = HeadLedger.start(model, self._full, self._latent, config)

    # ------------------------------------------------------------------ forward
    def _record_queries(self, layer_idx: int, query: torch.Tensor) -> torch.Tensor | None:
        # Sliding-window layers are never scored: their queries are not kept.
        if self._query_keep == 0 or self._sliding[layer_idx]:
            return None
        q = query[0, :, -self._query_keep:, :].detach()  # [Hq, w, D]
        prev = self._queries[layer_idx]
        if prev is not None and q.shape[1] < self._query_keep:
            q = torch.cat([prev, q], dim=1)[:, -self._query_keep:]
        self._queries[layer_idx] = q
        return self._heads.live_of(layer_idx) if self._heads is not None else None

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, *, logits_to_keep: int = 1) -> torch.Tensor:
        """Feed ``input_ids`` (LongTensor[n] or [1, n]); return logits ``[min(n, keep), V]``.

        ``logits_to_keep=0`` returns logits for every fed token.
        """
        ids = input_ids.reshape(1, -1)
        n = ids.shape[1]
        pos = torch.arange(self.seen, self.seen + n, device=ids.device).unsqueeze(0)
        use_capture_attention(self.model)  # in case the model was switched back since
        scorer = self._heads.scorer if self._heads is not None else None
        with _attention_inputs(self.model, self._full if scorer is not None else []
                               ) as inputs:
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache,
                             use_cache=True, logits_to_keep=logits_to_keep,
                             nexus_capture=self._record_queries)
        self.seen += n
        self.positions = torch.cat([self.positions, pos[0].cpu()])
        if self._heads is not None:
            estimate = None
            if scorer is not None:
                estimate = torch.stack([scorer.score(i, inputs[li]).cpu()
                                        for i, li in enumerate(self._full)])
            self._heads.append(n, estimate)
        return out.logits[0].float()

    # ------------------------------------------------------------------ eviction
    @property
    def cache_len(self) -> int:
        """Tokens physically held in the full-attention layers' caches (what eviction,
        the budget and the trigger count; every full layer holds the same tokens). A
        sliding layer holds at most ``sliding_window - 1`` of them."""
        layer = self._full[0] if self._full else 0
        return int(self.cache.layers[layer].get_seq_length())

    @property
    def held_tokens(self) -> int:
        """Tokens the budget counts: :attr:`cache_len` at block granularity; under head
        granularity the mean a (full layer, KV head) holds, rounded up."""
        if self._heads is None:
            return self.cache_len
        return head_tokens_held(self._heads.live)

    @property
    def head_live(self) -> torch.Tensor | None:
        """Under head granularity, BoolTensor[full layers, Hkv, cache_len]: the entries
        each (layer, KV head) holds; None at block granularity."""
        return None if self._heads is None else self._heads.live

    @property
    def full_attention_layers(self) -> list[int]:
        """Indices of the layers that attend fully (all of them for a Llama-family
        model; a hybrid model's sliding-window layers are left out)."""
        return list(self._full)

    def _scored_layers(self) -> list[int]:
        """The config's ``scored_layers`` without the sliding-window layers (the server's
        rule); tiny test models that leave none score their last full-attention layer."""
        assert self.config is not None
        layers = [i for i in self.config.scored_layers(self.num_layers) if not self._sliding[i]]
        return layers or self._full[-1:]

    def dense_sequence(self, window: int, kinds: frozenset[str] = frozenset()
                       ) -> DenseSequence:
        """The scored layers' newest ``window`` query rows and cached keys (what every
        dense gatherer reads), with the model's rotary table when a kind in ``kinds``
        needs it: for evidence computed per head before heads are combined."""
        cfg = self.config
        assert cfg is not None
        layers = []
        for li in self._scored_layers():
            q = self._queries[li]
            if q is None:
                raise RuntimeError("no queries recorded yet: feed tokens before evicting")
            cached = self.cache.layers[li]
            keys = (latent_keys(cached) if self._latent  # MLA: [c_kv | k_pe] rows
                    else cached.keys[0].transpose(0, 1))
            layers.append(DenseLayer(queries=q[:, -window:].transpose(0, 1),  # [W, Hq, D]
                                     keys=keys))
        w = int(layers[0].queries.shape[0]) if layers else 0
        rotary = (self.rotary() if any(evidence_kind(k).needs_rotary for k in kinds)
                  else None)
        return DenseSequence(layers=layers, block_size=cfg.block_size,
                             attention_reduce=cfg.attention_reduce,
                             query_positions=torch.arange(self.seen - w, self.seen),
                             next_position=self.seen, rotary=rotary)

    def gather(self, kinds: frozenset[str], window: int) -> dict[str, torch.Tensor]:
        """Each evidence kind in ``kinds`` for this sequence now, as its registered dense
        gatherer computes it (``mass``: ``[W, N]`` rows combined over heads and layers by
        the config's ``attention_reduce``, rows of maxima under ``max``)."""
        seq = self.dense_sequence(window, kinds)
        return {name: evidence_kind(name).gather_dense(seq) for name in sorted(kinds)}

    def block_mass(self, window: int) -> torch.Tensor:
        """Attention mass ``[W, N]`` of the newest ``window`` queries over the scored
        layers and heads, combined by the config's ``attention_reduce``."""
        return self.gather(frozenset({"mass"}), window)["mass"]

    def key_norms(self) -> torch.Tensor:
        """Mean key L2 norm per block ``[N]`` over scored layers and KV heads (for knorm)."""
        return self.gather(frozenset({"key_norms"}), 1)["key_norms"]

    def rotary(self) -> Rotary:
        """The model's rotary table: ``max_position_embeddings`` rows, as vLLM's
        ``cos_sin_cache`` holds (so both paths clamp the same positions), or
        ``_ROTARY_ROWS`` when the config names no maximum."""
        if self._rotary is None:
            rows = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
            self._rotary = rotary_of(self.model, rows or _ROTARY_ROWS)
            if self._latent:  # latent queries rotate in their last channels (hf/mla.py)
                self._rotary = latent_rotary(self.model.config, self._rotary)
        return self._rotary

    @property
    def prompt_tokens(self) -> int:
        return int(self.trigger.prompt_tokens)

    def set_prompt_tokens(self, prompt_tokens: int) -> None:
        """Where this sequence's prompt ends (a branch of a shared prefix ends its own)."""
        self.trigger.prompt_tokens = int(prompt_tokens)

    def evict(self, *, prefill: bool = True) -> bool:
        """After a prompt chunk: run one eviction event if the trigger says so (the
        sequence holds more than its target, :meth:`EvictionConfig.target_blocks`); return
        whether it evicted. ``prefill=False`` evicts down to the target whenever over it
        (a decode-style event outside the decode clock)."""
        cfg = self.config
        if cfg is None:
            return False
        n_blocks = num_blocks_for(self.held_tokens, cfg.block_size)
        # The trigger's prefill rule (every token since it last moved is this chunk's): an
        # event when over the target, and the decode clock restarts (``prefill`` only
        # picks the policy and window of the event).
        if self.trigger.advance(self.seen, n_blocks) is None:
            return False
        return self._event(prefill=prefill, n_blocks=n_blocks,
                           budget_blocks=cfg.target_blocks(self.seen, self.prompt_tokens))

    def _event(self, *, prefill: bool, n_blocks: int, budget_blocks: int) -> bool:
        cfg = self.config
        assert cfg is not None
        b = cfg.block_size
        prompt_end = self.trigger.ends_prompt(prefill)
        policy = cfg.policy(prefill=prefill, prompt_tokens=self.prompt_tokens,
                            prompt_end=prompt_end)
        window = policy.window(cfg.prompt_window if prefill else cfg.window)
        if self._heads is not None:
            return self._head_event(policy, window, prefill=prefill, n_blocks=n_blocks,
                                    budget_blocks=budget_blocks, prompt_end=prompt_end)
        gathered = self.gather(policy.needs, window) if policy.needs else {}
        evidence = Evidence.from_gathered(gathered, attention_reduce=cfg.attention_reduce,
                                          num_blocks=n_blocks)
        live_blocks = self.positions[::b] // b if self.record_events else None
        keep = policy.select(
            evidence, budget_blocks, generator=self.generator, state=self.state
        )
        self.keep_blocks(keep)
        self.num_events += 1
        if self.record_events:
            self.events.append(EvictionEvent(
                seen=self.seen, prefill=prefill, blocks_before=n_blocks,
                blocks_after=num_blocks_for(self.cache_len, b), budget_blocks=budget_blocks,
                kept_positions=self.positions.clone(), live_blocks=live_blocks,
                gathered={k: v.detach().cpu() for k, v in gathered.items()},
                prompt_end=prompt_end))
        return True

    def keep_blocks(self, keep: torch.Tensor) -> None:
        """Keep only the blocks ``keep`` (LongTensor of block indices in cache order,
        ascending, as a policy's ``select`` returns them): :meth:`keep_slots` of their
        tokens."""
        b = self.config.block_size if self.config is not None else 1
        token_idx = (keep.view(-1, 1) * b + torch.arange(b)).view(-1)
        self.keep_slots(token_idx[token_idx < self.cache_len])

    def keep_slots(self, token_idx: torch.Tensor) -> None:
        """Keep only the cache slots ``token_idx`` (LongTensor, ascending) in every
        full-attention layer; a sliding layer's window is transformers' to keep, as vLLM
        keeps its sliding groups' blocks."""
        for li in self._full:
            layer = self.cache.layers[li]
            dev = layer.keys.device
            layer.keys = layer.keys.index_select(-2, token_idx.to(dev))
            layer.values = layer.values.index_select(-2, token_idx.to(dev))
        self.positions = self.positions[token_idx]
        if self._heads is not None:
            self._heads.keep_slots(token_idx)

    def head_evidence(self, kinds: frozenset[str], window: int) -> HeadEvidence:
        """Each per-head kind in ``kinds`` over every full-attention layer's live entries
        (:mod:`nexus_vllm.core.head_paged`), from the newest ``window`` query rows."""
        heads = self._heads
        assert heads is not None
        live = heads.live
        per_kind: dict[str, list[torch.Tensor]] = {k: [] for k in sorted(kinds)}
        rotary = self.rotary() if "expected_attention" in kinds else None
        for i, li in enumerate(self._full):
            q = self._queries[li]
            if q is None:
                raise RuntimeError("no queries recorded yet: feed tokens before evicting")
            rows = q[:, -window:].transpose(0, 1)  # [W, Hq, D]
            keys = self.cache.layers[li].keys[0].transpose(0, 1)  # [T, Hkv, D]
            if "mass" in per_kind:
                per_kind["mass"].append(head_window_attention(
                    rows, keys, live[i], scale=heads.scales.get(li)))
            if "expected_attention" in per_kind:
                assert rotary is not None
                w = int(rows.shape[0])
                per_kind["expected_attention"].append(head_expected_attention(
                    rows, torch.arange(self.seen - w, self.seen), keys, live[i], self.seen,
                    rotary))
            if "key_norms" in per_kind:
                per_kind["key_norms"].append(head_key_norms(keys))
            if "reconstruction" in per_kind:
                assert heads.estimate is not None  # HeadLedger.start loads the scorer
                per_kind["reconstruction"].append(heads.estimate[i].masked_fill(~live[i], 0.0))
        return HeadEvidence(live=live, kinds={k: torch.stack(v) for k, v in per_kind.items()})

    def _head_event(self, policy: Any, window: int, *, prefill: bool, n_blocks: int,
                    budget_blocks: int, prompt_end: bool) -> bool:
        """One event at head granularity: score every live (layer, KV head, token) unit,
        keep by one threshold within ``budget_blocks`` x layers x KV heads head-blocks,
        then drop the cache slots no head holds any more."""
        cfg = self.config
        heads = self._heads
        assert cfg is not None and heads is not None
        evidence = self.head_evidence(policy.head_needs, window)
        scores = heads.remember(policy.head_score(evidence))
        forced = forced_positions(self.positions, self.seen, cfg.block_size,
                                  policy.sink_blocks, policy.recent_blocks)
        live = heads.live
        keep = select_head_units(
            scores, live, forced,
            head_budget_blocks(budget_blocks, live.shape[0], live.shape[1]), cfg.block_size,
            positions=self.positions, group=cfg.head_group, sampler=policy.head_sampler,
            n=int(getattr(policy, "n", 1)), generator=self.generator, shares=heads.shares)
        heads.live = keep
        self.keep_slots(torch.nonzero(keep.any(dim=1).any(dim=0)).view(-1))
        self.num_events += 1
        if self.record_events:
            self.events.append(EvictionEvent(
                seen=self.seen, prefill=prefill, blocks_before=n_blocks,
                blocks_after=num_blocks_for(self.held_tokens, cfg.block_size),
                budget_blocks=budget_blocks, kept_positions=self.positions.clone(),
                prompt_end=prompt_end, head_live=heads.live.clone()))
        return True

    def decode_step_done(self, n: int = 1) -> None:
        """Count ``n`` decoded tokens (fed since the last call); fire an event when the
        trigger says so (over the target and ``interval`` tokens since the last event, or
        at the hard limit: target + one chunk).

        With ``n > 1`` the rule is checked once, on the counts after all ``n``: the caller
        guarantees no event was due earlier (:meth:`decode_tokens_before_event`).
        """
        cfg = self.config
        if cfg is None:
            return
        n_blocks = num_blocks_for(self.held_tokens, cfg.block_size)
        if self.trigger.advance(self.seen, n_blocks, n) is not None:
            self._event(prefill=False, n_blocks=n_blocks,
                        budget_blocks=cfg.target_blocks(self.seen, self.prompt_tokens))

    def decode_tokens_before_event(self, limit: int) -> int:
        """How many decode tokens (``1..limit``) can be fed in one forward: up to and
        including the first one after which an event would be due (the trigger's rule on
        the cache length and tokens seen that feeding them one at a time would give)."""
        cfg = self.config
        if cfg is None:
            return limit
        for j in range(1, limit + 1):
            n_blocks = num_blocks_for(self.held_tokens + j, cfg.block_size)
            # On a copy: asking must not move the session's clock.
            if copy.copy(self.trigger).advance(self.seen + j, n_blocks, j) is not None:
                return j
        return limit

    def with_config(self, config: EvictionConfig, *, request_seed: int = 0) -> StreamingSession:
        """A copy of this dense session that evicts from now on under ``config``, as if it
        had been created with it (fresh generator, policy state and event clock).

        Only exact where ``config`` would not have evicted yet: ``prompt_mode`` ``end``
        without a ``prefill_budget`` (or ``keep``) before the prompt's end. The session
        must have recorded enough query rows (``capture_rows``).
        """
        if self.config is not None or self.num_events:
            raise ValueError("with_config starts from a dense session")
        if config.prompt_mode == "stream" or config.prefill_budget is not None:
            raise ValueError("a dense prefix equals an evicting one only in prompt_mode "
                             "'end' without prefill_budget, or 'keep'")
        # What an evicting session refuses at construction (no full-attention layer, ...).
        _sliding_layers(self.cache, self.model.config, evicting=True)
        need = max(config.window, config.prompt_window)
        if self._query_keep < need:
            raise ValueError(f"this session kept {self._query_keep} query rows; the config "
                             f"scores {need}")
        other = self.clone()
        other.config = config
        other.generator = config.generator(request_seed)
        other.state = {}
        other.trigger = EvictionTrigger(config, self.prompt_tokens)
        if config.granularity == "head":
            other._heads = HeadLedger.start(self.model, self._full, self._latent, config)
            if other._heads.scorer is not None:
                # Its estimates are made as tokens are fed, from inputs not kept after.
                raise ValueError("the reconstruction stand-in scores tokens as they are "
                                 "fed: run the session under its config from the start")
            other._heads.append(self.cache_len)
        return other

    def clone(self) -> StreamingSession:
        """An independent copy (cache, policy state, generator), to branch after a prefix."""
        other = copy.copy(self)
        # A deep copy keeps each layer's class and counters: a sliding layer's
        # cumulative_length (tokens seen) is more than the window it holds, and re-feeding
        # its tensors through ``update`` would reset it.
        other.cache = copy.deepcopy(self.cache)
        other.state = copy.deepcopy(self.state)
        other.trigger = copy.copy(self.trigger)
        if self.generator is not None:
            g = torch.Generator(device=self.generator.device)
            g.set_state(self.generator.get_state())
            other.generator = g
        other.events = list(self.events)
        other._queries = [q.clone() if q is not None else None for q in self._queries]
        other.positions = self.positions.clone()
        other._heads = self._heads.copy() if self._heads is not None else None
        return other


@dataclass
class HeadLedger:
    """A session's per-head bookkeeping at head granularity.

    Attributes
    ----------
    layers : list of int
        The full-attention layers (the ones evicted), in order.
    live : BoolTensor[len(layers), Hkv, T]
        Which cache slots each (layer, KV head) still attends to.
    best : Tensor[len(layers), Hkv, T]
        The largest score each entry has had at any event (-inf before its first): an
        entry keeps what its own chunk's queries saw in it once later rows look away.
    scales : dict of int to float
        Each layer's attention logit scale (the module's ``scaling``).
    shares : Tensor[len(layers), Hkv] or None
        The config's ``head_profile``: a fixed allocation over the heads.
    scorer : HeadScorer or None
        When an event's policy reads the ``reconstruction`` evidence: the learned
        stand-in (the config's ``head_scorer``, or the one shipped for the model).
    estimate : Tensor[len(layers), Hkv, T] or None
        The scorer's prediction for every slot, made when its token was fed.
    """

    layers: list[int]
    live: torch.Tensor
    best: torch.Tensor
    scales: dict[int, float]
    shares: torch.Tensor | None = None
    scorer: HeadScorer | None = None
    estimate: torch.Tensor | None = None

    @classmethod
    def start(cls, model: Any, full_layers: list[int], latent: bool,
              config: EvictionConfig) -> HeadLedger:
        if latent:
            raise ValueError("granularity 'head' needs KV heads; an MLA model caches one "
                             "latent row per token (use granularity 'block')")
        if has_attention_sinks(model):
            raise ValueError("granularity 'head' masks SDPA's attention; a model with "
                             "attention sinks attends eagerly (use granularity 'block')")
        text = model.config.get_text_config(decoder=True)
        hkv = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        scales = {int(m.layer_idx): float(m.scaling) for m in model.modules()
                  if hasattr(m, "q_proj") and hasattr(m, "scaling")
                  and getattr(m, "layer_idx", None) is not None}
        shape = (len(full_layers), hkv, 0)
        shares = None
        profile = config.head_profile
        if profile is not None:
            shares = load_head_profile(profile).tensor()
            if tuple(shares.shape) != shape[:2]:
                raise ValueError(f"head_profile {profile!r} allocates over "
                                 f"{tuple(shares.shape)} (layers, KV heads); this model has "
                                 f"{shape[:2]}")
        scorer = None
        if any("reconstruction" in config.policy(prefill=p, prompt_end=e).head_needs
               for p, e in ((False, False), (True, False), (True, True))):
            scorer = _head_scorer_for(model, config.head_scorer, len(full_layers), hkv)
        return cls(layers=list(full_layers), live=torch.zeros(shape, dtype=torch.bool),
                   best=torch.zeros(shape), scales=scales, shares=shares, scorer=scorer,
                   estimate=torch.zeros(shape) if scorer is not None else None)

    def live_of(self, layer_idx: int) -> torch.Tensor | None:
        """The live mask ``[Hkv, T]`` of one layer (None for a sliding layer)."""
        if layer_idx not in self.layers:
            return None
        return self.live[self.layers.index(layer_idx)]

    def append(self, n: int, estimate: torch.Tensor | None = None) -> None:
        """``n`` new slots, live in every head, not scored yet; ``estimate``
        ``[L, Hkv, n]``: the scorer's prediction for them."""
        layers, heads, _ = self.live.shape
        self.live = torch.cat([self.live, torch.ones(layers, heads, n, dtype=torch.bool)],
                              dim=-1)
        self.best = torch.cat([self.best, torch.full((layers, heads, n), float("-inf"))],
                              dim=-1)
        if self.estimate is not None:
            assert estimate is not None and estimate.shape[-1] == n
            self.estimate = torch.cat([self.estimate, estimate.float()], dim=-1)

    def remember(self, scores: torch.Tensor) -> torch.Tensor:
        """Raise each live entry's best score to ``scores`` (``[L, Hkv, T]``); return it."""
        self.best = torch.where(self.live, torch.maximum(self.best, scores.float()),
                                self.best)
        return self.best

    def keep_slots(self, token_idx: torch.Tensor) -> None:
        self.live = self.live.index_select(-1, token_idx)
        self.best = self.best.index_select(-1, token_idx)
        if self.estimate is not None:
            self.estimate = self.estimate.index_select(-1, token_idx)

    def copy(self) -> HeadLedger:
        return HeadLedger(layers=list(self.layers), live=self.live.clone(),
                          best=self.best.clone(), scales=dict(self.scales), shares=self.shares,
                          scorer=self.scorer,
                          estimate=None if self.estimate is None else self.estimate.clone())


def _head_scorer_for(model: Any, ref: str | None, layers: int, heads: int) -> HeadScorer:
    """The config's ``head_scorer``, or the one shipped under the model's name (its
    checkpoint folder's, lower-cased), checked against the model's shape."""
    name = ref or Path(str(model.config.name_or_path)).name.lower()
    if ref is None and name not in shipped_head_scorers():
        raise ConfigError("head_scorer", f"policy 'reconstruction' needs a head scorer; "
                          f"none is shipped for {name!r} (shipped: "
                          f"{', '.join(shipped_head_scorers()) or 'none'}): train one with "
                          "scripts/train_head_scorer.py and set head_scorer to its file")
    scorer = load_head_scorer(name)
    text = model.config.get_text_config(decoder=True)
    scorer.check_model(layers, int(text.hidden_size), heads, name)
    return scorer


@contextlib.contextmanager
def _attention_inputs(model: Any, layers: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """While the block runs: each of ``layers``' attention input (its input norm's output,
    ``[T, D]``) of the one forward inside, by layer index (empty for no layers)."""
    inputs: dict[int, torch.Tensor] = {}
    if not layers:
        yield inputs
        return
    decoder = model.get_decoder().layers

    def keep(li: int) -> Callable[..., None]:
        def hook(_module: Any, _args: Any, out: torch.Tensor) -> None:
            inputs[li] = out[0].detach()
        return hook

    handles = [decoder[li].input_layernorm.register_forward_hook(keep(li)) for li in layers]
    try:
        yield inputs
    finally:
        for h in handles:
            h.remove()


def _sliding_layers(cache: Any, model_config: Any, *, evicting: bool) -> list[bool]:
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
