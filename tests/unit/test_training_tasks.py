"""The rephrasing set measures generalisation: training never asks its wordings or problems.

`tasks.REPHRASED_FORMS` holds wordings a user might type that no training run samples
(`train --forms canonical` or `--forms varied`); `tasks.rephrased_examples` asks held-out
problems in them. If a rephrased wording leaked into training, or a rephrased problem were
not held out, the rephrasing accuracy in docs/benchmarks.md would measure memory instead.
"""

from __future__ import annotations

import random
import re

import pytest

from dlm_lab.training import tasks

N_TRAIN = 20000


def _pattern(form: str) -> re.Pattern[str]:
    """A wording as a regex: its fixed words literally, each `{field}` as any text."""
    parts = re.split(r"\{[a-z]\}", form)
    return re.compile("^" + ".+?".join(re.escape(p) for p in parts) + "$", re.DOTALL)


REPHRASED = [_pattern(f) for forms in tasks.REPHRASED_FORMS.values() for f in forms]


@pytest.fixture(scope="module")
def training_questions() -> list[tasks.Example]:
    rng = random.Random(0)
    return [tasks.sample(rng, "train", forms=tasks.TRAIN_FORMS) for _ in range(N_TRAIN)]


def test_no_rephrased_wording_is_a_training_wording() -> None:
    training = {f for forms in tasks.TRAIN_FORMS.values() for f in forms}
    rephrased = {f for forms in tasks.REPHRASED_FORMS.values() for f in forms}
    assert set(tasks.REPHRASED_FORMS) == set(tasks.CANONICAL_FORMS)
    assert not training & rephrased
    assert all(tasks.REPHRASED_FORMS.values())


def test_no_training_question_is_asked_in_a_rephrased_wording(
    training_questions: list[tasks.Example],
) -> None:
    """Sampled training questions (all wordings, varied included) match no rephrased form."""
    leaked = [e.question for e in training_questions if any(p.match(e.question) for p in REPHRASED)]
    assert not leaked, leaked[:5]


def test_rephrased_examples_are_heldout_problems_in_rephrased_wordings(
    training_questions: list[tasks.Example],
) -> None:
    examples = tasks.rephrased_examples(120)
    assert len({e.key for e in examples}) == 120
    assert {e.task for e in examples} == set(tasks.GENERATORS)
    assert all(tasks.is_heldout(e.key) for e in examples)
    assert not {e.key for e in examples} & {e.key for e in training_questions}
    assert all(any(p.match(e.question) for p in REPHRASED) for e in examples)
    training = [_pattern(f) for forms in tasks.TRAIN_FORMS.values() for f in forms]
    assert not [e.question for e in examples if any(p.match(e.question) for p in training)]
    assert examples == tasks.rephrased_examples(120)  # the same set on every machine


def test_canonical_heldout_set_is_asked_in_canonical_wordings() -> None:
    """The canonical held-out set (the quality tests' and docs' 600 questions) uses only the
    canonical wordings, so extra training wordings leave it unchanged."""
    canonical = [_pattern(f) for forms in tasks.CANONICAL_FORMS.values() for f in forms]
    examples = tasks.heldout_examples(120)
    assert all(tasks.is_heldout(e.key) for e in examples)
    assert all(any(p.match(e.question) for p in canonical) for e in examples)
    assert not any(any(p.match(e.question) for p in REPHRASED) for e in examples)
