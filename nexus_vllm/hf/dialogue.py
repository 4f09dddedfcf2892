"""Many requests over one growing token stream, as a server sees a conversation.

A multi-turn conversation reaches vLLM as one request per turn, each prompt the whole
conversation so far; every request streams its prompt from the start in ``chunk_size``
pieces with an eviction event after each (:func:`nexus_vllm.hf.generate_ids`). Requests
whose prompts share a prefix therefore share every event on the prefix's whole chunks, and
the state after them (cache, policy state, sampler generator) is the same. :func:`run_probes`
streams the stream's whole chunks once and branches each request off the state before its
last chunk, which gives exactly the per-request results of :func:`generate_ids` (tested)
at the cost of one pass.

A :class:`Probe` is one request: its prompt ``ids[:prompt_end]``, then optionally tokens
fed as the model's own output (``ids[prompt_end:forced_end]``, teacher-forced decode with
decode events, e.g. a long answer written before the fact is used), then the scored answer
``ids[forced_end:answer_end]``: greedy text for the string match, and teacher-forced
log-probabilities for the likelihood metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nexus_vllm.core import EvictionConfig
from nexus_vllm.hf.generate import greedy_ids, teacher_force
from nexus_vllm.hf.streaming import StreamingSession

__all__ = ["Probe", "ProbeResult", "run_probes"]


@dataclass(frozen=True)
class Probe:
    """One request over a token stream (indices into it, ``0 < prompt_end <= forced_end
    < answer_end``)."""

    prompt_end: int
    forced_end: int
    answer_end: int
    max_new_tokens: int

    def __post_init__(self) -> None:
        if not 0 < self.prompt_end <= self.forced_end < self.answer_end:
            raise ValueError(f"need 0 < prompt_end <= forced_end < answer_end, got {self}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class ProbeResult:
    """One probe's outputs."""

    ids: list[int]  # greedy ids after forced_end (stopping after an eos id)
    logprobs: torch.Tensor  # [n_answer, V] log-softmax at the positions predicting the answer
    targets: torch.Tensor  # LongTensor[n_answer], the answer ids
    cache_tokens: int  # tokens cached when the answer started
    events: int  # eviction events of this request before its answer

    @property
    def answer_loglik(self) -> float:
        """Sum of the answer tokens' log-probabilities (nats)."""
        return float(self.logprobs.gather(1, self.targets[:, None]).sum())


@torch.no_grad()
def run_probes(model: torch.nn.Module, ids: torch.Tensor, probes: list[Probe] | tuple[Probe, ...],
               config: EvictionConfig | None, *, chunk_size: int = 512, request_seed: int = 0,
               eos_token_ids: set[int] | None = None) -> list[ProbeResult]:
    """Run every probe over ``ids`` (LongTensor[L]) as its own request.

    Parameters
    ----------
    model
        A transformers causal LM (Llama family, or hybrid sliding-window such as Gemma 3).
    ids : LongTensor[L]
        The whole stream; each probe reads a prefix of it.
    probes
        Sorted by ``prompt_end`` (a later probe's prompt extends an earlier one's).
    config : EvictionConfig or None
        The eviction config of every request (None: dense). Its ``chunk_size`` chunks the
        prompts, as the server's scheduler does.
    chunk_size : int
        The prompt chunk without eviction (dense; its chunking changes nothing but
        rounding).
    request_seed : int
        Every request's seed (as a server request without a seed: 0).
    eos_token_ids : set[int], optional
        Greedy decoding stops after one of these.

    Returns
    -------
    list[ProbeResult], one per probe, in order.
    """
    if config is not None:
        chunk_size = config.chunk_size
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if any(b.prompt_end < a.prompt_end for a, b in zip(probes, probes[1:])):
        raise ValueError("probes must be sorted by prompt_end")
    if probes and probes[-1].answer_end > ids.numel():
        raise ValueError(f"a probe ends at {probes[-1].answer_end}, past the stream "
                         f"({ids.numel()} tokens)")
    device = next(model.parameters()).device
    ids = ids.to(device)
    eos = eos_token_ids or set()
    prefix = StreamingSession(model, config, request_seed=request_seed)
    fed = 0
    out: list[ProbeResult] = []
    for probe in probes:
        # The prefix holds only chunks before each request's last one: its events are
        # mid-prompt for every later request (prompt_mode "end" and "keep" evict
        # differently at a prompt's end), and the request computes its last chunk itself.
        whole = (probe.prompt_end - 1) // chunk_size * chunk_size
        while fed < whole:
            prefix.forward(ids[fed:fed + chunk_size], logits_to_keep=1)
            prefix.evict(prefill=True)
            fed += chunk_size
        req = prefix.clone()
        req.set_prompt_tokens(probe.prompt_end)
        logits = req.forward(ids[fed:probe.prompt_end], logits_to_keep=1)[-1]
        req.evict(prefill=True)
        if probe.forced_end > probe.prompt_end:
            # The model's own earlier output: fed as decode tokens, events as in decoding.
            pieces = teacher_force(req, ids[probe.prompt_end:probe.forced_end])
            logits = pieces[-1][-1]
        events = req.num_events
        cache_tokens = req.held_tokens
        greedy = greedy_ids(req.clone(), logits, probe.max_new_tokens, eos)
        answer = ids[probe.forced_end:probe.answer_end]
        # The last answer token predicts nothing scored: it is not fed.
        scored = [logits.unsqueeze(0), *teacher_force(req, answer[:-1])]
        lp = torch.log_softmax(torch.cat(scored).float().cpu(), dim=-1)
        out.append(ProbeResult(ids=greedy, logprobs=lp, targets=answer.cpu(),
                               cache_tokens=cache_tokens, events=events))
    return out
