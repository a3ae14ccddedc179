"""`dlm-triton --help` tells the truth: defaults shown, the algorithms listed, on/off flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dlm_protocol.params import ALGORITHM_SUMMARIES, ALGORITHMS, PARAMS
from dlm_triton.launch import cli
from openai_proxy.config import build_arg_parser as proxy_parser

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _help(command: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "200")  # one flag a line: no wrapping mid-phrase
    sub = cli.build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    return sub.format_help()


def test_serve_help_shows_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _help("serve", monkeypatch)
    for line in (
        "Triton HTTP port (default: 8000)",
        "Triton gRPC port (default: 8001)",
        "Triton metrics port (default: 8002)",
        "OpenAI proxy port (default: 9000)",
        "(default: 127.0.0.1)",
        "(default: auto)",
        "model load limit (s) (default: 1800.0)",
        "rows per denoising step (default: the model's config.pbtxt, else 16)",
    ):
        assert line in text, line
    assert "(default: None)" not in text and "(default: False)" not in text


def test_generate_help_lists_every_algorithm(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(ALGORITHM_SUMMARIES) == set(ALGORITHMS)  # the registry covers every algorithm
    text = _help("generate", monkeypatch)
    assert "see the algorithms below" in text
    below = text.split("algorithms (--algorithm):", 1)[1]
    for name, summary in ALGORITHM_SUMMARIES.items():
        assert f"  {name} " in below and summary in below, name


def test_boolean_keys_are_on_off_flags() -> None:
    parser = cli.build_parser()
    parse = parser.parse_args
    assert cli._sampling(parse(["generate", "hi"])) == {}  # absent: the server's default
    assert cli._sampling(parse(["generate", "hi", "--no-parallel-tool-calls"])) == {
        "parallel_tool_calls": False
    }
    assert cli._sampling(parse(["generate", "hi", "--parallel-tool-calls"])) == {
        "parallel_tool_calls": True
    }
    gen = parser._subparsers._group_actions[0].choices["generate"]  # type: ignore[union-attr]
    flags = {s: a for a in gen._actions for s in a.option_strings}
    for p in PARAMS:
        if p.kind == "bool":
            flag = "--" + p.name.replace("_", "-")
            assert isinstance(flags[flag], argparse.BooleanOptionalAction), flag
            assert "--no-" + flag[2:] in flags


def test_logit_bias_flag_sends_json_text() -> None:
    args = cli.build_parser().parse_args(["generate", "hi", "--logit-bias", '{"42": -100}'])
    assert cli._sampling(args) == {"logit_bias": '{"42": -100}'}


@pytest.mark.parametrize("flag", ["--stream-idle-timeout", "--triton-admin-key-file"])
def test_proxy_flags_are_in_the_settings_table(flag: str) -> None:
    assert flag in {s for a in proxy_parser()._actions for s in a.option_strings}
    table = (DOCS / "openai_api.md").read_text()
    assert f"| `{flag}` |" in table


def test_every_flag_has_help_and_no_python_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for command in ("serve", "generate", "download", "tp-node"):
        sub = cli.build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
        missing = [a.option_strings for a in sub._actions if a.option_strings and not a.help]
        assert not missing, f"{command}: {missing}"
        text = _help(command, monkeypatch)
        for raw in ("(default: True)", "(default: None)", "(default: False)"):
            assert raw not in text, f"{command}: {raw}"


def test_every_proxy_flag_names_its_variable_and_default_and_is_in_the_table() -> None:
    """`python -m openai_proxy --help` and docs/openai_api.md's settings table list the same
    flags, each with the `DLM_PROXY_*` variable that from_env reads."""
    table = (DOCS / "openai_api.md").read_text()
    rows = {line.split("|")[1]: line for line in table.splitlines() if line.startswith("| `--")}
    for action in proxy_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        env = "DLM_PROXY_" + action.dest.upper()
        assert env in (action.help or "") and "default" in (action.help or ""), action.dest
        row = next((r for cell, r in rows.items() if f"`{action.option_strings[0]}`" in cell), "")
        assert f"`{env}`" in row, f"docs/openai_api.md has no row for {action.option_strings[0]}"
