"""The load board that lets the instances of one model steer requests to the least busy one:
loads cross process boundaries through files, a dead sibling is forgotten, a waiting instance
resumes as soon as it is no longer the busier one, and nothing is left behind."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dlm_triton.instance_load import LoadBoard, board_dir, remove_boards


@pytest.fixture
def sibling_pid():
    """A live process standing in for a sibling stub; killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_board_dir_is_per_server_and_model(tmp_path: Path) -> None:
    a = board_dir("llada-8b-instruct", 123, tmp_path)
    assert a.name == "dlm_load_123_llada-8b-instruct"
    assert board_dir("a/b c", 123, tmp_path).name == "dlm_load_123_a_b_c"
    assert board_dir("llada-8b-instruct", 124, tmp_path) != a


def test_loads_cross_between_boards(tmp_path: Path, sibling_pid) -> None:
    d = board_dir("m", 1, tmp_path)
    me = LoadBoard(d)
    other = LoadBoard(d, pid=sibling_pid.pid)
    assert me.siblings() == {sibling_pid.pid: 0}
    other.publish(7)
    assert me.siblings() == {sibling_pid.pid: 7}
    assert not me.busier_than_a_sibling(7)  # equal: no sibling is strictly less busy
    assert me.busier_than_a_sibling(8)
    me.publish(3)
    assert other.siblings()[me.pid] == 3
    me.close()
    other.close()
    assert not d.exists()


def test_alone_never_waits(tmp_path: Path) -> None:
    me = LoadBoard(board_dir("m", 2, tmp_path))
    assert not me.busier_than_a_sibling(1000)
    assert me.wait_turn(lambda: 1000, lambda: False, max_wait_s=5.0) < 1.0
    me.close()


def test_dead_sibling_is_forgotten_and_its_file_removed(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    d = board_dir("m", 3, tmp_path)
    me = LoadBoard(d)
    ghost = LoadBoard(d, pid=proc.pid)
    ghost.publish(0)
    assert me.siblings() == {}
    assert not ghost.path.exists()
    assert not me.busier_than_a_sibling(50)
    me.close()


def test_wait_turn_resumes_when_the_sibling_catches_up(tmp_path: Path, sibling_pid) -> None:
    d = board_dir("m", 4, tmp_path)
    me = LoadBoard(d)
    other = LoadBoard(d, pid=sibling_pid.pid)
    other.publish(1)

    def sibling_takes_work() -> None:
        time.sleep(0.3)
        other.publish(5)

    t = threading.Thread(target=sibling_takes_work)
    t.start()
    waited = me.wait_turn(lambda: 5, lambda: False, max_wait_s=30.0)
    t.join()
    assert 0.25 <= waited < 20.0
    assert other.siblings()[me.pid] == 5  # it published the load it waited with
    me.close()
    other.close()


def test_wait_turn_is_bounded_and_stoppable(tmp_path: Path, sibling_pid) -> None:
    d = board_dir("m", 5, tmp_path)
    me = LoadBoard(d)
    LoadBoard(d, pid=sibling_pid.pid)  # stays at 0: a sibling that never takes work
    waited = me.wait_turn(lambda: 3, lambda: False, max_wait_s=0.2)
    assert 0.2 <= waited < 10.0
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    waited = me.wait_turn(lambda: 3, stop.is_set, max_wait_s=30.0)
    assert waited < 10.0
    me.close()
    assert d.exists()  # the sibling's file is still there


def test_remove_boards_takes_only_that_servers(tmp_path: Path) -> None:
    mine = LoadBoard(board_dir("m", 6, tmp_path))
    theirs = LoadBoard(board_dir("m", 7, tmp_path))
    removed = remove_boards(6, tmp_path)
    assert removed == [board_dir("m", 6, tmp_path)]
    assert not board_dir("m", 6, tmp_path).exists()
    assert board_dir("m", 7, tmp_path).exists()
    mine.close()
    theirs.close()
