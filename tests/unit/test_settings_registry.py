"""Server settings are written once (dlm_protocol/settings.py) and every place that names one
follows: the engine's fields, the Triton model's parameters and env vars, the `serve` flags,
the generated config.pbtxt and docs/triton.md's table. dlm_triton's two processes' packages
import each other never."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from dlm_engine import EngineConfig
from dlm_protocol import docgen, settings
from dlm_triton.backend.settings import resolve_settings
from dlm_triton.launch import cli, model_repo
from dlm_triton.launch.launcher import TritonServerProcess

ROOT = Path(__file__).resolve().parents[2]


def test_every_engine_field_is_one_registry_entry() -> None:
    fields = dataclasses.fields(EngineConfig)
    assert [f.name for f in fields] == [s.name for s in settings.SETTINGS]
    config = EngineConfig(model="x")
    for s in settings.SETTINGS:
        if not s.required:
            assert getattr(config, s.name) == s.default, s.name
            assert s.parse(s.text(s.default)) == s.default, s.name  # config text round trip
    for table in (settings.BY_PARAM, settings.BY_ENV):
        assert len(table) == len(settings.SETTINGS)  # no two settings share a key or a var


def test_quantization_choices_are_the_engines() -> None:
    from dlm_engine.quantization import SUPPORTED

    assert set(settings.BY_NAME["quantization"].choices) == set(SUPPORTED)


def test_the_docs_table_is_generated_from_the_registry() -> None:
    text = docgen.TRITON_DOC.read_text()
    assert docgen.sections_in(text) == set(docgen.TRITON_SECTIONS)
    assert docgen.render(text, docgen.TRITON_SECTIONS) == text, "run python -m dlm_protocol.docgen"
    for s in settings.SETTINGS:
        assert f"| `{s.param}` | `{s.env}` |" in text, s.name


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("max_rows", "0", "parameter max_rows must be >= 1 (config or DLM_MAX_ROWS)"),
        ("max_rows", "4.5", "parameter max_rows must be an integer, got '4.5'"),
        ("kv_cache_memory_fraction", "0", "must be in (0, 1]"),
        ("admission_gap_ms", "nan", "must be a finite number"),
        ("cuda_graphs", "maybe", "parameter cuda_graphs must be true or false"),
        ("dtype", "float8", "parameter dtype must be one of auto, bfloat16"),
        ("quantization", "int3", "parameter quantization must be one of none, fp8"),
    ],
)
def test_a_bad_value_is_refused_naming_the_parameter(name: str, text: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        resolve_settings({"checkpoint": "x", name: text}, environ={})
    assert message in str(err.value)
    with pytest.raises(ValueError, match=settings.BY_NAME[name].env):  # the same from env
        resolve_settings({"checkpoint": "x"}, environ={settings.BY_NAME[name].env: text})


def test_parameters_and_env_reach_the_engine_config_typed() -> None:
    s = resolve_settings(
        {"checkpoint": "x", "quantization": "none", "cuda_graphs": "false", "max_rows": "4"},
        environ={"DLM_LOOKAHEAD": "off", "DLM_MAX_STEP_TOKENS": "4096", "DLM_MAX_ROWS": "8"},
    )
    config = EngineConfig(**s.values)
    assert (config.quantization, config.cuda_graphs, config.lookahead) == (None, False, False)
    assert (config.max_step_tokens, config.max_rows, config.device) == (4096, 8, "cpu")
    assert not s.configured("prefix_cache_tokens")
    assert config.prefix_cache_tokens == EngineConfig(model="x").prefix_cache_tokens
    with pytest.raises(ValueError, match="'max_rowz' is no server setting"):
        resolve_settings({"checkpoint": "x", "max_rowz": "4"}, environ={})
    backend_own = {"checkpoint": "x", "EXECUTION_ENV_PATH": "$$TRITON_MODEL_DIRECTORY/env"}
    assert resolve_settings(backend_own, environ={}).values == {"model": "x", "device": "cpu"}


def test_engine_config_checks_come_from_the_registry() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig\.max_queue must be >= 1"):
        EngineConfig(model="x", max_queue=0)
    with pytest.raises(ValueError, match=r"EngineConfig\.cuda_graphs must be true or false"):
        EngineConfig(model="x", cuda_graphs="yes")
    with pytest.raises(ValueError, match=r"EngineConfig\.max_rows must be a number, not a boolean"):
        EngineConfig(model="x", max_rows=True)


def test_every_setting_with_a_flag_reaches_the_served_models_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dlm-triton serve --model tiny-dlm --<flag> V` sets the setting's env var for
    tritonserver; an unknown or bad setting is refused by name before anything starts."""
    flags = settings.serve_flags()
    assert {s.name for s in flags} >= {"dtype", "quantization", "max_rows", "tensor_parallel_size"}
    argv = ["serve", "--model", "tiny-dlm", "--max-queue", "7", "--no-cuda-graphs"]
    argv += ["--admission-gap-ms", "3.5", "--quantization", "none"]
    args = cli.build_parser().parse_args(argv)
    given = cli.served_settings(args)
    assert given == {
        "quantization": "none",
        "max_queue": "7",
        "admission_gap_ms": "3.5",
        "cuda_graphs": "false",
    }
    choice = TritonServerProcess("tiny-dlm", device="cpu", engine_params=given)._choose_model()
    assert choice.env["DLM_MAX_QUEUE"] == "7" and choice.env["DLM_CUDA_GRAPHS"] == "false"
    assert choice.env["DLM_ADMISSION_GAP_MS"] == "3.5" and choice.env["DLM_DEVICE"] == "cpu"
    resolved = resolve_settings({"checkpoint": "x"}, environ=choice.env)
    assert (resolved.max_queue, resolved.cuda_graphs, resolved.quantization) == (7, False, None)
    with pytest.raises(ValueError, match="no server setting named max_rowz"):
        TritonServerProcess("tiny-dlm", engine_params={"max_rowz": "4"})._choose_model()
    with pytest.raises(ValueError, match="parameter max_queue must be >= 1"):
        TritonServerProcess("tiny-dlm", engine_params={"max_queue": "0"})._choose_model()


