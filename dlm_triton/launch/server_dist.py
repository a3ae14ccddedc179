"""Locate or assemble a runnable ``tritonserver`` and the Python backend for this interpreter.

Two sources, one result (:class:`ServerDist`): the system install of NVIDIA's container
(``tritonserver`` on ``PATH`` or ``/opt/tritonserver``), or the files shipped in the
``nvidia-pytriton`` wheel. For the wheel we build ``<cache>/backends/python/`` holding the
backend library, its utils module and the stub compiled for the running Python, because the
wheel keeps stubs for several Pythons in a side folder the server does not look into.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SYSTEM_ROOT = Path("/opt/tritonserver")
_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
_STUB = "triton_python_backend_stub"


class TritonNotFoundError(RuntimeError):
    """No tritonserver could be found or assembled."""


@dataclass
class ServerDist:
    """A tritonserver binary, its backend directory and the environment it must run with."""

    binary: Path
    backend_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    source: str = "wheel"  # "wheel" | "system" | "env"

    def command(
        self,
        model_repository: Path,
        *,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        address: str = "127.0.0.1",
        model_config_name: str | None = None,
        models: list[str] | None = None,
        gpu_metrics: bool = False,
        log_verbose: int = 0,
        exit_timeout_s: int = 10,
        extra_args: list[str] | None = None,
    ) -> list[str]:
        """The command line for one server (explicit model control when ``models`` is given)."""
        cmd = [
            str(self.binary),
            f"--model-repository={model_repository}",
            f"--backend-directory={self.backend_dir}",
            f"--http-address={address}",
            f"--grpc-address={address}",
            f"--metrics-address={address}",
            f"--http-port={http_port}",
            f"--grpc-port={grpc_port}",
            f"--metrics-port={metrics_port}",
            f"--allow-gpu-metrics={'true' if gpu_metrics else 'false'}",
            "--allow-cpu-metrics=true",
            f"--exit-timeout-secs={exit_timeout_s}",
            f"--log-verbose={log_verbose}",
            "--strict-readiness=true",
        ]
        if model_config_name:
            cmd.append(f"--model-config-name={model_config_name}")
        if models:
            cmd.append("--model-control-mode=explicit")
            cmd += [f"--load-model={m}" for m in models]
        return cmd + list(extra_args or [])


def python_tag() -> str:
    """``3.11`` for the running interpreter: the stub must embed this Python."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def default_cache_dir() -> Path:
    """Where assembled backend directories live (``DLM_TRITON_CACHE`` overrides)."""
    env = os.environ.get("DLM_TRITON_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dlm-triton"


def model_env(
    base: dict[str, str] | None = None, lib_dirs: list[Path] | None = None
) -> dict[str, str]:
    """Environment for tritonserver and its stubs.

    In a venv, its ``bin`` goes first on PATH (the stub picks its ``site-packages`` from there;
    PYTHONPATH is ignored by it). ``lib_dirs`` go in front of the inherited LD_LIBRARY_PATH and
    nothing else is added: a system folder such as ``/usr/lib/x86_64-linux-gnu`` on
    LD_LIBRARY_PATH would override the torch wheel's RUNPATH, so torch could load the image's
    NCCL or cuDNN instead of the ones it was built against.
    """
    env = dict(os.environ if base is None else base)
    if sys.prefix != sys.base_prefix:
        venv_bin = str(Path(sys.executable).parent)  # not resolved: a venv's python is a symlink
        env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "/usr/bin:/bin")])
        env["VIRTUAL_ENV"] = sys.prefix
    libs = [str(p) for p in (lib_dirs or [])]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def libpython_dir(cache: Path | None = None, tag: str | None = None) -> Path | None:
    """A folder holding one link, to this interpreter's shared libpython, which the wheel's stub
    embeds: the stub finds it wherever Python lives (Debian's ``/usr/lib/x86_64-linux-gnu``,
    pyenv, conda) without that whole folder going on LD_LIBRARY_PATH. None if there is none."""
    import sysconfig

    tag = tag or python_tag()
    name = sysconfig.get_config_var("INSTSONAME") or f"libpython{tag}.so.1.0"
    candidates = [Path(sysconfig.get_config_var("LIBDIR") or "/nonexistent") / name]
    candidates.append(Path("/usr/lib/x86_64-linux-gnu") / f"libpython{tag}.so.1.0")
    source = next((c for c in candidates if c.exists()), None)
    if source is None:
        return None
    folder = (cache or default_cache_dir()) / f"py{tag}" / "libpython"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / source.name
    if not (link.is_symlink() and link.resolve() == source.resolve()):
        tmp = folder / f".{source.name}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(source)
        tmp.replace(link)  # atomic: parallel launchers race here
    return folder


