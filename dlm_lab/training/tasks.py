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
from collections.abc import Callable, Mapping
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


Forms = Mapping[str, tuple[str, ...]]

# The wordings the model is trained on and the canonical held-out set is asked in, by form
# group (a task's generator picks a group, then a wording).
CANONICAL_FORMS: dict[str, tuple[str, ...]] = {
    "add": (
        "What is {a} + {b}?",
        "What is {a} plus {b}?",
        "Add {a} and {b}.",
        "Compute {a}+{b}.",
        "{a} + {b} =",
        "What's the sum of {a} and {b}?",
        "Calculate {a} + {b}.",
        "Please add {a} to {b}.",
    ),
    "sub": (
        "What is {a} - {b}?",
        "What is {a} minus {b}?",
        "Subtract {b} from {a}.",
        "Compute {a}-{b}.",
        "{a} - {b} =",
        "Calculate {a} - {b}.",
        "Take {b} away from {a}.",
    ),
    "sort_numbers": (
        "Sort these numbers in ascending order: {x}",
        "Sort: {x}",
        "Arrange {x} from smallest to largest.",
        "Put these numbers in increasing order: {x}.",
        "Order from lowest to highest: {x}",
    ),
    "sort_letters": (
        "Sort the letters {x} alphabetically.",
        "Put these letters in alphabetical order: {x}",
        "Sort: {x}",
        "Arrange the letters {x} in order from a to z.",
    ),
    "reverse": (
        "Reverse the word {w}.",
        "Spell {w} backwards.",
        "What is {w} reversed?",
        "Write {w} backwards.",
        "Reverse the letters of {w}.",
        "Please reverse {w}.",
    ),
    "count_length": (
        "How many letters are in the word {w}?",
        "How many letters does {w} have?",
        "How long is the word {w}?",
        "Count the letters in {w}.",
    ),
    "count_letter": (
        "How many times does the letter {c} appear in {w}?",
        "Count the letter {c} in {w}.",
        "How many {l}'s are in the word {w}?",
        "In the word {w}, how many times does {c} occur?",
        "How many times does {c} occur in {w}?",
    ),
    "copy": (
        "Repeat after me: {p}",
        "Copy this exactly: {p}",
        "Please repeat: {p}",
        "Say this back to me: {p}",
        'Echo "{p}"',
        "Repeat the phrase: {p}",
    ),
}

# More training wordings (`train --forms varied`): a model that has seen only the canonical
# ones can latch onto their exact words; these widen what "the same question" looks like.
# Training only: the canonical held-out set stays in CANONICAL_FORMS, and none of these is a
# REPHRASED_FORMS wording (tests/unit/test_training_tasks.py).
EXTRA_TRAIN_FORMS: dict[str, tuple[str, ...]] = {
    "add": (
        "{a} + {b} = ?",
        "Work out {a} + {b}.",
        "I need {a} plus {b}.",
        "Tell me the sum of {a} and {b}.",
        "what is {a} plus {b}",
        "Add together {a} and {b}.",
        "Quick question: {a} + {b}?",
        "Give me the total of {a} and {b}.",
        "Hi! What is {a} + {b}?",
        "{a} and {b} added together is?",
    ),
    "sub": (
        "{a} - {b} = ?",
        "Work out {a} - {b}.",
        "I need {a} minus {b}.",
        "Tell me what {a} minus {b} is.",
        "what is {a} minus {b}",
        "Subtract {b} from {a}, please.",
        "Quick question: {a} - {b}?",
        "Take away {b} from {a}.",
        "Hi! What is {a} - {b}?",
        "Deduct {b} from {a}.",
    ),
    "sort_numbers": (
        "Sort {x} in ascending order.",
        "Please sort these numbers: {x}",
        "Numbers to sort, smallest first: {x}",
        "Arrange in increasing order: {x}",
        "sort {x}",
        "Write {x} from least to greatest.",
        "Sort ascending: {x}",
    ),
    "sort_letters": (
        "Sort {x} alphabetically.",
        "Please sort these letters: {x}",
        "Arrange in alphabetical order: {x}",
        "sort the letters {x}",
        "Write the letters {x} in abc order.",
        "Letters to sort from a to z: {x}",
    ),
    "reverse": (
        "Reverse {w}.",
        "Spell the word {w} backwards.",
        "Write the letters of {w} in reverse order.",
        "reverse {w}",
        "What does {w} look like reversed?",
        "Turn {w} around, last letter first.",
        "Hi! Please spell {w} backwards.",
        "Backwards, {w} is?",
    ),
    "count_length": (
        "How many letters in the word {w}?",
        "Length of the word {w}?",
        "Count how many letters {w} has.",
        "how many letters are in {w}",
        "Number of letters in {w}?",
    ),
    "count_letter": (
        "How many times is {c} in {w}?",
        "Count the {l}'s in {w}.",
        "how many {l}'s in {w}",
        "Count occurrences of {c} in the word {w}.",
        "Tell me how many times {c} appears in {w}.",
    ),
    "copy": (
        "Repeat: {p}",
        "Copy: {p}",
        "Please say this again: {p}",
        "Write this back exactly: {p}",
        "repeat after me: {p}",
        "Echo this phrase: {p}",
    ),
}

