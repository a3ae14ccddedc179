"""Start and stop tritonserver (and the OpenAI proxy) as one unit, by PID.

One code path for ``dlm-triton serve``, the Docker entry point and the test fixtures:
:class:`TritonServerProcess`. Why stop by hand: Triton 2.51 does not unload a decoupled model
while its requests are open (a SIGTERM mid-generation runs into the exit timeout), and a killed
server leaves Python stubs (which ignore SIGTERM) and their ``/dev/shm`` regions behind. So the
proxy goes first (it drains), then the model drains through a file handshake, then the server
gets SIGTERM with a bounded wait and SIGKILL, then the stubs it started and the shm files named
on their command lines are removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dlm_protocol import settings
from dlm_triton.instance_load import remove_boards
from dlm_triton.launch import admin_key, model_repo
from dlm_triton.launch.checkpoint_fetch import fetch_checkpoint, served_checkpoint
from dlm_triton.launch.procs import (
    alive,
    cmdline,
    free_port,
    free_ports,
    has_gpu,
    http_ok,
    http_text,
    proc_children,
    spawn,
    suppress,
    terminate,
    visible_gpus,
)
from dlm_triton.launch.runtime_info import fused_fallbacks, model_info
from dlm_triton.launch.server_dist import ServerDist, find_server
from dlm_triton.launch.supervisor import Supervisor

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_COMPANIONS",
    "SHM_DIR",
    "SHM_PREFIX",
    "STUB_NAME",
    "Ports",
    "TritonServerProcess",
    "embedded_companions",
    "free_port",
    "free_ports",
]

STUB_NAME = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")
# Instances (engine replicas) per model on GPUs: `dlm-triton serve --data-parallel-size`.
DATA_PARALLEL_ENV = "DLM_DATA_PARALLEL_SIZE"
SHM_PREFIX = "triton_python_backend_shm_region"
DEFAULT_MODEL = "tiny-dlm"
# Served beside DEFAULT_MODEL by a plain `dlm-triton serve` (no --model; --no-also turns it
# off): other embedded models of the committed repository, loaded by the same tritonserver.
# Only those present are served (their model_repository/ entry and embedded checkpoint exist,
# see embedded_companions), so the CLI works the same before an asset has landed.
EMBEDDED_COMPANIONS = ("tiny-sdar",)
# One environment for every model of a server: a checkpoint override there reaches them all.
SHARED_CHECKPOINT_VAR = settings.BY_NAME["model"].env
PROXY_DRAIN_S = float(os.environ.get("DLM_PROXY_STOP_TIMEOUT", "30"))  # proxy drains, then SIGKILL


def committed_repository() -> Path:
    """``model_repository/`` beside the package (``DLM_MODEL_REPOSITORY`` overrides)."""
    return Path(os.environ.get("DLM_MODEL_REPOSITORY", model_repo.COMMITTED_REPOSITORY))


def repository_models(repo: Path) -> list[str]:
    """The model names of a repository (folders with a ``config.pbtxt``)."""
    if not repo.is_dir():
        return []
    return sorted(p.name for p in repo.iterdir() if (p / "config.pbtxt").exists())


def embedded_companions(environ: dict[str, str] | None = None) -> list[str]:
    """The :data:`EMBEDDED_COMPANIONS` that can be served now: a ``config.pbtxt`` in the
    committed repository whose checkpoint is a local folder (the embedded asset). None while
    ``DLM_CHECKPOINT`` is set: every model of the server would read it."""
    env = os.environ if environ is None else environ
    if env.get(SHARED_CHECKPOINT_VAR):
        return []
    repo = committed_repository()
    found = []
    for name in EMBEDDED_COMPANIONS:
        config = repo / name / "config.pbtxt"
        if not config.exists():
            continue
        checkpoint, _ = served_checkpoint(config, {})
        if checkpoint is not None and Path(checkpoint).is_dir():
            found.append(name)
    return found


@dataclass
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002
    proxy: int = 9000

    @classmethod
    def free(cls) -> Ports:
        return cls(*free_ports(4))


@dataclass
class ModelChoice:
    """What tritonserver loads: a repository, one model name in it, and env overrides."""

    repository: Path
    name: str
    env: dict[str, str]
    runtime_dir: Path | None = None  # written by us, removed at stop
    also: list[str] = field(default_factory=list)  # more models of the repository, same env

    @property
    def names(self) -> list[str]:
        """Every model tritonserver loads, the main one first."""
        return [self.name, *self.also]


def proxy_command(
    ports: Ports,
    model_name: str | Sequence[str],
    address: str,
    admin_key_file: Path | None = None,
) -> list[str] | None:
    """How to start the OpenAI proxy, or None while ``openai_proxy`` has no entry point.
    ``model_name``: the model(s) it serves (one ``--model`` each, the main one first).
    The proxy gets the admin key file (given, or the default one if it exists)."""
    import importlib.util

    if importlib.util.find_spec("openai_proxy.__main__") is None:
        return None
    key_file = admin_key_file or admin_key.default_key_file()
    key_args = ["--triton-admin-key-file", str(key_file)] if key_file.is_file() else []
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    model_args = [arg for name in names for arg in ("--model", name)]
    return [
        sys.executable,
        "-m",
        "openai_proxy",
        "--host",
        address,
        "--port",
        str(ports.proxy),
        "--triton-grpc",
        f"127.0.0.1:{ports.grpc}",
        *model_args,
        "--triton-metrics-url",
        f"http://127.0.0.1:{ports.metrics}/metrics",
        *key_args,
    ]


class StartAborted(RuntimeError):
    """A signal asked to stop before the server was ready (everything started is stopped)."""


class TritonServerProcess:
    """tritonserver (+ optional proxy) for one model, or several; a context manager.

    ``model`` is a checkpoint directory (a runtime repository is written for it), a name in
    ``model_repository/``, or None for the embedded default ``tiny-dlm``. ``also`` names more
    models of that repository for the same tritonserver (only beside a repository model): the
    env overrides (device, dtype, limits) apply to each, the proxy serves each (the main one
    first), and a dead stub of any of them restarts the server with all of them.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        model_name: str | None = None,
        device: str = "auto",
        dtype: str | None = None,
        quantization: str | None = None,
        engine_params: dict[str, str] | None = None,
        ports: Ports | None = None,
        address: str = "127.0.0.1",
        proxy: bool = False,
        log_path: Path | None = None,
        ready_timeout_s: float = 300.0,
        exit_timeout_s: int = 10,
        gpu_metrics: bool | None = None,
        die_with_parent: bool = True,
        drain_timeout_s: float | None = None,
        dist: ServerDist | None = None,
        verbose: bool = False,
        restrict_admin: bool = True,
        admin_key_file: Path | None = None,
        also: Sequence[str] = (),
        data_parallel_size: int | None = None,
    ) -> None:
        self.model = model
        self.data_parallel_size = data_parallel_size
        self.also = [also] if isinstance(also, str) else list(also)
        self.device = ("cuda" if has_gpu() else "cpu") if device == "auto" else device
        self.dtype, self.quantization = dtype, quantization
        self.engine_params = dict(engine_params or {})
        self.requested_name = model_name
        self.ports = ports or Ports()
        self.address = address
        self.want_proxy = proxy
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.exit_timeout_s = exit_timeout_s
        self.die_with_parent = die_with_parent
        self._drain_setting = drain_timeout_s
        self.stop_timeout_s = exit_timeout_s + 10.0  # Triton's own wait, then SIGKILL
        self.gpu_metrics = self.device.startswith("cuda") if gpu_metrics is None else gpu_metrics
        self.verbose = verbose
        # Triton's admin APIs need the key in this file (see dlm_triton/launch/admin_key.py)
        self.restrict_admin = restrict_admin
        self.admin_key_file: Path | None = admin_key_file
        self.dist = dist
        self.choice: ModelChoice | None = None
        self.server: subprocess.Popen | None = None
        self.proxy: subprocess.Popen | None = None
        self._stubs: dict[int, list[str]] = {}  # pid -> cmdline, seen while serving
        self._log_file = None
        self._lock = threading.Lock()
        self.last_stop: dict[str, object] = {}  # what stop() had to do, for tests and logs
        self.stop_requested = threading.Event()  # set by signal handlers; aborts start()
        self._run_dir: Path | None = None
        self.drain_file: Path | None = None
        self.drain_timeout_s = 0.0
        self.restarts = 0  # times the supervisor brought a dead model back
        # This server's own shm region prefix: its regions are found (and removed) by name on
        # every exit path, also when it dies before a stub command line was ever seen.
        self.shm_prefix = f"{SHM_PREFIX}_dlm{os.getpid()}_{secrets.token_hex(4)}_"
        self._shm_config = f"shm-region-prefix-name={self.shm_prefix}"
        self._supervisor: Supervisor | None = None
        self.restart_log: list[dict[str, object]] = []
        self.placement: dict[str, list[int]] = {}  # model -> first GPU of each instance

    # ----------------------------------------------------------------- model choice
    def _overrides(self) -> dict[str, str]:
        """The settings given to this launcher, by config parameter name (as text)."""
        params = dict(self.engine_params)
        if self.dtype:
            params["dtype"] = self.dtype
        if self.quantization:
            params["quantization"] = self.quantization
        params["device"] = self.device
        unknown = sorted(set(params) - set(settings.BY_PARAM))
        if unknown:
            raise ValueError(
                f"no server setting named {', '.join(unknown)} "
                f"(known: {', '.join(sorted(settings.BY_PARAM))})"
            )
        for key, value in params.items():  # a bad value is refused here, named, not at load
            setting = settings.BY_PARAM[key]
            params[key] = value if isinstance(value, str) else setting.text(value)
            setting.parse(params[key])
        return params

    def _choose_model(self) -> ModelChoice:
        """Checkpoint dir -> runtime repository; repo name -> committed repository + env."""
        target = DEFAULT_MODEL if self.model is None else str(self.model)
        path = Path(target).expanduser()
        repo = committed_repository()
        is_dir = path.is_dir() and (path / "config.json").exists()
        # hub ids ("org/name") and engine specs ("random:llada-8b") pass through to the loader
        is_spec = (
            any(c in target for c in "/:") and not path.exists() and not (repo / target).exists()
        )
        if (is_dir or is_spec) and self.also:
            raise ValueError(
                f"--also {', '.join(self.also)}: more models are served only beside a model of "
                f"{repo}, and --model {target!r} is a checkpoint (served from a runtime "
                "repository of its own); serve it alone (without --also, or --no-also)"
            )
        if is_dir or is_spec:
            checkpoint = str(path.resolve()) if is_dir else target
            base = path.resolve().name if is_dir else target.replace(":", "-").rsplit("/", 1)[-1]
            name = self.requested_name or model_repo.sanitize_name(base)
            overrides = self._overrides()
            checkpoint = overrides.pop("checkpoint", checkpoint)
            spec = model_repo.ModelSpec(name, checkpoint, **overrides)
            runtime = Path(tempfile.mkdtemp(prefix="dlm-triton-repo-"))
            model_repo.write_model(runtime, spec)
            return ModelChoice(runtime, name, {}, runtime_dir=runtime)
        if not (repo / target / "config.pbtxt").exists():
            known = sorted(p.name for p in repo.iterdir() if (p / "config.pbtxt").exists())
            raise ValueError(
                f"--model {target!r} is neither a checkpoint directory (with config.json), "
                f"a hub id, nor a model in {repo} ({', '.join(known)})"
            )
        env = {settings.BY_PARAM[k].env: v for k, v in self._overrides().items()}
        choice = ModelChoice(repo, target, env)
        if self.also:
            choice.also = self._check_also(choice)
        return choice

    def _place_instances(self, choice: ModelChoice) -> None:
        """Engine replicas: on GPUs one instance per group of `tensor_parallel_size` GPUs
        (`data_parallel_size` groups, default as many as fit), on the CPU `data_parallel_size`
        instances; written into a runtime copy of the served models' configs (their other
        files linked). With neither setting the configs stand (on GPUs Triton then puts one
        instance on each visible GPU)."""
        environ = {**os.environ, **choice.env}
        dp_text = self.data_parallel_size or environ.get(DATA_PARALLEL_ENV)
        dp = int(dp_text) if dp_text else None
        if dp is not None and dp < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {dp}")
        gpu = self.device.startswith("cuda")
        rel = "config.pbtxt" if gpu else f"configs/{model_repo.CPU_CONFIG_NAME}.pbtxt"
        tp_env = settings.BY_NAME["tensor_parallel_size"].env
        nodes_env = settings.BY_NAME["tensor_parallel_nodes"].env
        placed: dict[str, list[int]] = {}
        visible = None
        for name in choice.names:
            params = model_repo.read_parameters(choice.repository / name / "config.pbtxt")
            tp = int(environ.get(tp_env) or params.get("tensor_parallel_size") or 1)
            nodes = int(environ.get(nodes_env) or params.get("tensor_parallel_nodes") or 1)
            if nodes > 1:  # this host runs rank 0's share; one engine (its store's port)
                if dp not in (None, 1):
                    raise ValueError(
                        f"data_parallel_size {dp} with tensor_parallel_nodes {nodes}: a group "
                        "that spans hosts runs one engine per host (scale with more groups)"
                    )
                tp, dp = max(1, tp // nodes), 1
            if gpu and (tp > 1 or dp is not None):
                visible = visible_gpus() if visible is None else visible
                placed[name] = model_repo.instance_gpus(visible, tp, dp)
            elif not gpu and dp is not None:
                placed[name] = [0] * dp  # dp CPU instances
        if not placed:
            return
        runtime = choice.runtime_dir or Path(tempfile.mkdtemp(prefix="dlm-triton-repo-"))
        for name in choice.names:
            src, dst = choice.repository / name, runtime / name
            if src.resolve() != dst.resolve():
                dst.mkdir(parents=True, exist_ok=True)
                for entry in src.iterdir():  # configs copied, the rest (checkpoints) linked
                    if entry.name == "configs":
                        shutil.copytree(entry, dst / entry.name)
                    elif entry.name == "config.pbtxt":
                        shutil.copyfile(entry, dst / entry.name)
                    else:
                        (dst / entry.name).symlink_to(entry.resolve())
            if name in placed:
                config = dst / rel
                gpus, count = (placed[name], 1) if gpu else (None, len(placed[name]))
                text = model_repo.place_instances(config.read_text(), name, gpus, count)
                config.write_text(text)
        choice.repository, choice.runtime_dir = runtime, runtime
        self.placement = placed

    def _check_also(self, choice: ModelChoice) -> list[str]:
        """The ``also`` names, checked: models of ``choice``'s repository, no duplicates, and
        nothing one model's checkpoint needs that every model of the server would read."""
        repo, known = choice.repository, repository_models(choice.repository)
        seen = {choice.name}
        for name in self.also:
            if not (repo / name / "config.pbtxt").exists():
                raise ValueError(
                    f"--also {name!r} is not a model in {repo} (known: {', '.join(known)})"
                )
            if name in seen:
                what = "the main model" if name == choice.name else "given twice"
                raise ValueError(f"--also {name!r} is {what}: each model is served once")
            seen.add(name)
        environ = {**os.environ, **choice.env}
        if environ.get(SHARED_CHECKPOINT_VAR):
            raise ValueError(
                f"--also: {SHARED_CHECKPOINT_VAR} is set, and every model of the server would "
                "load that checkpoint; serve the model alone (without --also, or --no-also)"
            )
        for name in (choice.name, *self.also):
            checkpoint, _ = served_checkpoint(repo / name / "config.pbtxt", environ)
            if checkpoint is not None and "/" in checkpoint and not Path(checkpoint).exists():
                raise ValueError(
                    f"--also: {name!r} loads {checkpoint}, no local folder: a Hub id is fetched "
                    f"by the launcher and handed to the model through {SHARED_CHECKPOINT_VAR}, "
                    "which every model of the server reads; serve it alone (without --also, "
                    "or --no-also)"
                )
        return list(self.also)

    # ----------------------------------------------------------------- urls
    @property
    def model_name(self) -> str:
        assert self.choice is not None, "start() first"
        return self.choice.name

    @property
    def model_names(self) -> list[str]:
        """Every model this server loads, :attr:`model_name` first."""
        assert self.choice is not None, "start() first"
        return self.choice.names

    @property
    def urls(self) -> dict[str, str]:
        host = "127.0.0.1" if self.address in ("0.0.0.0", "127.0.0.1") else self.address
        urls = {
            "http": f"http://{host}:{self.ports.http}",
            "grpc": f"{host}:{self.ports.grpc}",
            "metrics": f"http://{host}:{self.ports.metrics}/metrics",
        }
        if self.choice:
            urls["generate_stream"] = f"{urls['http']}/v2/models/{self.choice.name}/generate_stream"
        if self.proxy is not None:
            urls["openai"] = f"http://{host}:{self.ports.proxy}/v1"
        return urls

    # ----------------------------------------------------------------- start
    def start(self) -> TritonServerProcess:
        """Start the server, wait until the model is ready, then start the proxy."""
        self.dist = self.dist or find_server()
        self.choice = self._choose_model()
        self._place_instances(self.choice)
        try:  # a Hub id is downloaded here, with progress on this terminal
            self.choice.env.update(fetch_checkpoint(self.choice.repository, self.choice.name))
            self._spawn()
            self._wait_ready()
            if self.want_proxy:
                self._start_proxy()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self) -> None:
        """Start tritonserver (not waiting for it); also used by :meth:`restart`."""
        assert self.dist is not None and self.choice is not None
        config_name = model_repo.CPU_CONFIG_NAME if self.device == "cpu" else None
        cmd = self.dist.command(
            self.choice.repository,
            http_port=self.ports.http,
            grpc_port=self.ports.grpc,
            metrics_port=self.ports.metrics,
            address=self.address,
            model_config_name=config_name,
            models=self.choice.names,
            gpu_metrics=self.gpu_metrics,
            log_verbose=1 if self.verbose else 0,
            exit_timeout_s=self.exit_timeout_s,
            extra_args=[*self._admin_args(), f"--backend-config=python,{self._shm_config}"],
        )
        # The model drains running requests in finalize(); it must end within Triton's exit
        # timeout or Triton gives up (exit 1) and the stubs are orphaned.
        if self._drain_setting is not None:
            self.drain_timeout_s = self._drain_setting
        else:
            default = max(1.0, self.exit_timeout_s / 2)  # inside Triton's exit timeout
            self.drain_timeout_s = float(os.environ.get("DLM_DRAIN_TIMEOUT", default))
        if self._run_dir is None:
            self._run_dir = Path(tempfile.mkdtemp(prefix="dlm-triton-run-"))
        self.drain_file = self._run_dir / "drain"
        env = {
            **self.dist.env,
            **self.choice.env,
            "DLM_DRAIN_TIMEOUT": str(self.drain_timeout_s),
            "DLM_DRAIN_FILE": str(self.drain_file),
            "DLM_RESTARTS": str(self.restarts),  # the model's dlm_model_restarts_total
        }
        out = None
        if self.log_path is not None and self._log_file is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - kept for the run
        out = self._log_file
        # Own session: Ctrl-C in a terminal must not reach the server before the proxy drains.
        # With die_with_parent (the default) it gets SIGTERM when this process dies, SIGKILL too.
        start = spawn if self.die_with_parent else subprocess.Popen
        self.server = start(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )  # fmt: skip

    def _admin_args(self) -> list[str]:
        if not self.restrict_admin:
            return []
        self.admin_key_file, key = admin_key.read_or_create(self.admin_key_file)
        return admin_key.server_args(key)

    def admin_headers(self, protocol: str = "http") -> dict[str, str]:
        """Headers (``http``) or gRPC metadata (``grpc``) that unlock Triton's admin APIs on
        this server; empty if unrestricted."""
        if not self.restrict_admin or self.admin_key_file is None:
            return {}
        name = admin_key.GRPC_HEADER if protocol == "grpc" else admin_key.HEADER
        return {name: admin_key.read_or_create(self.admin_key_file)[1]}

    def _wait_ready(self) -> None:
        if self.server is None or self.choice is None:
            raise StartAborted("stopped before the server was ready")
        base = f"http://127.0.0.1:{self.ports.http}"
        deadline = time.monotonic() + self.ready_timeout_s
        waiting = self.choice.names
        while time.monotonic() < deadline:
            self._record_stubs()
            if self.stop_requested.is_set():
                raise StartAborted("stop requested while the model was loading")
            server = self.server
            if server is None:
                raise StartAborted("stopped while the model was loading")
            if server.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with {server.returncode} while loading "
                    f"{', '.join(self.choice.names)}{self._log_tail()}"
                )
            if http_ok(f"{base}/v2/health/ready"):
                waiting = [n for n in waiting if not http_ok(f"{base}/v2/models/{n}/ready")]
                if not waiting:
                    self._record_stubs()
                    self._forget_exited_stubs()
                    return
            time.sleep(0.5)
        raise TimeoutError(
            f"tritonserver not ready in {self.ready_timeout_s}s (not ready: "
            f"{', '.join(waiting)}){self._log_tail()}"
        )

    def _start_proxy(self) -> None:
        assert self.choice is not None
        key_file = self.admin_key_file if self.restrict_admin else None
        cmd = proxy_command(self.ports, self.choice.names, self.address, key_file)
        if cmd is None:
            print("openai_proxy has no entry point yet: serving Triton only", file=sys.stderr)
            return
        out = None
        if self.log_path is not None:
            out = open(self.log_path.with_suffix(".proxy.log"), "ab")  # noqa: SIM115
        start = spawn if self.die_with_parent else subprocess.Popen
        self.proxy = start(
            cmd, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True
        )
        if out is not None:
            out.close()  # the child holds its own descriptor
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.stop_requested.is_set():
                raise StartAborted("stop requested while the proxy was starting")
            if self.proxy.poll() is not None:
                where = self.log_path.with_suffix(".proxy.log") if self.log_path else "stderr"
                raise RuntimeError(
                    f"the OpenAI proxy exited with {self.proxy.returncode} (reason in {where})"
                )
            if http_ok(f"http://127.0.0.1:{self.ports.proxy}/health") or http_ok(
                f"http://127.0.0.1:{self.ports.proxy}/v1/models"
            ):
                return
            time.sleep(0.3)
        raise TimeoutError("the OpenAI proxy did not answer within 60 s")

    def _log_tail(self, n: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n--- tritonserver log tail ---\n" + self.log_path.read_text(errors="replace")[-n:]

    # ----------------------------------------------------------------- stubs
    def _record_stubs(self) -> None:
        """Remember the stubs this server started (they outlive it if it is SIGKILLed)."""
        if self.server is None:
            return
        for child in proc_children(self.server.pid):
            cmd = cmdline(child)
            if cmd and cmd[0].endswith(STUB_NAME):
                self._stubs[child] = cmd

    def _forget_exited_stubs(self) -> None:
        """Once every model is ready, drop the stubs that ended during loading: Triton runs a
        short-lived stub per model for its config auto-complete, and the supervisor must not
        take that one's exit for a dead model."""
        self._stubs = {
            pid: cmd for pid, cmd in self._stubs.items() if alive(pid) and cmdline(pid) == cmd
        }

    def stub_pids(self) -> list[int]:
        """Stubs of this server still alive."""
        self._record_stubs()
        return [pid for pid, cmd in self._stubs.items() if alive(pid) and cmdline(pid) == cmd]

    def shm_files(self) -> list[Path]:
        """``/dev/shm`` regions named on this server's stub command lines that still exist."""
        names = {a for cmd in self._stubs.values() for a in cmd if a.startswith(SHM_PREFIX)}
        names |= {a.lstrip("/") for cmd in self._stubs.values() for a in cmd if SHM_PREFIX in a}
        names |= {p.name for p in SHM_DIR.glob(f"{self.shm_prefix}*")}
        return [SHM_DIR / n for n in sorted(names) if (SHM_DIR / n).exists()]

    # ----------------------------------------------------------------- stop
    def running(self) -> bool:
        return self.server is not None and self.server.poll() is None

    def stop(self) -> None:
        """Proxy first (drain), then the server (bounded wait, SIGKILL), stubs, shm files."""
        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None
        with self._lock:
            if self.proxy is not None:
                terminate(self.proxy, timeout=PROXY_DRAIN_S)
                self.proxy = None
            if self.server is not None:
                self._record_stubs()
                t0 = time.monotonic()
                drained = self._drain()
                killed = terminate(self.server, timeout=self.stop_timeout_s)
                report = {"drained": drained, "server_exit": self.server.returncode}
                report["server_killed"] = killed
                report["stop_s"] = round(time.monotonic() - t0, 2)
                report.update(self._kill_leftovers())
                self.last_stop = report
                self.server = None
            if self._run_dir is not None:
                shutil.rmtree(self._run_dir, ignore_errors=True)
                self._run_dir = None
            if self.choice is not None and self.choice.runtime_dir is not None:
                shutil.rmtree(self.choice.runtime_dir, ignore_errors=True)
                self.choice.runtime_dir = None
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def _kill_leftovers(self) -> dict[str, int]:
        """SIGKILL what is left of the server's session and its stubs; remove their shm."""
        assert self.server is not None
        with suppress():  # anything else left in the server's own session
            os.killpg(self.server.pid, signal.SIGKILL)
        leftover = self.stub_pids()
        for pid in leftover:
            with suppress():
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self.stub_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        shm = self.shm_files()
        for path in shm:
            with suppress():
                path.unlink()
        boards = remove_boards(self.server.pid)  # the instances' load board, if several
        return {"stubs_killed": len(leftover), "shm_removed": len(shm) + len(boards)}

    # ----------------------------------------------------------------- supervision
    def dead_reason(self) -> str | None:
        """Why the served model is dead (tritonserver exited, a stub died), or None."""
        server = self.server
        if server is None or self.stop_requested.is_set():
            return None
        if server.poll() is not None:
            return f"tritonserver exited with {server.returncode}"
        self._record_stubs()
        for pid, cmd in list(self._stubs.items()):
            if not alive(pid) or cmdline(pid) != cmd:
                return f"model stub {pid} died"
        return None

    def restart(self, reason: str) -> None:
        """Bring a dead model back: SIGKILL the server at once (a dead stub's requests would
        hang until Triton's exit timeout; killed, every client connection ends now with an
        error), remove its stubs and shm, start it again on the same ports, wait ready."""
        with self._lock:
            if self.server is None or self.stop_requested.is_set():
                return
            t0 = time.monotonic()
            with suppress():
                self.server.kill()
            with suppress(), contextlib.suppress(subprocess.TimeoutExpired):
                self.server.wait(timeout=10)
            cleaned = self._kill_leftovers()
            self._stubs.clear()
            self.restarts += 1
            self._spawn()
        self._wait_ready()
        self.restart_log.append(
            {"reason": reason, "restart_s": round(time.monotonic() - t0, 2), **cleaned}
        )

    def _drain(self) -> bool:
        """Ask the model to finish (or abort) its requests before SIGTERM.

        Triton 2.51 does not unload a decoupled model while its requests are open, so a SIGTERM
        with requests generating runs into the exit timeout (exit 1, sometimes a crash). The
        model's watcher sees this file, refuses new requests, lets running ones finish for
        ``DLM_DRAIN_TIMEOUT`` s, aborts the rest, and answers with ``drained-<instance>`` once
        idle (one file per model instance).
        """
        if self.drain_file is None or not self.running():
            return False
        self.drain_file.touch()
        instances = max(1, len(self.stub_pids()))
        deadline = time.monotonic() + self.drain_timeout_s + 5.0
        while time.monotonic() < deadline and self.running():
            if len(list(self.drain_file.parent.glob("drained-*"))) >= instances:
                return True
            time.sleep(0.05)
        return False

    def __enter__(self) -> TritonServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------- foreground
    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM request a stop, also while :meth:`start` still waits for the model
        (``docker stop`` during a long load must not kill the launcher and orphan the server)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop_requested.set())

    def supervise(self) -> Supervisor:
        """Watch the server and its stubs from now on; a death restarts the server."""
        if self._supervisor is None:
            self._supervisor = Supervisor(self).start()
        return self._supervisor

    def serve_forever(self) -> int:
        """Block until Ctrl-C / SIGTERM or the proxy dies (a dead model is restarted by the
        supervisor); then stop everything."""
        self.install_signal_handlers()
        self.supervise()
        try:
            while not self.stop_requested.wait(1.0):
                if self.proxy is not None and self.proxy.poll() is not None:
                    print("the OpenAI proxy exited unexpectedly", file=sys.stderr)
                    return 1
                self._record_stubs()
            return 0
        finally:
            print("stopping ...", file=sys.stderr)
            self.stop()
            print(f"stopped: {json.dumps(self.last_stop)}", file=sys.stderr)

    def runtime(self) -> dict[str, str]:
        """What the loaded model reports of itself (dtype and why, device, torch threads, and
        compiled kernels that fell back to eager, if any did)."""
        text = http_text(f"http://127.0.0.1:{self.ports.metrics}/metrics")
        info = model_info(text, self.model_name)
        fallbacks = fused_fallbacks(text, self.model_name)
        if fallbacks:
            info["fused_kernel_fallbacks"] = str(fallbacks)
        return info

    def describe(self) -> str:
        info = {
            "model": self.model_name,
            "models": self.model_names,
            "device": self.device,
            **self.runtime(),
            **self.urls,
        }
        if self.placement:  # per model: the first GPU of each instance (CPU: zeros)
            info["instances"] = self.placement
        return json.dumps(info, indent=2)
