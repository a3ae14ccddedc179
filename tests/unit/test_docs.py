"""The user docs agree with the code: generated tables up to date, every served model named,
the compose quick start's key file where compose looks for it, commands that exist."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from dlm_protocol import docgen
from dlm_triton.launch import cli, model_table
from dlm_triton.launch.model_repo import COMMITTED_REPOSITORY

ROOT = Path(__file__).resolve().parents[2]
USER_DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_models_table_is_up_to_date() -> None:
    text = docgen.README.read_text()
    assert docgen.sections_in(text) == set(docgen.README_SECTIONS)
    assert docgen.render(text, docgen.README_SECTIONS) == text, "run python -m dlm_protocol.docgen"


def test_every_served_model_is_in_the_readme_table() -> None:
    text = docgen.README.read_text()
    names = sorted(p.parent.name for p in COMMITTED_REPOSITORY.glob("*/config.pbtxt"))
    assert len(names) >= 11
    for name in names:
        assert f"| `{name}` |" in text, name


def test_the_readme_has_a_serve_command_per_family() -> None:
    """Each family of the models table (LLaDA, Dream, SDAR, ...) has a `dlm-triton serve
    --model <name>` line in the README naming one of its models."""
    served = set(re.findall(r"dlm-triton serve --model (\S+)", docgen.README.read_text()))
    by_family: dict[str, set[str]] = {}
    for row in model_table.rows():
        by_family.setdefault(row.family.split(" (")[0], set()).add(row.name)
    missing = sorted(family for family, names in by_family.items() if not names & served)
    assert not missing, f"no serve command for: {missing}"


def test_the_tuning_guide_names_every_hub_model() -> None:
    """docs/tuning.md's per-model table covers every served checkpoint of model_repository/
    (the embedded task models have no tuning to give)."""
    text = (ROOT / "docs" / "tuning.md").read_text()
    rows = model_table.rows()
    missing = [r.name for r in rows if "/" in r.checkpoint and f"`{r.name}`" not in text]
    assert not missing, f"docs/tuning.md does not name: {missing}"


def test_weight_memory_matches_what_was_measured_on_the_gpu() -> None:
    """LLaDA-8B's weights as allocated on an H100/H200 (docs/benchmarks.md, quantization
    table): bf16 16.03 GB, LLM.int8 9.06 GB, NF4 5.68 GB."""
    row = next(r for r in model_table.rows() if r.name == "llada-8b-instruct")
    assert row.family == "LLaDA"
    assert 8.0e9 < row.parameters < 8.05e9
    assert row.bytes_bf16 / 1e9 == pytest.approx(16.03, rel=0.01)
    assert row.bytes_int8 / 1e9 == pytest.approx(9.06, rel=0.01)
    assert row.bytes_nf4 / 1e9 == pytest.approx(5.68, rel=0.01)
    assert row.bytes_fp8 / 1e9 == pytest.approx(9.06, rel=0.01)  # FP8 run: 9.06 GB


def test_fp8_weight_memory_of_moe_experts_matches_the_gpu() -> None:
    """LLaDA2.0-mini on the H100 (docs/benchmarks.md, FP8 table): bf16 31.87 GB of weights
    outside the embedding, FP8 16.33 GB: the experts are quantized too."""
    row = next(r for r in model_table.rows() if r.name == "llada2-mini")
    assert row.bytes_fp8 < 0.55 * row.bytes_bf16


def test_moe_experts_stay_bf16_under_quantization() -> None:
    """bitsandbytes swaps nn.Linear only; LLaDA2's stacked experts are parameters, so int8 and
    nf4 save little there, and the table must say so rather than halve the total."""
    row = next(r for r in model_table.rows() if r.name == "llada2-mini")
    assert row.family.startswith("LLaDA2")
    assert row.bytes_nf4 > 0.9 * row.bytes_bf16


def test_a_new_hub_checkpoint_needs_an_architecture(tmp_path: Path) -> None:
    folder = tmp_path / "new-model"
    folder.mkdir()
    (folder / "config.pbtxt").write_text(
        'parameters { key: "checkpoint" value: { string_value: "someone/Unknown-7B" } }\n'
    )
    with pytest.raises(KeyError, match="HUB_ARCHITECTURES"):
        model_table.rows(tmp_path)


def _env_example() -> dict[str, str]:
    out = {}
    for line in (ROOT / "docker" / "env.example").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def test_compose_quick_start_creates_the_key_file_compose_mounts() -> None:
    """README: the key file first, then env.example as docker/.env, then `up`; compose mounts
    ${DLM_API_KEYS_FILE} (relative to docker/) as the proxy's api_keys secret."""
    compose = (ROOT / "docker" / "compose.yaml").read_text()
    assert "file: ${DLM_API_KEYS_FILE:-./secrets/none}" in compose
    keys_file = _env_example()["DLM_API_KEYS_FILE"]
    host_path = "docker/" + keys_file.removeprefix("./")
    readme = (ROOT / "README.md").read_text()
    create = readme.index(f"> {host_path}")
    copy_env = readme.index("cp docker/env.example docker/.env")
    up = readme.index("docker compose -f docker/compose.yaml up")
    assert create < copy_env < up