TRAIN_FORMS: dict[str, tuple[str, ...]] = {
    group: forms + EXTRA_TRAIN_FORMS.get(group, ()) for group, forms in CANONICAL_FORMS.items()
}

# Held-out REPHRASINGS: natural wordings a user might type that training never samples (not
# in CANONICAL_FORMS nor EXTRA_TRAIN_FORMS). `rephrased_examples` asks held-out problems in
# these, to measure whether a model learned the skill or only its training phrasing.
REPHRASED_FORMS: dict[str, tuple[str, ...]] = {
    "add": (
        "What's {a} plus {b}?",
        "How much is {a} + {b}?",
        "Can you add {a} and {b} for me?",
        "What do you get if you add {a} and {b}?",
        "Find the sum of {a} and {b}.",
        "what's {a}+{b}",
    ),
    "sub": (
        "What's {a} minus {b}?",
        "How much is {a} - {b}?",
        "Can you subtract {b} from {a}?",
        "What do you get if you subtract {b} from {a}?",
        "Find {a} minus {b}.",
        "what's {a}-{b}",
    ),
    "sort_numbers": (
        "Put these in order: {x}",
        "Can you sort {x} from low to high?",
        "Order these numbers: {x}",
        "List {x} in ascending order.",
        "Sort the following numbers: {x}",
    ),
    "sort_letters": (
        "Put these in order: {x}",
        "Alphabetize: {x}",
        "Can you put {x} in alphabetical order?",
        "Order the letters {x} alphabetically.",
        "Sort the following letters: {x}",
    ),
    "reverse": (
        "Could you reverse the word {w}?",
        "What's {w} spelled backwards?",
        "How do you spell {w} backwards?",
        "Reverse this: {w}",
        "Write the word {w} in reverse.",
        "Give me {w} backwards.",
    ),
    "count_length": (
        "How many characters are in {w}?",
        "What is the length of the word {w}?",
        "Tell me how many letters {w} has.",
    ),
    "count_letter": (
        "How often does {c} appear in {w}?",
        "Count how many times {c} shows up in {w}.",
        "In {w}, how many {l}'s are there?",
        "What's the number of {l}'s in {w}?",
    ),
    "copy": (
        "Say back exactly: {p}",
        "Can you repeat this: {p}",
        "Repeat this back to me: {p}",
        "Please copy: {p}",
        "Just repeat the following: {p}",
    ),
}


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


def gen_add(rng: random.Random, forms: Forms = CANONICAL_FORMS) -> Example:
    a, b = _number(rng), _number(rng)
    q = rng.choice(forms["add"]).format(a=a, b=b)
    return Example("add", f"add|{a}|{b}", q, str(a + b))


