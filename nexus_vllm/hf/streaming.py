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

Hybrid models (Gemma 3): only the full-attention layers are evicted and scored
(:func:`~nexus_vllm.hf.capture.sliding_layers`). Queries come through transformers'
attention hook (:mod:`nexus_vllm.hf.capture`); head granularity's bookkeeping is a
:class:`~nexus_vllm.hf.heads.HeadLedger`; each event's policy is resolved once per
session (:class:`~nexus_vllm.core.event_policies.EventPolicies`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, cast

import torch

from nexus_vllm.core import (
    EvictionConfig,
    EvictionPolicy,
    EvictionTrigger,
    Evidence,
    Rotary,
    evidence_kind,
    num_blocks_for,
)
from nexus_vllm.core.budget import evicts_mid_prompt, target_blocks
from nexus_vllm.core.event_policies import EventPolicies
from nexus_vllm.core.evidence import DenseLayer, DenseSequence
from nexus_vllm.core.head_paged import HeadEvidence, head_tokens_held
from nexus_vllm.core.policies import PolicyState
from nexus_vllm.hf.capture import (
    CAPTURE_ATTENTION,
    CAPTURE_ATTENTION_SINKS,
    attention_inputs,
    has_attention_sinks,
    rotary_of,
    sliding_layers,
    use_capture_attention,
    with_head_mask,
)
from nexus_vllm.hf.events import EvictionEvent, make_config
from nexus_vllm.hf.heads import HeadLedger
from nexus_vllm.hf.mla import is_mla_attention, latent_keys, latent_rotary

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# The capture hook's names are re-exported: callers import them from here.
__all__ = ["CAPTURE_ATTENTION", "CAPTURE_ATTENTION_SINKS", "EvictionEvent", "HeadEvidence",
           "StreamingSession", "has_attention_sinks", "make_config", "rotary_of",
           "use_capture_attention", "with_head_mask"]

# Rows of a rotary table for a config without max_position_embeddings.
_ROTARY_ROWS = 1 << 15
# A prompt length no stream reaches: the prompt has not ended yet.
_UNKNOWN = 1 << 62


class StreamingSession:
    """One sequence streamed through ``model`` with block eviction under a budget.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A decoder-only Llama-family model (attention modules with ``layer_idx``), or a
        hybrid one (Gemma 3): only its full-attention layers are evicted and scored.
    config : EvictionConfig or None
        ``None`` keeps everything (dense).
    request_seed : int
        Mixed with ``config.seed`` into the per-request generator.
    record_events : bool
        Keep an :class:`EvictionEvent` per event in ``self.events`` (tests, statistics).
    prompt_tokens : int, optional
        The prompt's length (``prompt_mode`` ``end`` and ``keep`` read it); None: every
        token fed counts as prompt until :meth:`set_prompt_tokens`.
    capture_rows : int
        Query rows to keep per layer besides what ``config`` scores (a dense session that
        :meth:`with_config` later turns into an evicting one).
    """

    def __init__(self, model: torch.nn.Module, config: EvictionConfig | None, *, request_seed: int = 0,
                 record_events: bool = False, prompt_tokens: int | None = None,
                 capture_rows: int = 0) -> None:
        from transformers import DynamicCache

        # A transformers causal LM, whatever the caller holds it as.
        self.model = cast("PreTrainedModel", model)
        use_capture_attention(self.model)
        model = self.model
        self.config = config
        # Untyped: transformers types a cache layer as a union with linear-attention
        # layers (no keys), which sliding_layers refuses here.
        self.cache: Any = DynamicCache(config=model.config)
        self.num_layers = int(model.config.num_hidden_layers)
        # Which cache layers are sliding-window ones (transformers' own window cache, never
        # evicted) and which attend fully (evicted, scored, counted by the budget).
        self._sliding = sliding_layers(self.cache, model.config, evicting=config is not None)
        self._full = [i for i, s in enumerate(self._sliding) if not s]
        self.seen = 0
        self.positions = torch.empty(0, dtype=torch.long)
        self.state: PolicyState = {}
        self.generator = config.generator(request_seed) if config is not None else None
        self.events: list[EvictionEvent] = []
        self.record_events = record_events
        self.num_events = 0
        # The vLLM plugin's rule for when events fire (nexus_vllm.core.trigger).
        self.trigger = EvictionTrigger(config, _UNKNOWN if prompt_tokens is None
                                       else int(prompt_tokens))
        # Each event kind's policy, resolved again once the prompt's length is known.
        self.policies: EventPolicies | None = (
            config.event_policies(self.prompt_tokens) if config is not None else None)
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
            assert self.policies is not None
            self._heads = HeadLedger.start(model, self._full, self._latent, config,
                                           self.policies)

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
        with attention_inputs(self.model, self._full if scorer is not None else []) as inputs:
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache,
                             use_cache=True, logits_to_keep=logits_to_keep,
                             nexus_capture=self._record_queries)
        self.seen += n
        self.positions = torch.cat([self.positions, pos[0].cpu()])
        if self._heads is not None:
            self._heads.append(n, None if scorer is None else torch.stack(
                [scorer.score(i, inputs[li]).cpu() for i, li in enumerate(self._full)]))
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
        if self.config is not None:
            self.policies = self.config.event_policies(self.prompt_tokens)

    def evict(self, *, prefill: bool = True) -> bool:
        """After a prompt chunk: run one eviction event if the trigger says so (the
        sequence holds more than its target, :func:`~nexus_vllm.core.budget.target_blocks`); return
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
                           budget_blocks=target_blocks(cfg, self.seen, self.prompt_tokens))

    def _event(self, *, prefill: bool, n_blocks: int, budget_blocks: int) -> bool:
        cfg = self.config
        assert cfg is not None and self.policies is not None
        b = cfg.block_size
        prompt_end = self.trigger.ends_prompt(prefill)
        policy = self.policies.at(prefill=prefill, prompt_end=prompt_end)
        window = policy.window(cfg.prompt_window if prefill else cfg.window)
        if self._heads is not None:
            return self._head_event(policy, window, prefill=prefill, n_blocks=n_blocks,
                                    budget_blocks=budget_blocks, prompt_end=prompt_end)
        gathered = self.gather(policy.needs, window) if policy.needs else {}
        evidence = Evidence.from_gathered(gathered, attention_reduce=cfg.attention_reduce,
                                          num_blocks=n_blocks)
        live_blocks = self.positions[::b] // b if self.record_events else None
        keep = policy.select(evidence, budget_blocks, generator=self.generator, state=self.state)
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
        (:meth:`HeadLedger.evidence`), from the newest ``window`` query rows."""
        assert self._heads is not None
        rows, keys = [], []
        for li in self._full:
            q = self._queries[li]
            if q is None:
                raise RuntimeError("no queries recorded yet: feed tokens before evicting")
            rows.append(q[:, -window:].transpose(0, 1))  # [W, Hq, D]
            keys.append(self.cache.layers[li].keys[0].transpose(0, 1))  # [T, Hkv, D]
        rotary = self.rotary() if "expected_attention" in kinds else None
        return self._heads.evidence(kinds, rows, keys, self.seen, rotary)

    def _head_event(self, policy: EvictionPolicy, window: int, *, prefill: bool, n_blocks: int,
                    budget_blocks: int, prompt_end: bool) -> bool:
        """One event at head granularity: score every live (layer, KV head, token) unit,
        keep by one threshold within ``budget_blocks`` x layers x KV heads head-blocks,
        then drop the cache slots no head holds any more."""
        cfg = self.config
        heads = self._heads
        assert cfg is not None and heads is not None
        evidence = self.head_evidence(policy.head_needs, window)
        keep = heads.select(policy, evidence, self.positions, self.seen, budget_blocks,
                            cfg, self.generator)
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
                        budget_blocks=target_blocks(cfg, self.seen, self.prompt_tokens))

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
        if evicts_mid_prompt(config):
            raise ValueError("a dense prefix equals an evicting one only in prompt_mode "
                             "'end' without prefill_budget, or 'keep'")
        # What an evicting session refuses at construction (no full-attention layer, ...).
        sliding_layers(self.cache, self.model.config, evicting=True)
        need = max(config.window, config.prompt_window)
        if self._query_keep < need:
            raise ValueError(f"this session kept {self._query_keep} query rows; the config "
                             f"scores {need}")
        other = self.clone()
        other.config = config
        other.generator = config.generator(request_seed)
        other.state = {}
        other.trigger = EvictionTrigger(config, self.prompt_tokens)
        other.policies = config.event_policies(self.prompt_tokens)
        if config.granularity == "head":
            other._heads = HeadLedger.after_dense(self.model, self._full, self._latent,
                                                  config, other.policies, self.cache_len)
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


