"""Code speaks of the code: no tracker ("issue N") or work-session ("stop N") numbers in the
comments, docstrings or strings of the shipped packages and benchmarks. Such numbers mean
nothing to a reader of the code; the reason they stand for belongs in the text itself."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    "dlm_engine",
    "dlm_lab",
    "dlm_triton",
    "openai_proxy",
    "dlm_protocol",
    "client",
    "benchmarks",
]
DEV_LOG = re.compile(r"\b[Ii]ssues? #?\d|\b[Ss]tops? #?\d")


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def dev_log_hits(source: str) -> list[tuple[int, str]]:
    """(line, text) of each comment or string token that carries an issue or stop number."""
    hits = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) and DEV_LOG.search(tok.string):
            hits.append((tok.start[0], tok.string.strip()[:100]))
    return hits


def test_the_check_finds_numbers_in_comments_and_strings_only() -> None:
    source = (
        "x = 1  # issue 17: a reason\n"
        '"""Block rows (Issue 16)."""\n'
        "msg = 'see stop 30'\n"
        "issue_17 = stop_3 = 2  # the check reads comments and strings, not names\n"
        "# a stop string ends the output; issues with the input get a 400\n"
    )
    assert [line for line, _ in dev_log_hits(source)] == [1, 2, 3]


def test_the_sources_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert "dlm_engine/engine.py" in names and "openai_proxy/app.py" in names


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_code_carries_no_issue_or_stop_numbers(path: Path) -> None:
    hits = dev_log_hits(path.read_text())
    assert not hits, "\n".join(f"{path.name}:{line}: {text}" for line, text in hits)
