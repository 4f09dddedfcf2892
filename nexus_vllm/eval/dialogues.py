"""Task families where one stream runs through many eviction events.

The RULER-style tasks (:mod:`nexus_vllm.eval.tasks`) end a few events after the facts are
read. These families keep a stream going and need facts now and then:

``multiturn``
    A chat. The first user message states four facts (special magic numbers, each in a
    few sentences of prose); then six turns, each a user message of new prose ending in a
    question about one fact, and the assistant's answer. The first four turns ask every
    fact once in a random order; turns five and six ask again the two facts asked first,
    after the longest gaps. Every turn is scored.
``longgen``
    One request: the user states four facts and asks for a long essay that ends with one
    of them; the essay (real prose) is the model's output, fed token by token with decode
    events, and the fact after it is scored.
``chat_multiturn``
    ``multiturn`` in the chat shape: each turn's request ends at the assistant's header,
    with no answer prefix, and the whole answer ("The special magic number for KEY is
    VALUE.") is scored and teacher-forced.

Both are served the way vLLM serves them: a turn is a request whose prompt is the whole
conversation so far, streamed in chunks (:func:`nexus_vllm.hf.dialogue.run_probes`); the
earlier answers in the history are the references (the same history for every method).
A long generation cannot be teacher-forced through a server, so ``longgen`` is
transformers-path only; a ``multiturn`` turn is an ordinary completion request.

Every generator is a pure function of ``(task, seed, index, target_tokens, tokenizer)``;
the prose per turn (or the essay) is the largest that keeps the conversation plus one
answer's decode within ``target_tokens``.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nexus_vllm.eval.task_bodies import _key, _number, _prose
from nexus_vllm.eval.tasks import string_match_all
from nexus_vllm.hf.dialogue import Probe

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["DIALOGUE_TASKS", "Dialogue", "Turn", "dialogue_protocol", "make_dialogue"]

DIALOGUE_TASKS = ("multiturn", "longgen", "chat_multiturn")
_FACTS = 4
_TURNS = 6
_ANSWER_TOKENS = 16  # greedy decode limit per answer: 7 digits and a period, with room
_CHAT_ANSWER_TOKENS = 32  # the chat shape's answer restates the question first
_FACT_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Memorize them: I "
    "will ask you about them later.")


@dataclass(frozen=True)
class Turn:
    """One scored request: its probe over the stream and its reference."""

    probe: Probe
    key: str
    answers: tuple[str, ...]
    target: str  # the reference answer text (teacher-forced)
    gap: int  # tokens from the end of the fact's last mention to the answer
    # The request as chat messages (the conversation up to this turn's question), for a
    # chat API; empty where the prompt is completion-shaped.
    messages: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True)
class Dialogue:
    """One generated stream and its scored turns."""

    task: str
    index: int
    seed: int
    ids: tuple[int, ...]  # the whole stream, references included
    turns: tuple[Turn, ...]
    text: str  # ``ids`` decoded from this text (the chat template applied)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def score(self, turn: int, prediction: str) -> float:
        """String match (every reference found) of ``prediction`` for turn ``turn``."""
        return string_match_all(prediction, self.turns[turn].answers)


def dialogue_protocol(task: str) -> str:
    """The protocol a family's records carry: ``chat`` for the chat-shaped ones (their
    requests end at the assistant's header), else ``question-last``."""
    return "chat" if task.startswith("chat_") else "question-last"


def _fact(key: str, value: str) -> str:
    return f"The special magic number for {key} is: {value}."


def _answer_prefix(key: str) -> str:
    return f"The special magic number for {key} is"


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], *, open_turn: bool) -> str:
    """The chat template applied to ``messages`` (a plain User/Assistant format without
    one); ``open_turn`` ends with the assistant's header, ready for its message."""
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=open_turn))
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
    return text + ("Assistant: " if open_turn else "")


