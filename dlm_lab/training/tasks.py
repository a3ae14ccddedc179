"""Seeded generator of chat tasks whose answers can be checked exactly.

The embedded model is trained and scored on these: multi-digit addition and subtraction,
sorting a list of numbers or letters, reversing a word, counting letters and copying a
phrase, each asked several natural ways. Answers are bare (`"6912"`, `"3, 12, 45"`) so exact
match is the score. Every problem has a canonical `key`; a stable hash of it decides once and
for all whether the problem is held out, so test questions never occur in training, whatever
the phrasing or the seed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

HELDOUT_PER_MILLE = 50  # 5% of all problems are reserved for evaluation
MAX_ANSWER_CHARS = 31  # answer + <|eot_id|> fit a 32-token canvas

# Common short English words (written out here, not taken from any corpus) for reversal,
# counting and phrases; random pseudo-words are mixed in so the skills generalise.
WORDS: tuple[str, ...] = tuple(
    """
    apple banana cherry grape lemon mango melon peach pear plum berry orange
    table chair window door floor house garden river ocean forest mountain valley
    planet rocket star moon cloud rain snow storm wind sun light shadow
    water fire earth stone metal paper glass wood sand salt sugar bread
    cat dog horse mouse tiger lion zebra monkey rabbit turtle eagle parrot
    fish whale shark snake frog bird duck goose sheep goat cow pig
    red blue green yellow purple black white brown silver golden pink gray
    happy quick slow brave calm bright dark early late quiet loud gentle
    run jump walk swim read write sing dance play cook build draw
    book pencil letter number puzzle music piano guitar violin drum song story
    city street bridge tower castle village market school library museum station
    teacher doctor farmer pilot driver artist singer writer player friend family
    morning evening night today summer winter spring autumn season minute hour
    computer keyboard screen mirror candle basket bottle button pocket ticket
    little big small tall short long round square simple strange hidden open
    banana kitchen blanket pillow jacket sweater pocket wallet hammer ladder
    butter cheese coffee cookie dinner lunch noodle pepper tomato potato carrot
    island desert jungle meadow canyon harbor beach coast field hill lake pond
    yellow mississippi balloon committee coffee bookkeeper address success
    letter apple moon book tree seed leaf root branch flower grass bloom
    """.split()  # noqa: SIM905 - a word list reads better as text
)

ONSETS = "b c d f g h j k l m n p r s t v w z br cr dr fl gr pl st tr sh ch th".split()  # noqa: SIM905
VOWELS = "a e i o u ai ea oo ou".split()  # noqa: SIM905


@dataclass(frozen=True)
class Example:
    """One question with its exact answer; `key` names the problem independent of phrasing."""

    task: str
    key: str
    question: str
    answer: str


def is_heldout(key: str) -> bool:
    """Stable split (blake2b, not Python's salted hash): True for evaluation-only problems."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1000 < HELDOUT_PER_MILLE


def _number(rng: random.Random) -> int:
    digits = rng.choice((1, 2, 2, 3, 3, 3, 4, 4, 4, 4))
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(lo, 10**digits - 1)


def _word(rng: random.Random, max_len: int = 12) -> str:
    r = rng.random()
    if r < 0.45:
        w = rng.choice(WORDS)
    elif r < 0.75:
        w = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(rng.randint(1, 4)))
    else:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10)))
    return w[:max_len] if len(w) > 2 else w + "s"


def _quote(rng: random.Random, s: str) -> str:
    q = rng.choice(("'", '"', "", "'"))
    return f"{q}{s}{q}"


def gen_add(rng: random.Random) -> Example:
    a, b = _number(rng), _number(rng)
    forms = (
        "What is {a} + {b}?",
        "What is {a} plus {b}?",
        "Add {a} and {b}.",
        "Compute {a}+{b}.",
        "{a} + {b} =",
        "What's the sum of {a} and {b}?",
        "Calculate {a} + {b}.",
        "Please add {a} to {b}.",
    )
    q = rng.choice(forms).format(a=a, b=b)
    return Example("add", f"add|{a}|{b}", q, str(a + b))


def gen_sub(rng: random.Random) -> Example:
    a, b = _number(rng), _number(rng)
    if rng.random() < 0.75 and a < b:
        a, b = b, a  # mostly non-negative results, negatives still occur
    forms = (
        "What is {a} - {b}?",
        "What is {a} minus {b}?",
        "Subtract {b} from {a}.",
        "Compute {a}-{b}.",
        "{a} - {b} =",
        "Calculate {a} - {b}.",
        "Take {b} away from {a}.",
    )
    q = rng.choice(forms).format(a=a, b=b)
    return Example("sub", f"sub|{a}|{b}", q, str(a - b))


