"""The serving packages never import test oracles, fixtures or training code (`dlm_lab`), and
the engine imports no server: no Triton, gRPC or HTTP module. Read from the source's syntax
tree, so an import inside a function, or a relative one, counts as much as a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVING = {
    "dlm_engine": ROOT / "dlm_engine",
    "dlm_triton": ROOT / "dlm_triton",
    "openai_proxy": ROOT / "openai_proxy",
    "dlm_protocol": ROOT / "dlm_protocol",
    "dlm_client": ROOT / "client",
}
LAB = "dlm_lab"
SERVER_MODULES = {"tritonclient", "triton_python_backend_utils", "fastapi", "httpx", "uvicorn"}
SERVER_MODULES |= {"grpc", "starlette"}


def module_name(package: str, folder: Path, path: Path) -> str:
    """Dotted name of `path` inside `package` (whose source lives in `folder`)."""
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Absolute names of every module `source` imports, relative imports resolved against
    `module`; `from a import b` yields both `a` and `a.b` (b may be a submodule)."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            anchor = base[: max(0, len(base) - node.level + 1)] if node.level else []
            stem = [*anchor, *([node.module] if node.module else [])]
            if stem:
                found.add(".".join(stem))
            found |= {".".join([*stem, a.name]) for a in node.names if a.name != "*"}
    return found


def top(name: str) -> str:
    return name.split(".")[0]


def sources() -> list[tuple[str, Path, Path]]:
    return [
        (package, folder, path)
        for package, folder in SERVING.items()
        for path in sorted(folder.rglob("*.py"))
    ]


def violations(package: str, module: str, imports: set[str]) -> list[str]:
    """What `module` of `package` must not import."""
    bad = sorted(name for name in imports if top(name) == LAB)
    if package == "dlm_engine":
        bad += sorted(name for name in imports if top(name) in SERVER_MODULES)
    return bad


def check_source(package: str, module: str, source: str, is_package: bool = False) -> list[str]:
    return violations(package, module, imported_modules(source, module, is_package))


@pytest.mark.parametrize(
    "source",
    [
        "import dlm_lab.reference",
        "from dlm_lab import testing",
        "from dlm_lab.testing import make_tiny_checkpoint",
        "from ...dlm_lab import reference",  # relative, climbing out of dlm_engine
        "from .. import dlm_lab",
        "def f():\n    from dlm_lab.reference_block import sdar_generate\n",
        "import tritonclient.grpc",
        "import triton_python_backend_utils as pb_utils",
        "from fastapi import FastAPI",
        "import httpx",
        "from uvicorn import Config",
        "import grpc",
    ],
)
def test_the_check_catches_forbidden_imports_in_the_engine(source: str) -> None:
    module = "dlm_engine.x" if source.startswith("from .. ") else "dlm_engine.decoding.x"
    assert check_source("dlm_engine", module, source)


def test_relative_imports_resolve_to_their_absolute_names() -> None:
    got = imported_modules("from ..reference import f\nfrom . import g\n", "pkg.sub.mod", False)
    assert got == {"pkg.reference", "pkg.reference.f", "pkg.sub", "pkg.sub.g"}
    got = imported_modules("from .x import y\n", "pkg.sub", True)
    assert got == {"pkg.sub.x", "pkg.sub.x.y"}


def test_servers_may_import_servers_but_not_the_lab() -> None:
    assert check_source("dlm_triton", "dlm_triton.x", "import tritonclient.grpc\n") == []
    assert check_source("openai_proxy", "openai_proxy.x", "import httpx\n") == []
    assert check_source("openai_proxy", "openai_proxy.x", "from dlm_lab import testing\n")
    # a module whose name merely starts like a forbidden one is not forbidden
    assert check_source("dlm_engine", "dlm_engine.x", "import grpcio_like\nimport dlm_labs\n") == []


def test_every_serving_package_is_read() -> None:
    found = {(package, module_name(package, folder, path)) for package, folder, path in sources()}
    for package in SERVING:
        assert (package, package) in found, package
    assert ("dlm_engine", "dlm_engine.decoding.filters") in found


@pytest.mark.parametrize(
    ("package", "folder", "path"),
    sources(),
    ids=[path.relative_to(ROOT).as_posix() for _, _, path in sources()],
)
def test_serving_code_imports_no_lab_and_the_engine_no_server(
    package: str, folder: Path, path: Path
) -> None:
    module = module_name(package, folder, path)
    bad = check_source(package, module, path.read_text(), path.name == "__init__.py")
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