def test_a_checkpoint_directory_gets_a_config_with_the_given_settings(tmp_path: Path) -> None:
    ckpt = tmp_path / "my-ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    server = TritonServerProcess(ckpt, device="cpu", engine_params={"prefix_cache_tokens": "0"})
    choice = server._choose_model()
    try:
        params = model_repo.read_parameters(choice.repository / choice.name / "config.pbtxt")
    finally:
        server.stop()
    assert params["checkpoint"] == str(ckpt.resolve()) and params["prefix_cache_tokens"] == "0"
    assert params["max_rows"] == "16" and params["device"] == "cpu"
    with pytest.raises(ValueError, match="no server setting named max_rowz"):
        model_repo.ModelSpec("m", "c", max_rowz=3)
    with pytest.raises(ValueError, match="parameter max_canvas must be >= 1"):
        model_repo.ModelSpec("m", "c", max_canvas="0")
    with pytest.raises(ValueError, match="must be >= 1"):
        model_repo.ModelSpec("m", "c", max_canvas=0)


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: within its own package only
                continue
            found |= {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
    return found


@pytest.mark.parametrize(("package", "other"), [("backend", "launch"), ("launch", "backend")])
def test_the_stub_and_the_launcher_packages_import_each_other_never(
    package: str, other: str
) -> None:
    files = sorted((ROOT / "dlm_triton" / package).rglob("*.py"))
    assert files
    for path in files:
        bad = {m for m in _imports(path) if m.startswith(f"dlm_triton.{other}")}
        assert not bad, (path.name, bad)


def test_the_model_repository_shims_load_the_backend() -> None:
    for shim in (ROOT / "model_repository").glob("*/1/model.py"):
        assert "from dlm_triton.backend.triton_model import TritonPythonModel" in shim.read_text()