def gen_sub(rng: random.Random, forms: Forms = CANONICAL_FORMS) -> Example:
    a, b = _number(rng), _number(rng)
    if rng.random() < 0.75 and a < b:
        a, b = b, a  # mostly non-negative results, negatives still occur
    q = rng.choice(forms["sub"]).format(a=a, b=b)
    return Example("sub", f"sub|{a}|{b}", q, str(a - b))


def gen_sort(rng: random.Random, forms: Forms = CANONICAL_FORMS) -> Example:
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
    q = rng.choice(forms[f"sort_{kind}"]).format(x=listed)
    key = f"sort|{kind}|{','.join(sorted(items))}"
    return Example("sort", key, q, ", ".join(ordered))


def gen_reverse(rng: random.Random, forms: Forms = CANONICAL_FORMS) -> Example:
    w = _word(rng)
    q = rng.choice(forms["reverse"]).format(w=_quote(rng, w))
    return Example("reverse", f"reverse|{w}", q, w[::-1])


def gen_count(rng: random.Random, forms: Forms = CANONICAL_FORMS) -> Example:
    w = _word(rng)
    if rng.random() < 0.3:
        q = rng.choice(forms["count_length"]).format(w=_quote(rng, w))
        return Example("count", f"len|{w}", q, str(len(w)))
    letter = rng.choice(w) if rng.random() < 0.85 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    q = rng.choice(forms["count_letter"]).format(c=_quote(rng, letter), l=letter, w=_quote(rng, w))
    return Example("count", f"count|{letter}|{w}", q, str(w.count(letter)))


def gen_copy(rng: random.Random, forms: Forms = CANONICAL_FORMS) -> Example:
    while True:
        n = rng.randint(2, 5)
        words = [rng.choice(WORDS) if rng.random() < 0.8 else _word(rng, 8) for _ in range(n)]
        phrase = " ".join(words)
        if rng.random() < 0.3:
            phrase = phrase[0].upper() + phrase[1:] + "."
        if len(phrase) <= MAX_ANSWER_CHARS - 3:
            break
    q = rng.choice(forms["copy"]).format(p=phrase)
    return Example("copy", f"copy|{phrase}", q, phrase)


GENERATORS: dict[str, Callable[[random.Random, Forms], Example]] = {
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


def sample(
    rng: random.Random, split: str, task: str | None = None, forms: Forms | None = None
) -> Example:
    """One example of `split` ("train" | "test"), by rejection on the held-out hash.

    Asked in `forms` (default CANONICAL_FORMS; `train --forms varied` passes TRAIN_FORMS)."""
    want_test = split == "test"
    name = task or rng.choices(list(TRAIN_WEIGHTS), weights=list(TRAIN_WEIGHTS.values()))[0]
    gen = GENERATORS[name]
    while True:
        ex = gen(rng, forms or CANONICAL_FORMS)
        if len(ex.answer) <= MAX_ANSWER_CHARS and is_heldout(ex.key) == want_test:
            return ex


def heldout_examples(n: int, seed: int = 1234, forms: Forms | None = None) -> list[Example]:
    """`n` distinct held-out problems, the same on every machine, tasks interleaved evenly."""
    rng = random.Random(seed)
    names = list(GENERATORS)
    out: list[Example] = []
    seen: set[str] = set()
    i = 0
    while len(out) < n:
        ex = sample(rng, "test", names[i % len(names)], forms)
        if ex.key not in seen:
            seen.add(ex.key)
            out.append(ex)
            i += 1
    return out


def rephrased_examples(n: int, seed: int = 4321) -> list[Example]:
    """`n` held-out problems asked in REPHRASED_FORMS: wordings training never saw, on
    problems it never saw (the same hash split), tasks interleaved evenly."""
    return heldout_examples(n, seed, REPHRASED_FORMS)


def messages_for(ex: Example) -> list[dict[str, str]]:
    """The chat messages a user would send for this example."""
    return [{"role": "user", "content": ex.question}]
