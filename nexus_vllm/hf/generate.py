"""Greedy generation and teacher-forced scoring under streaming eviction.

The prompt ``preamble + context + question`` is tokenized as one string (exactly as
``tokenizer(preamble + context + question)``), split at the context/question boundary,
the preamble+context tokens are fed in chunks with an eviction event after each chunk, the
question tokens in one forward, and decoding evicts every ``interval`` tokens.

The config's ``prompt_mode`` decides which of those events evict: in ``stream`` mode the
context chunks' (the question is fed after the last context event, so no event sees
it); in ``end`` mode one event after the question (the prompt-end event, its window the
question's last tokens), plus the context chunks' under a ``prefill_budget``; in ``keep``
mode only decode events, over the generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload

import torch

from nexus_vllm.core import EvictionConfig
from nexus_vllm.hf.streaming import StreamingSession, make_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["PromptSplit", "PromptState", "SampleResult", "encode_prompt", "eos_ids",
           "finish_sample", "generate", "generate_ids", "greedy_ids", "greedy_text",
           "prefill_sample", "run_sample", "teacher_force"]


@dataclass(frozen=True)
class PromptSplit:
    """Token ids of one prompt and where its segments end."""

    ids: torch.Tensor  # LongTensor[L]
    n_context: int  # preamble + context tokens
    n_prompt: int  # + question tokens (== L when no answer was appended)


def _count_before(tokenizer: PreTrainedTokenizerBase, text: str, boundary: int) -> tuple[list[int], int]:
    """Token ids of ``text`` and how many start before character ``boundary``."""
    try:
        enc = tokenizer(text, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        offsets = enc["offset_mapping"]
        # Special tokens (e.g. a BOS) have (0, 0) offsets and belong to the head.
        n = sum(1 for s, e in offsets if s < boundary or (s == 0 and e == 0))
        return ids, n
    except (NotImplementedError, TypeError, ValueError):  # slow tokenizers lack offsets
        ids = list(tokenizer(text)["input_ids"])
        return ids, min(len(tokenizer(text[:boundary])["input_ids"]), len(ids))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, context: str, question: str, *, preamble: str = "",
                  answer: str | None = None) -> PromptSplit:
    """Tokenize ``preamble + context + question (+ answer)`` as one string and split it."""
    head = preamble + context
    full = head + question + (answer or "")
    ids, n_ctx = _count_before(tokenizer, full, len(head))
    if answer:
        _, n_prompt = _count_before(tokenizer, full, len(head) + len(question))
    else:
        n_prompt = len(ids)
    if n_ctx < 1 or n_prompt <= n_ctx:
        raise ValueError("context and question must each produce at least one token")
    return PromptSplit(torch.tensor(ids, dtype=torch.long), n_ctx, n_prompt)


def eos_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids that end greedy decoding: the generation config's and the tokenizer's."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return ids


def _prefill(session: StreamingSession, ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Feed ``ids`` in chunks, evicting after each; return the last token's logits ``[V]``."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    logits = None
    for start in range(0, ids.numel(), chunk_size):
        logits = session.forward(ids[start:start + chunk_size], logits_to_keep=1)
        session.evict(prefill=True)
    assert logits is not None
    return logits[-1]


def _prompt_end(session: StreamingSession) -> None:
    """The event after the question, the prompt's last piece (``end`` mode's prompt-end
    event). ``stream`` keeps its protocol: the question is fed after the last context
    event and no event follows it."""
    cfg = session.config
    if cfg is not None and cfg.prompt_mode != "stream":
        session.evict(prefill=True)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@overload
def generate(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, context: str,
             question: str, *, method: str, budget: float | int | None, chunk_size: int = ...,
             max_new_tokens: int = ..., seed: int = ..., preamble: str = ...,
             return_session: Literal[False] = ..., **knobs: object) -> str: ...


@overload
def generate(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, context: str,
             question: str, *, method: str, budget: float | int | None, chunk_size: int = ...,
             max_new_tokens: int = ..., seed: int = ..., preamble: str = ...,
             return_session: Literal[True], **knobs: object
             ) -> tuple[str, StreamingSession]: ...


@torch.no_grad()
def generate(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, context: str,
             question: str, *, method: str, budget: float | int | None, chunk_size: int = 512,
             max_new_tokens: int = 64, seed: int = 0, preamble: str = "",
             return_session: bool = False, **knobs: object
             ) -> str | tuple[str, StreamingSession]:
    """Greedy continuation of ``preamble + context + question`` under streaming eviction.

    Parameters
    ----------
    model, tokenizer
        A transformers causal LM (Llama family, or hybrid sliding-window such as Gemma 3)
        and its tokenizer.
    context, question : str
        The streamed context and the question fed after it.
    method : str
        ``"dense"`` or an eviction method (nexus, h2o, snapkv, tova, streaming, random, knorm).
    budget : float or int
        Float in (0, 1]: kept fraction of tokens seen; int: token count. Dense ignores it.
    chunk_size : int
        Prefill chunk (an eviction event follows each chunk).
    max_new_tokens : int
        Decode limit; generation also stops at an eos token.
    seed : int
        Seed of the stochastic samplers (``EvictionConfig.seed``).
    preamble : str
        Text before the context (question-first protocol), streamed with it.
    return_session : bool
        Also return the :class:`StreamingSession` (tests inspect its events).
    **knobs
        Other ``EvictionConfig`` fields (block_size, interval, window, sampler, ...).

    Returns
    -------
    str
        The decoded continuation (special tokens skipped); ``(str, session)`` when
        ``return_session``.
    """
    cfg = make_config(method, budget, chunk_size=chunk_size, seed=seed, **knobs) \
        if method not in ("dense", "none") else None
    split = encode_prompt(tokenizer, context, question, preamble=preamble)
    ids = split.ids.to(_device_of(model))
    session = StreamingSession(model, cfg, record_events=return_session,
                               prompt_tokens=split.n_prompt)
    _prefill(session, ids[: split.n_context], chunk_size)
    logits = session.forward(ids[split.n_context:], logits_to_keep=1)[-1]
    _prompt_end(session)
    text = _decode_greedy(session, tokenizer, logits, max_new_tokens)
    return (text, session) if return_session else text


def greedy_ids(session: StreamingSession, logits: torch.Tensor, max_new_tokens: int,
               eos: set[int], *, decode_events: bool = True) -> list[int]:
    """The greedy decode loop: up to ``max_new_tokens`` argmax tokens from ``logits``
    (``[V]``, predicting the first) on, stopping after a token in ``eos``. Each token but
    the last is fed to ``session``, followed by its decode-event clock
    (:meth:`StreamingSession.decode_step_done`) unless ``decode_events`` is False (a
    decode with no events, e.g. a dense continuation or answer tokens decoded before a
    deferred event)."""
    out: list[int] = []
    device = _device_of(session.model)
    for step in range(max_new_tokens):
        tok = int(torch.argmax(logits))
        out.append(tok)
        if tok in eos or step == max_new_tokens - 1:
            break
        logits = session.forward(torch.tensor([tok], device=device), logits_to_keep=1)[-1]
        if decode_events:
            session.decode_step_done()
    return out


def teacher_force(session: StreamingSession, ids: torch.Tensor) -> list[torch.Tensor]:
    """Feed ``ids`` (LongTensor[n]) as decoded tokens; return the logits of each piece
    (``[piece, V]`` each, ``n`` rows in all).

    Each piece ends at the first token after which a decode event would be due
    (:meth:`StreamingSession.decode_tokens_before_event`), so the cache states are those
    of decoding the same tokens one at a time, in far fewer forwards.
    """
    out: list[torch.Tensor] = []
    start = 0
    while start < ids.numel():
        step = session.decode_tokens_before_event(ids.numel() - start)
        out.append(session.forward(ids[start:start + step], logits_to_keep=0))
        session.decode_step_done(step)
        start += step
    return out


def _decode_greedy(session: StreamingSession, tokenizer: PreTrainedTokenizerBase, logits: torch.Tensor,
                   max_new_tokens: int) -> str:
    out = greedy_ids(session, logits, max_new_tokens, eos_ids(session.model, tokenizer))
    return str(tokenizer.decode(out, skip_special_tokens=True))


@torch.no_grad()
def generate_ids(model: torch.nn.Module, prompt_ids: list[int], config: EvictionConfig | None, *,
                 max_new_tokens: int, request_seed: int = 0,
                 eos_token_ids: set[int] | None = None) -> tuple[list[int], StreamingSession]:
    """Greedy token ids for ``prompt_ids`` exactly as the vLLM plugin streams them.

    The whole prompt is fed in ``config.chunk_size`` pieces with an event after each (as
    vLLM's scheduler chunks an evicting prompt), then decoding follows the plugin's event
    rule, with the per-request generator seeded like the server's (``request_seed`` is
    the request's sampling seed, 0 when it has none). So, for the same model weights and
    config, both paths evict the same blocks at the same steps.

    Returns
    -------
    (list[int], StreamingSession)
        The generated ids (stopping after an id in ``eos_token_ids``), and the session.
    """
    session = StreamingSession(model, config, request_seed=request_seed, record_events=True,
                               prompt_tokens=len(prompt_ids))
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=_device_of(model))
    chunk = config.chunk_size if config is not None else max(1, ids.numel())
    logits = _prefill(session, ids, chunk)
    return greedy_ids(session, logits, max_new_tokens, eos_token_ids or set()), session


@dataclass(frozen=True)
class SampleResult:
    """Outputs of one streamed sample: the greedy answer and teacher-forced log-probs."""

    text: str
    # log-softmax [P, V] at the positions predicting each question and answer token
    logprobs: torch.Tensor
    targets: torch.Tensor  # LongTensor[P], the predicted tokens
    n_answer: int  # the last n_answer targets are the reference answer's tokens
    cache_tokens: int  # tokens cached when decoding started
    events: int  # eviction events during the prefill

    @property
    def answer_loglik(self) -> float:
        """Sum of the reference answer tokens' log-probabilities."""
        lp = self.logprobs[-self.n_answer:].gather(1, self.targets[-self.n_answer:, None])
        return float(lp.sum())


@dataclass(frozen=True)
class PromptState:
    """A sample after its prompt (context, then question): the session, and the logits of
    the question's tokens, before the prompt-end event."""

    session: StreamingSession
    split: PromptSplit
    ids: torch.Tensor  # LongTensor[L]: prompt and reference answer
    last_ctx: torch.Tensor  # [V], the logits after the context (predicting the question)
    q_logits: torch.Tensor  # [n_question, V]

    def fork(self, config: EvictionConfig, *, seed: int) -> PromptState:
        """This dense prompt state as a run under ``config`` would have reached it:
        exact for ``end`` without ``prefill_budget`` and for ``keep`` (no event before the
        prompt's end), so those runs skip their prefill (``StreamingSession.with_config``).
        """
        cfg = config.replace(seed=seed)
        return PromptState(self.session.with_config(cfg), self.split, self.ids,
                           self.last_ctx, self.q_logits)


@torch.no_grad()
def prefill_sample(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, context: str, question: str, answer: str, *,
                   config: EvictionConfig | None, chunk_size: int = 512, preamble: str = "",
                   capture_rows: int = 0) -> PromptState:
    """Stream ``preamble + context`` in chunks (an event after each), then the question in
    one forward; no prompt-end event yet (:func:`finish_sample` fires it)."""
    split = encode_prompt(tokenizer, context, question, preamble=preamble, answer=answer)
    ids = split.ids.to(_device_of(model))
    session = StreamingSession(model, config, prompt_tokens=split.n_prompt,
                               capture_rows=capture_rows)
    last_ctx = _prefill(session, ids[: split.n_context], chunk_size)
    q_logits = session.forward(ids[split.n_context: split.n_prompt], logits_to_keep=0)
    return PromptState(session, split, ids, last_ctx, q_logits)


@torch.no_grad()
def greedy_text(state: PromptState, tokenizer: PreTrainedTokenizerBase, *, max_new_tokens: int) -> str:
    """The prompt-end event (``end`` mode), then greedy generation only (no reference to
    teacher-force). ``state``'s session is consumed."""
    _prompt_end(state.session)
    return _decode_greedy(state.session, tokenizer, state.q_logits[-1], max_new_tokens)


@torch.no_grad()
def finish_sample(state: PromptState, tokenizer: PreTrainedTokenizerBase, *, max_new_tokens: int) -> SampleResult:
    """The prompt-end event (``end`` mode), then two branches: greedy generation and
    teacher forcing of the reference answer (:func:`teacher_force`, the cache states
    greedy decoding would have had). ``state``'s session is consumed."""
    session, split, ids = state.session, state.split, state.ids
    _prompt_end(session)
    prefill_events = session.num_events
    cache_tokens = session.held_tokens
    forced = session.clone()
    text = _decode_greedy(session, tokenizer, state.q_logits[-1], max_new_tokens)

    answer_ids = ids[split.n_prompt:]
    # The last answer token predicts nothing we score, so it is not fed.
    pieces = [state.last_ctx.unsqueeze(0), state.q_logits,
              *teacher_force(forced, answer_ids[:-1])]
    logits = torch.cat(pieces)  # [P, V]
    targets = ids[split.n_context:].cpu()
    return SampleResult(
        text=text, logprobs=torch.log_softmax(logits.float().cpu(), dim=-1), targets=targets,
        n_answer=int(answer_ids.numel()), cache_tokens=cache_tokens, events=prefill_events,
    )


@torch.no_grad()
def run_sample(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, context: str, question: str, answer: str, *,
               method: str, budget: float | int | None, chunk_size: int = 512,
               max_new_tokens: int = 64, seed: int = 0, preamble: str = "",
               **knobs: object) -> SampleResult:
    """One prefill (:func:`prefill_sample`), the prompt-end event in ``end`` mode, then
    branch: greedy generation and teacher forcing of ``answer`` (:func:`finish_sample`)."""
    cfg = make_config(method, budget, chunk_size=chunk_size, seed=seed, **knobs) \
        if method not in ("dense", "none") else None
    state = prefill_sample(model, tokenizer, context, question, answer, config=cfg,
                           chunk_size=chunk_size, preamble=preamble)
    return finish_sample(state, tokenizer, max_new_tokens=max_new_tokens)
