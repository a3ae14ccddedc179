"""Generated sections of the docs, so they cannot drift from the code.

docs/api.md's contract tables and docs/triton.md's server-settings table come from this
package; README.md's served-models table comes from ``model_repository/``
(``dlm_triton.launch.model_table``, imported only when rendered: it builds each architecture on
torch's meta device). ``python -m dlm_protocol.docgen`` rewrites every generated section of
these files; ``--check`` exits 1 when a section differs (unit tests run
the same comparison). A section is the text between ``<!-- BEGIN GENERATED: name -->`` and
``<!-- END GENERATED -->``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from . import settings
from .params import PARAMS
from .response import USAGE_EXTRAS
from .tensors import INPUTS, OUTPUTS, TensorSpec

ROOT = Path(__file__).resolve().parent.parent
API_DOC = ROOT / "docs" / "api.md"
README = ROOT / "README.md"
TRITON_DOC = ROOT / "docs" / "triton.md"
_SECTION = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- END GENERATED -->)",
    re.DOTALL,
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def params_table() -> str:
    rows = [
        "| key | default | values | meaning | aliases |",
        "|---|---|---|---|---|",
    ]
    for p in PARAMS:
        aliases = ", ".join(f"`{a}`" for a in p.aliases) or ""
        rows.append(
            f"| `{p.name}` | {_cell(p.default_doc)} | {_cell(p.values_text())} | "
            f"{_cell(p.doc)} | {aliases} |"
        )
    return "\n".join(rows) + "\n"


def _tensor_rows(specs: tuple[TensorSpec, ...], head: str) -> str:
    rows = [f"| {head} | type | dims | meaning |", "|---|---|---|---|"]
    for t in specs:
        dims = "[" + ", ".join(str(d) for d in t.dims) + "]"
        rows.append(f"| `{t.name}` | {t.datatype} | {dims} | {_cell(t.doc)} |")
    return "\n".join(rows) + "\n"


def inputs_table() -> str:
    return _tensor_rows(INPUTS, "input")


def outputs_table() -> str:
    return _tensor_rows(OUTPUTS, "output")


def usage_table() -> str:
    rows = ["| usage field | meaning |", "|---|---|"]
    rows += [f"| `{name}` | {_cell(doc)} |" for name, doc in USAGE_EXTRAS.items()]
    return "\n".join(rows) + "\n"


def algorithms_table() -> str:
    from dlm_engine.decoding.strategies import algorithms_table as table  # the registry

    return table()


def models_table() -> str:
    from dlm_triton.launch.model_table import markdown  # torch, only when this section is rendered

    return markdown()


SECTIONS: dict[str, Callable[[], str]] = {
    "params": params_table,
    "inputs": inputs_table,
    "outputs": outputs_table,
    "usage": usage_table,
    "algorithms": algorithms_table,
}
README_SECTIONS: dict[str, Callable[[], str]] = {"models": models_table}
TRITON_SECTIONS: dict[str, Callable[[], str]] = {"settings": settings.markdown}
# Every generated file and the sections it must hold.
DOCS: dict[Path, dict[str, Callable[[], str]]] = {
    API_DOC: SECTIONS,
    README: README_SECTIONS,
    TRITON_DOC: TRITON_SECTIONS,
}


def render(text: str, sections: dict[str, Callable[[], str]] = SECTIONS) -> str:
    """`text` with every generated section replaced by its current content."""

    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in sections:
            raise KeyError(f"unknown generated section {name!r}")
        return m.group(1) + sections[name]() + m.group(4)

    return _SECTION.sub(replace, text)


def sections_in(text: str) -> set[str]:
    return {m.group("name") for m in _SECTION.finditer(text)}


def _one(doc: Path, sections: dict[str, Callable[[], str]], check: bool) -> int:
    text = doc.read_text()
    missing = set(sections) - sections_in(text)
    if missing:
        print(f"{doc}: no generated section for {sorted(missing)}", file=sys.stderr)
        return 1
    new = render(text, sections)
    if check:
        if new != text:
            print(f"out of date: {doc} (run python -m dlm_protocol.docgen)", file=sys.stderr)
            return 1
        return 0
    doc.write_text(new)
    print(doc)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--doc", type=Path, help="one generated file (default: all of them)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a doc is out of date")
    args = parser.parse_args(argv)
    docs = DOCS
    if args.doc is not None:
        match = {d: s for d, s in DOCS.items() if d.resolve() == args.doc.resolve()}
        docs = match or {args.doc: SECTIONS}
    return max(_one(doc, sections, args.check) for doc, sections in docs.items())


if __name__ == "__main__":
    raise SystemExit(main())
