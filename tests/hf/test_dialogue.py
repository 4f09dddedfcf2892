"""Teacher-forced decoding and many requests over one stream, on a tiny random Llama.

Both shortcuts must be invisible: teacher forcing in pieces equals decoding one token at a
time (same events at the same tokens, same logits), and branching requests off a shared
prefix equals streaming each request from the start (:func:`generate_ids`, the path that
matches the server token for token).
"""

from __future__ import annotations

import pytest
import torch

from nexus_vllm.core import Evidence
from nexus_vllm.hf import StreamingSession, generate_ids, make_config
from nexus_vllm.hf.dialogue import Probe, run_probes
from nexus_vllm.hf.generate import teacher_force

torch.set_num_threads(1)

TEXT = ("Facts first: the magic number for the red kite is 4815162. Then a long stream of "
        "prose follows, turn after turn, about rivers, hills and the people who walk them. ")
# (method, budget, knobs): ratio and token budgets; an interval longer than a block, where
# the decode hard limit (the target plus the blocks one interval crosses) fires events
# before the interval has passed whenever a boundary comes early.
CONFIGS = [
    ("nexus", 0.3, {"interval": 4}),
    ("h2o", 160, {"interval": 4}),
    ("tova", 160, {"interval": 12}),
]
# The streaming setting: a conversation's prompt chunks each followed by an event.
BASE = {"block_size": 8, "recent_blocks": 2, "window": 4, "prompt_window": 8,
        "skip_layers": 1, "chunk_size": 48, "prompt_mode": "stream"}


def _ids(tok, repeats: int) -> torch.Tensor:
    return torch.tensor(tok(TEXT * repeats)["input_ids"], dtype=torch.long)


def _streamed(model, cfg, prompt: torch.Tensor) -> tuple[StreamingSession, torch.Tensor]:
    session = StreamingSession(model, cfg, record_events=True, prompt_tokens=prompt.numel())
    logits = None
    for start in range(0, prompt.numel(), cfg.chunk_size):
        logits = session.forward(prompt[start:start + cfg.chunk_size])[-1]
        session.evict(prefill=True)
    assert logits is not None
    return session, logits


@pytest.mark.parametrize(("method", "budget", "knobs"), CONFIGS)
def test_teacher_force_equals_one_token_at_a_time(model, tok, method, budget, knobs) -> None:
    cfg = make_config(method, budget, **{**BASE, **knobs})
    ids = _ids(tok, 4)
    prompt, forced = ids[:200], ids[200:]
    a, _ = _streamed(model, cfg, prompt)
    b, _ = _streamed(model, cfg, prompt)
    pieces = teacher_force(a, forced)
    rows = []
    for t in forced:
        rows.append(b.forward(t[None], logits_to_keep=0))
        b.decode_step_done()
    assert len(pieces) < forced.numel() // 4, "pieces must batch many tokens"
    assert [e.seen for e in a.events] == [e.seen for e in b.events]
    assert sum(not e.prefill for e in b.events) >= 3, "the forced text must cross events"
    assert torch.equal(a.positions, b.positions)
    torch.testing.assert_close(torch.cat(pieces), torch.cat(rows), atol=2e-4, rtol=1e-4)


# (method, prompt_mode knobs): every mode's requests branch off the shared prefix.
PROBE_CONFIGS = [
    ("dense", {}),
    ("nexus", {}),
    ("h2o", {}),
    ("nexus", {"prompt_mode": "end"}),
    ("snapkv", {"prompt_mode": "end", "prefill_budget": 96}),
    ("h2o", {"prompt_mode": "keep"}),
]


@pytest.mark.parametrize(("method", "mode"), PROBE_CONFIGS)
def test_probes_equal_one_request_each(model, tok, method: str, mode: dict) -> None:
    ids = _ids(tok, 4)
    # Prompts ending inside a chunk, on a chunk boundary, twice in the same chunk; one
    # probe with forced model output before its answer.
    probes = [Probe(100, 100, 108, 6), Probe(144, 144, 150, 6), Probe(150, 150, 156, 5),
              Probe(230, 300, 310, 6)]
    cfg = None if method == "dense" else make_config(method, 0.3, **{**BASE, **mode})
    got = run_probes(model, ids, probes, cfg, chunk_size=48)
    for probe, res in zip(probes, got):
        if probe.forced_end == probe.prompt_end:
            ref_ids, session = generate_ids(model, ids[:probe.prompt_end].tolist(), cfg,
                                            max_new_tokens=probe.max_new_tokens)
            assert res.ids == ref_ids
            assert res.events == len(session.events)
        # The answer's log-probs: the request streamed from the start, then teacher forced.
        if cfg is None:
            with torch.no_grad():
                full = model(input_ids=ids[None, :probe.answer_end]).logits[0].float()
            ref = full[probe.forced_end - 1:probe.answer_end - 1].log_softmax(-1)
        else:
            s, last = _streamed(model, cfg, ids[:probe.prompt_end])
            if probe.forced_end > probe.prompt_end:
                last = teacher_force(s, ids[probe.prompt_end:probe.forced_end])[-1][-1]
            rest = teacher_force(s, ids[probe.forced_end:probe.answer_end - 1])
            ref = torch.cat([last[None], *rest]).log_softmax(-1)
        torch.testing.assert_close(res.logprobs, ref, atol=2e-4, rtol=1e-4)
        assert torch.equal(res.targets, ids[probe.forced_end:probe.answer_end])
        assert res.answer_loglik < 0
    if cfg is not None and cfg.prompt_mode == "keep":  # events only over generated tokens
        assert got[-1].events > got[0].events == 0
    elif cfg is not None:
        assert got[-1].events > got[0].events > 0


def test_probe_and_run_probes_reject_bad_input(model, tok) -> None:
    with pytest.raises(ValueError, match="prompt_end"):
        Probe(10, 5, 12, 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Probe(10, 10, 12, 0)
    ids = _ids(tok, 1)
    with pytest.raises(ValueError, match="sorted"):
        run_probes(model, ids, [Probe(50, 50, 52, 2), Probe(40, 40, 42, 2)], None)
    with pytest.raises(ValueError, match="past the stream"):
        run_probes(model, ids, [Probe(50, 50, ids.numel() + 1, 2)], None)


def test_only_the_event_after_the_prompts_last_token_is_the_prompt_end_one(model, tok) -> None:
    """In ``stream`` the prompt's last chunk is followed by the prompt-end event (the one
    that sees the question; the prompt-end defaults: top-K on each block's best row), the
    chunks before it by prefill events."""
    cfg = make_config("nexus", 64, **BASE)
    prompt = _ids(tok, 4)[:200]
    session, _ = _streamed(model, cfg, prompt)
    flags = [(ev.seen, ev.prompt_end) for ev in session.events]
    assert len(flags) >= 3 and flags[-1] == (200, True)
    assert not any(end for _, end in flags[:-1])
    last = cfg.event_policies().prompt_end
    assert (last.direct, last.indirect, last.sampler) == ("max", "none", "topk")
    # The event kept exactly what that policy picks from what it gathered.
    ev = session.events[-1]
    assert ev.live_blocks is not None
    evidence = Evidence.from_gathered(ev.gathered, attention_reduce=cfg.attention_reduce,
                                      num_blocks=len(ev.live_blocks))
    keep = last.select(evidence, ev.budget_blocks)
    kept = sorted(set((ev.kept_positions // cfg.block_size).tolist()))
    assert kept == ev.live_blocks[keep].tolist()
