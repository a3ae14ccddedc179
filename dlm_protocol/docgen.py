"""docs/api.md's contract tables, generated from this package so the docs cannot drift.

``python -m dlm_protocol.docgen`` rewrites every generated section of docs/api.md;
``--check`` exits 1 when a section differs (a unit test runs the same comparison).
A section is the text between ``<!-- BEGIN GENERATED: name -->`` and ``<!-- END GENERATED -->``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from .params import PARAMS
from .response import USAGE_EXTRAS
from .tensors import INPUTS, OUTPUTS, TensorSpec

API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
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


SECTIONS: dict[str, Callable[[], str]] = {
    "params": params_table,
    "inputs": inputs_table,
    "outputs": outputs_table,
    "usage": usage_table,
}


def render(text: str) -> str:
    """`text` with every generated section replaced by its current content."""

    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in SECTIONS:
            raise KeyError(f"unknown generated section {name!r}")
        return m.group(1) + SECTIONS[name]() + m.group(4)

    return _SECTION.sub(replace, text)


def sections_in(text: str) -> set[str]:
    return {m.group("name") for m in _SECTION.finditer(text)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--doc", type=Path, default=API_DOC)
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc is out of date")
    args = parser.parse_args(argv)
    text = args.doc.read_text()
    missing = set(SECTIONS) - sections_in(text)
    if missing:
        print(f"{args.doc}: no generated section for {sorted(missing)}", file=sys.stderr)
        return 1
    new = render(text)
    if args.check:
        if new != text:
            print(f"out of date: {args.doc} (run python -m dlm_protocol.docgen)", file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(new)
    print(args.doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