def gen_sort(rng: random.Random) -> Example:
    if rng.random() < 0.55:
        items = [str(rng.randint(0, 99)) for _ in range(rng.randint(3, 6))]
        ordered = sorted(items, key=int)
        kind = "numbers"
    else:
        items = [rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8))]
        ordered = sorted(items)
        kind = "letters"
    sep = rng.choice((", ", " ", ", "))
    listed = sep.join(items)
    if kind == "numbers":
        forms = (
            "Sort these numbers in ascending order: {x}",
            "Sort: {x}",
            "Arrange {x} from smallest to largest.",
            "Put these numbers in increasing order: {x}.",
            "Order from lowest to highest: {x}",
        )
    else:
        forms = (
            "Sort the letters {x} alphabetically.",
            "Put these letters in alphabetical order: {x}",
            "Sort: {x}",
            "Arrange the letters {x} in order from a to z.",
        )
    q = rng.choice(forms).format(x=listed)
    key = f"sort|{kind}|{','.join(sorted(items))}"
    return Example("sort", key, q, ", ".join(ordered))


def gen_reverse(rng: random.Random) -> Example:
    w = _word(rng)
    forms = (
        "Reverse the word {w}.",
        "Spell {w} backwards.",
        "What is {w} reversed?",
        "Write {w} backwards.",
        "Reverse the letters of {w}.",
        "Please reverse {w}.",
    )
    q = rng.choice(forms).format(w=_quote(rng, w))
    return Example("reverse", f"reverse|{w}", q, w[::-1])


def gen_count(rng: random.Random) -> Example:
    w = _word(rng)
    if rng.random() < 0.3:
        forms = (
            "How many letters are in the word {w}?",
            "How many letters does {w} have?",
            "How long is the word {w}?",
            "Count the letters in {w}.",
        )
        q = rng.choice(forms).format(w=_quote(rng, w))
        return Example("count", f"len|{w}", q, str(len(w)))
    letter = rng.choice(w) if rng.random() < 0.85 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    forms = (
        "How many times does the letter {c} appear in {w}?",
        "Count the letter {c} in {w}.",
        "How many {l}'s are in the word {w}?",
        "In the word {w}, how many times does {c} occur?",
        "How many times does {c} occur in {w}?",
    )
    q = rng.choice(forms).format(c=_quote(rng, letter), l=letter, w=_quote(rng, w))
    return Example("count", f"count|{letter}|{w}", q, str(w.count(letter)))


def gen_copy(rng: random.Random) -> Example:
    while True:
        n = rng.randint(2, 5)
        words = [rng.choice(WORDS) if rng.random() < 0.8 else _word(rng, 8) for _ in range(n)]
        phrase = " ".join(words)
        if rng.random() < 0.3:
            phrase = phrase[0].upper() + phrase[1:] + "."
        if len(phrase) <= MAX_ANSWER_CHARS - 3:
            break
    forms = (
        "Repeat after me: {p}",
        "Copy this exactly: {p}",
        "Please repeat: {p}",
        "Say this back to me: {p}",
        'Echo "{p}"',
        "Repeat the phrase: {p}",
    )
    q = rng.choice(forms).format(p=phrase)
    return Example("copy", f"copy|{phrase}", q, phrase)


GENERATORS: dict[str, Callable[[random.Random], Example]] = {
    "add": gen_add,
    "sub": gen_sub,
    "sort": gen_sort,
    "reverse": gen_reverse,
    "count": gen_count,
    "copy": gen_copy,
}
# Arithmetic and sorting are the hardest for a small model, so they are drawn more often.
TRAIN_WEIGHTS: dict[str, float] = {
    "add": 0.22,
    "sub": 0.22,
    "sort": 0.18,
    "reverse": 0.13,
    "count": 0.15,
    "copy": 0.10,
}


def sample(rng: random.Random, split: str, task: str | None = None) -> Example:
    """One example of `split` ("train" | "test"), by rejection on the held-out hash."""
    want_test = split == "test"
    name = task or rng.choices(list(TRAIN_WEIGHTS), weights=list(TRAIN_WEIGHTS.values()))[0]
    gen = GENERATORS[name]
    while True:
        ex = gen(rng)
        if len(ex.answer) <= MAX_ANSWER_CHARS and is_heldout(ex.key) == want_test:
            return ex


def heldout_examples(n: int, seed: int = 1234) -> list[Example]:
    """`n` distinct held-out problems, the same on every machine, tasks interleaved evenly."""
    rng = random.Random(seed)
    names = list(GENERATORS)
    out: list[Example] = []
    seen: set[str] = set()
    i = 0
    while len(out) < n:
        ex = sample(rng, "test", names[i % len(names)])
        if ex.key not in seen:
            seen.add(ex.key)
            out.append(ex)
            i += 1
    return out


def messages_for(ex: Example) -> list[dict[str, str]]:
    """The chat messages a user would send for this example."""
    return [{"role": "user", "content": ex.question}]