def _ensure_exec(path: Path) -> None:
    """Wheels extracted without exec bits (``python -m zipfile``) need them back."""
    mode = path.stat().st_mode
    if not mode & stat.S_IXUSR:
        path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def wheel_root() -> Path | None:
    """``.../site-packages/pytriton/tritonserver`` if the nvidia-pytriton wheel is installed."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    return root if (root / "bin" / "tritonserver").exists() else None


def _wheel_libs(root: Path) -> list[Path]:
    """The wheel's bundled shared libraries (``site-packages/nvidia_pytriton.libs``)."""
    site = root.parent.parent
    return [p for p in (site / "nvidia_pytriton.libs", root / "lib") if p.is_dir()]


def assemble_backend(root: Path, cache: Path | None = None, tag: str | None = None) -> Path:
    """Build (once, atomically) ``<cache>/<tag>/backends/python/`` from the wheel's files.

    Returns the ``backends`` folder to pass as ``--backend-directory``. Parallel test runs may
    race here: the folder is written under a temporary name and renamed into place.
    """
    tag = tag or python_tag()
    stub = root / "python_backend_stubs" / tag / _STUB
    if not stub.exists():
        raise TritonNotFoundError(f"the nvidia-pytriton wheel has no Python {tag} stub ({stub})")
    backends = (cache or default_cache_dir()) / f"py{tag}" / "backends"
    target = backends / "python"
    sources = [root / "backends" / "python" / name for name in _BACKEND_FILES] + [stub]
    if target.is_dir() and all(
        (target / s.name).exists() and (target / s.name).stat().st_size == s.stat().st_size
        for s in sources
    ):
        return backends
    backends.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".python-", dir=backends))
    tmp.chmod(0o755)
    for src in sources:
        shutil.copy2(src, tmp / src.name)
    _ensure_exec(tmp / _STUB)
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race: its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return backends


def _system_dist() -> ServerDist | None:
    """NVIDIA's container layout: the backends there already match its Python, and the image's
    own environment (LD_LIBRARY_PATH with the CUDA compat libraries that NVIDIA's entrypoint
    manages, RUNPATHs of tritonserver) is already right: it is passed on unchanged."""
    found = shutil.which("tritonserver")
    binary = Path(found) if found else SYSTEM_ROOT / "bin" / "tritonserver"
    if not binary.exists():
        return None
    root = binary.resolve().parent.parent
    backends = root / "backends"
    if not (backends / "python").is_dir():
        return None
    return ServerDist(binary, backends, model_env(), source="system")


def _wheel_dist(cache: Path | None = None) -> ServerDist | None:
    """The wheel's server needs its bundled libraries and the stub the interpreter's libpython;
    nothing else goes on LD_LIBRARY_PATH."""
    root = wheel_root()
    if root is None:
        return None
    binary = root / "bin" / "tritonserver"
    _ensure_exec(binary)
    backends = assemble_backend(root, cache)
    libs = _wheel_libs(root)
    libpython = libpython_dir(cache)
    if libpython is not None:
        libs.append(libpython)
    return ServerDist(binary, backends, model_env(lib_dirs=libs), source="wheel")


def find_server(prefer: str = "auto", cache: Path | None = None) -> ServerDist:
    """Pick a tritonserver: ``DLM_TRITONSERVER`` (a binary path), else the system one, else the
    wheel's (``prefer`` = ``system`` | ``wheel`` forces one)."""
    explicit = os.environ.get("DLM_TRITONSERVER")
    if explicit:
        binary = Path(explicit)
        backends = Path(os.environ.get("DLM_TRITON_BACKENDS", binary.parent.parent / "backends"))
        return ServerDist(
            binary, backends, model_env(lib_dirs=[binary.parent.parent / "lib"]), "env"
        )
    order = {
        "auto": (_system_dist, _wheel_dist),
        "system": (_system_dist,),
        "wheel": (_wheel_dist,),
    }
    for finder in order[prefer]:
        dist = finder(cache) if finder is _wheel_dist else finder()
        if dist is not None:
            return dist
    raise TritonNotFoundError(
        "no tritonserver found: install the serve extra (`pip install -e .[serve]`, which brings "
        "nvidia-pytriton) or run inside NVIDIA's tritonserver container"
    )


def check_model_environment() -> list[str]:
    """Problems that would break the stub's Python (empty list = fine)."""
    problems = []
    try:
        import numpy

        if int(numpy.__version__.split(".")[0]) >= 2:
            problems.append(f"numpy {numpy.__version__}: the 2.51 stub needs numpy<2")
    except ImportError:
        problems.append("numpy is missing (triton_python_backend_utils imports it)")
    lib = Path(f"/usr/lib/x86_64-linux-gnu/libpython{python_tag()}.so.1.0")
    if not lib.exists():
        problems.append(f"{lib} missing: the stub embeds the system libpython{python_tag()}")
    if sys.prefix != sys.base_prefix and not str(sys.base_prefix).startswith("/usr"):
        problems.append(
            f"this venv is built on {sys.base_prefix}, but the stub embeds the system "
            f"Python {python_tag()}: build it with /usr/bin/python{python_tag()} -m venv"
        )
    return problems


if __name__ == "__main__":
    d = find_server()
    print(d.source, d.binary, d.backend_dir, sep="\n")
    for p in check_model_environment():
        print("warning:", p)
