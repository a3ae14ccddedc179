"""Engine replicas per model: which GPU each Triton instance starts on (groups of
tensor_parallel_size GPUs, data_parallel_size of them), the config text that places them, the
visible-GPU count, and the launcher's runtime copy of the served configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlm_triton.launch import launcher as launcher_mod
from dlm_triton.launch import model_repo
from dlm_triton.launch.launcher import TritonServerProcess
from dlm_triton.launch.procs import visible_gpus


@pytest.mark.parametrize(
    ("visible", "tp", "dp", "want"),
    [
        (4, 1, None, [0, 1, 2, 3]),
        (4, 2, None, [0, 2]),
        (4, 2, 1, [0]),
        (8, 4, 2, [0, 4]),
        (3, 2, None, [0]),  # the odd GPU stays free
        (2, 1, 1, [0]),
    ],
)
def test_instance_gpus(visible: int, tp: int, dp: int | None, want: list[int]) -> None:
    assert model_repo.instance_gpus(visible, tp, dp) == want


@pytest.mark.parametrize(
    ("visible", "tp", "dp", "words"),
    [(1, 2, None, "tensor_parallel_size 2 needs 2 GPUs"), (4, 2, 3, "data_parallel_size 3")],
)
def test_instance_gpus_refuses_what_does_not_fit(visible, tp, dp, words) -> None:
    with pytest.raises(ValueError, match=words):
        model_repo.instance_gpus(visible, tp, dp)


def _spec_text(kind: str) -> str:
    return model_repo.render_config(model_repo.ModelSpec("m", "tiny-dlm"), kind)


def test_place_instances_rewrites_the_one_instance_group() -> None:
    gpu = model_repo.place_instances(_spec_text("KIND_GPU"), "m", gpus=[0, 2])
    # a group per GPU: Triton names the instances m_0_0 and m_1_0, so their metrics differ
    assert (
        "instance_group [ { count: 1, kind: KIND_GPU, gpus: [ 0 ] }, "
        "{ count: 1, kind: KIND_GPU, gpus: [ 2 ] } ]"
    ) in gpu
    assert gpu.count("instance_group") == 1
    cpu = model_repo.place_instances(_spec_text("KIND_CPU"), "m", count=3)
    assert "instance_group [ { count: 3, kind: KIND_CPU } ]" in cpu
    # everything else unchanged
    strip = [ln for ln in gpu.splitlines() if not ln.startswith("instance_group")]
    assert strip == [ln for ln in _spec_text("KIND_GPU").splitlines() if "instance_group" not in ln]


def test_place_instances_leaves_a_hand_written_group_to_its_author() -> None:
    text = _spec_text("KIND_GPU").replace(
        "instance_group [ { count: 1, kind: KIND_GPU } ]",
        "instance_group [ { count: 1, kind: KIND_GPU, gpus: [0] }, { count: 1, kind: KIND_GPU, "
        "gpus: [3] } ]",
    )
    with pytest.raises(ValueError, match="instance_group of its own"):
        model_repo.place_instances(text, "m", gpus=[0, 2])


def test_visible_gpus_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, want in [("0,1,2", 3), ("", 0), ("3", 1), ("0,-1,2", 1), ("GPU-abc,GPU-def", 2)]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert visible_gpus() == want


def _launcher(device: str, **kw) -> TritonServerProcess:
    server = TritonServerProcess("tiny-dlm", device=device, also=(), **kw)
    server.choice = server._choose_model()
    return server


def test_launcher_places_tensor_parallel_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher_mod, "visible_gpus", lambda: 4)
    server = _launcher("cuda", engine_params={"tensor_parallel_size": 2})
    committed = server.choice.repository
    server._place_instances(server.choice)
    try:
        runtime = server.choice.repository
        assert runtime != committed and server.choice.runtime_dir == runtime
        config = (runtime / "tiny-dlm" / "config.pbtxt").read_text()
        assert "gpus: [ 0 ] }, { count: 1, kind: KIND_GPU, gpus: [ 2 ]" in config
        assert server.placement == {"tiny-dlm": [0, 2]}
        model_py = runtime / "tiny-dlm" / "1"
        assert model_py.is_symlink() and model_py.resolve() == (committed / "tiny-dlm" / "1")
        # the committed repository is untouched
        assert "gpus" not in (committed / "tiny-dlm" / "config.pbtxt").read_text()
    finally:
        server.stop()
    assert not runtime.exists()


def test_launcher_data_parallel_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher_mod, "visible_gpus", lambda: 4)
    server = _launcher("cuda", data_parallel_size=3)
    server._place_instances(server.choice)
    try:
        assert server.placement == {"tiny-dlm": [0, 1, 2]}
    finally:
        server.stop()
    monkeypatch.setenv("DLM_DATA_PARALLEL_SIZE", "3")
    server = _launcher("cuda", engine_params={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="data_parallel_size 3 x tensor_parallel_size 2"):
        server._place_instances(server.choice)


def test_launcher_cpu_instances_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    server = _launcher("cpu")
    before = server.choice.repository
    server._place_instances(server.choice)
    assert server.choice.repository == before and server.placement == {}
    server = _launcher("cpu", data_parallel_size=2)
    server._place_instances(server.choice)
    try:
        rel = Path("tiny-dlm") / "configs" / f"{model_repo.CPU_CONFIG_NAME}.pbtxt"
        assert "count: 2, kind: KIND_CPU" in (server.choice.repository / rel).read_text()
    finally:
        server.stop()


def test_launcher_places_one_engine_for_a_group_across_hosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tensor_parallel_size 16 over 2 hosts: this host runs rank 0's 8 ranks, one engine."""
    monkeypatch.setattr(launcher_mod, "visible_gpus", lambda: 8)
    params = {"tensor_parallel_size": 16, "tensor_parallel_nodes": 2}
    server = _launcher("cuda", engine_params=params)
    server._place_instances(server.choice)
    try:
        assert server.placement == {"tiny-dlm": [0]}
    finally:
        server.stop()
    monkeypatch.setenv("DLM_DATA_PARALLEL_SIZE", "2")
    server = _launcher("cuda", engine_params=params)
    with pytest.raises(ValueError, match="data_parallel_size 2 with tensor_parallel_nodes 2"):
        server._place_instances(server.choice)