def test_secret_files_have_one_documented_mode() -> None:
    """The containers run as uid 10001 (proxy) and 1000 (triton) and compose bind-mounts the
    host file as it is, so the key file must be world-readable (644) inside a 700 folder."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "--uid 10001" in dockerfile and "USER triton-server" in dockerfile
    modes = set()
    for doc in [*USER_DOCS, ROOT / "docker" / "secrets" / "README.md"]:
        for m in re.finditer(r"chmod (\d{3}) (docker/secrets/\S+)", doc.read_text()):
            if m.group(2).rstrip("`") != "docker/secrets":
                modes.add((m.group(1), doc.name))
    assert modes and {mode for mode, _ in modes} == {"644"}, modes


def _serve_commands() -> list[tuple[str, list[str]]]:
    found = []
    for doc in USER_DOCS:
        for line in doc.read_text().splitlines():
            m = re.search(r"dlm-triton serve( [^`#|]*)?", line)
            if m and m.group(1):
                try:
                    found.append((doc.name, shlex.split(m.group(1))))
                except ValueError:
                    continue
    return found


def test_documented_serve_flags_exist() -> None:
    parser = cli.build_parser()
    serve = next(
        a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "serve"
    )[1]
    known = {s for action in serve._actions for s in action.option_strings}
    commands = _serve_commands()
    assert len(commands) > 10
    for doc, words in commands:
        for word in words:
            flag = word.split("=", 1)[0]
            if flag.startswith("--"):
                assert flag in known, f"{doc}: dlm-triton serve has no {flag}"


@pytest.mark.parametrize("command", ["generate", "download", "tp-node"])
def test_documented_flags_of_the_other_commands_exist(command: str) -> None:
    sub = cli.build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    known = {s for action in sub._actions for s in action.option_strings}
    seen = 0
    for doc in [*USER_DOCS, ROOT / "docker" / "kubernetes" / "README.md"]:
        for line in doc.read_text().splitlines():
            m = re.search(rf"dlm-triton {command}( [^`#|]*)?", line)
            if not (m and m.group(1)):
                continue
            try:
                words = shlex.split(m.group(1))
            except ValueError:
                continue
            seen += 1
            for flag in (w.split("=", 1)[0] for w in words if w.startswith("--")):
                if "<" not in flag:  # `--<name>`: a placeholder in prose
                    assert flag in known, f"{doc.name}: dlm-triton {command} has no {flag}"
    assert seen, f"no documented dlm-triton {command} command"


# Words of a development log, not of user docs: tracker numbers, work-session names, commit
# hashes (hex words holding a letter and a digit), dated internal measurements.
_LOG_WORDS = re.compile(
    r"[Ii]ssue #?\d|issue-\d|[Ss]top \d|\bsession\b|\blease\b|"
    r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b|\b20\d\d-\d\d-\d\d\b"
)


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_hold_no_development_log(doc: Path) -> None:
    hits = [
        f"{i}: {line.strip()[:100]}"
        for i, line in enumerate(doc.read_text().splitlines(), 1)
        if _LOG_WORDS.search(line)
    ]
    assert not hits, "\n".join(hits[:20])


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    for line in doc.read_text().splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_and_anchors_resolve() -> None:
    docs = [
        *USER_DOCS,
        ROOT / "docker" / "kubernetes" / "README.md",
        ROOT / "docker" / "secrets" / "README.md",
    ]
    broken = []
    for doc in docs:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            link = m.group(1)
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = link.partition("#")
            target = (doc.parent / path).resolve() if path else doc
            if not target.exists():
                broken.append(f"{doc.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{doc.name}: {link} (no such heading)")
    assert not broken, "\n".join(broken)