def _token_starts(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[list[int], list[int]]:
    """Ids of ``text`` and each token's start character (special tokens: where they sit)."""
    try:
        enc = tokenizer(text, return_offsets_mapping=True)
        return list(enc["input_ids"]), [s for s, _ in enc["offset_mapping"]]
    except (NotImplementedError, TypeError, ValueError):  # slow tokenizers lack offsets
        ids = list(tokenizer(text)["input_ids"])
        # Token i starts where the decoded prefix of i tokens ends (byte-level tokenizers).
        return ids, [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]


class _Stream:
    """A rendered conversation: its ids, and token indices of character boundaries."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, text: str) -> None:
        self.text = text
        self.ids, self._starts = _token_starts(tokenizer, text)

    def tokens_before(self, char: int) -> int:
        """Tokens that start before character ``char``."""
        return bisect.bisect_left(self._starts, char)


@dataclass(frozen=True)
class _Ask:
    """A question of the script: the fact it asks and where things are (characters)."""

    key: str
    value: str
    request_end: int  # the request's prompt ends here (the model writes from here on)
    answer_start: int  # the scored answer starts here (after any text of the model's own)
    mentioned_end: int  # where the fact was last written before this question
    target: str  # the scored answer's text (from answer_start)
    messages: tuple[dict[str, str], ...] = ()  # the request, chat-shaped ones only


def _facts_message(rng: random.Random) -> tuple[str, dict[str, str]]:
    used: set[str] = set()
    facts = {_key(rng, used): _number(rng) for _ in range(_FACTS)}
    # Two sentences before each fact, so that each lands in its own block or two.
    parts: list[str] = []
    prose = _prose(random.Random(rng.getrandbits(64)), 2 * _FACTS + 2)
    for i, (key, value) in enumerate(facts.items()):
        parts += prose[2 * i:2 * i + 2] + [_fact(key, value)]
    parts += prose[2 * _FACTS:]
    return _FACT_INSTRUCTION + "\n\n" + " ".join(parts), facts


def _multiturn(rng: random.Random, tokenizer: PreTrainedTokenizerBase, units: int, *, chat: bool = False
               ) -> tuple[str, list[_Ask]]:
    opening, facts = _facts_message(rng)
    keys = list(facts)
    order = list(keys)
    rng.shuffle(order)
    order += order[:_TURNS - _FACTS]  # asked again, after the longest gaps
    prose = _prose(random.Random(rng.getrandbits(64)), units * _TURNS)
    messages = [{"role": "user", "content": opening}]
    text = _render(tokenizer, messages, open_turn=False)
    last_mention = {k: text.index(_fact(k, v)) + len(_fact(k, v)) for k, v in facts.items()}
    asks: list[_Ask] = []
    for t, key in enumerate(order):
        material = " ".join(prose[t * units:(t + 1) * units])
        question = f"What is the special magic number for {key}?"
        messages.append({"role": "user", "content": f"{material}\n\nQuestion: {question}"})
        request = tuple(dict(m) for m in messages) if chat else ()
        # The completion shape starts the answer in the prompt; the chat shape does not.
        prompt = _render(tokenizer, messages, open_turn=True) \
            + ("" if chat else _answer_prefix(key))
        answer = f"{_answer_prefix(key)} {facts[key]}."
        messages.append({"role": "assistant", "content": answer})
        full = _render(tokenizer, messages, open_turn=False)
        if not full.startswith(prompt):
            raise ValueError("the chat template does not render a turn's prompt as a prefix "
                             "of the conversation; multi-turn streams need it to")
        target = answer if chat else f" {facts[key]}."
        asks.append(_Ask(key, facts[key], len(prompt), len(prompt), last_mention[key],
                         target, request))
        last_mention[key] = len(prompt) + len(target)
    return _render(tokenizer, messages, open_turn=False), asks


def _longgen(rng: random.Random, tokenizer: PreTrainedTokenizerBase, units: int) -> tuple[str, list[_Ask]]:
    opening, facts = _facts_message(rng)
    key = rng.choice(list(facts))
    request = (f"{opening}\n\nNow write a long essay about how good ideas are found, in the "
               f"style of the text above. End it with the special magic number for {key}.")
    essay = " ".join(_prose(random.Random(rng.getrandbits(64)), units))
    messages = [{"role": "user", "content": request}]
    prompt = _render(tokenizer, messages, open_turn=True)
    forced = f"{essay} {_answer_prefix(key)}"
    messages.append({"role": "assistant", "content": f"{forced} {facts[key]}."})
    full = _render(tokenizer, messages, open_turn=False)
    if not full.startswith(prompt + forced):
        raise ValueError("the chat template does not render the request as a prefix of the "
                         "conversation; long-generation streams need it to")
    mention = full.index(_fact(key, facts[key])) + len(_fact(key, facts[key]))
    return full, [_Ask(key, facts[key], len(prompt), len(prompt) + len(forced), mention,
                       f" {facts[key]}.")]


def _chat_multiturn(rng: random.Random, tokenizer: PreTrainedTokenizerBase, units: int
                    ) -> tuple[str, list[_Ask]]:
    return _multiturn(rng, tokenizer, units, chat=True)


_BUILDERS = {"multiturn": (_multiturn, 2), "longgen": (_longgen, 8),
             "chat_multiturn": (_chat_multiturn, 2)}


def _build(task: str, seed: int, index: int, tokenizer: PreTrainedTokenizerBase, units: int
           ) -> tuple[_Stream, list[_Ask]]:
    # A chat-shaped family draws the same script as its completion-shaped one.
    rng = random.Random(f"{task.removeprefix('chat_')}|{seed}|{index}")
    text, asks = _BUILDERS[task][0](rng, tokenizer, units)
    return _Stream(tokenizer, text), asks


def make_dialogue(task: str, *, seed: int, index: int, target_tokens: int,
                  tokenizer: PreTrainedTokenizerBase) -> Dialogue:
    """Generate stream ``index`` of ``task`` for ``seed``, fitted to ``target_tokens``.

    The whole stream plus one answer's decode limit fits ``target_tokens``; the prose per
    turn (multiturn) or the essay (longgen) is the largest that does (binary search).
    """
    if task not in DIALOGUE_TASKS:
        raise ValueError(f"task must be one of {DIALOGUE_TASKS}, got {task!r}")
    answer_tokens = _CHAT_ANSWER_TOKENS if dialogue_protocol(task) == "chat" else _ANSWER_TOKENS
    limit = target_tokens - answer_tokens
    lo = _BUILDERS[task][1]

    def size(units: int) -> int:
        return len(_build(task, seed, index, tokenizer, units)[0].ids)

    if size(lo) > limit:
        raise ValueError(f"target_tokens={target_tokens} is too small for task {task!r}")
    hi = lo * 2
    while size(hi) <= limit:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # size(lo) <= limit < size(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= limit else (lo, mid)
    stream, asks = _build(task, seed, index, tokenizer, lo)
    turns = []
    for ask in asks:
        prompt_end = stream.tokens_before(ask.request_end)
        forced_end = stream.tokens_before(ask.answer_start)
        answer_end = stream.tokens_before(ask.answer_start + len(ask.target))
        probe = Probe(prompt_end=prompt_end, forced_end=forced_end, answer_end=answer_end,
                      max_new_tokens=answer_tokens)
        gap = forced_end - stream.tokens_before(ask.mentioned_end)
        turns.append(Turn(probe=probe, key=ask.key, answers=(ask.value,), target=ask.target,
                          gap=gap, messages=ask.messages))
    return Dialogue(task=task, index=index, seed=seed, ids=tuple(stream.ids),
                    turns=tuple(turns), text=stream.text)
