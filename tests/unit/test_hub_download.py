"""The download path itself, against a small local stand-in for the Hub's HTTP API (the few
routes huggingface_hub's snapshot_download calls: repo info, file tree, file resolve). What it
proves with the real client code: only the loader's files are fetched, the token (from a
secret file) is sent, a revision resolves to its commit, and the cache it leaves behind loads
offline afterwards."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from dlm_engine.hub import CheckpointNotFoundError, resolve_checkpoint
from dlm_engine.loader import load_checkpoint

REPO = "test-org/Tiny-Remote"
COMMIT = "c" * 40
TOKEN = "hf_test_secret"
EXTRA_FILES = {  # published beside the weights, never needed by the loader
    "modeling_llada.py": b"raise SystemExit('remote code must never be fetched')\n",
    "pytorch_model.bin": b"\0" * 4096,
    "README.md": b"# card\n",
}


class FakeHub:
    """Serves one repository at one commit; records every request."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.requests: list[tuple[str, str, str]] = []  # (method, path, authorization)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet test output
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
                hub.answer(self, body=False)

            def do_GET(self) -> None:  # noqa: N802
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path, h.headers.get("authorization", "")))
        api = f"/api/models/{REPO}"
        if path in (f"{api}/revision/main", f"{api}/revision/{COMMIT}"):
            siblings = [{"rfilename": n} for n in self.files]
            return self.send_json(
                h, {"id": REPO, "modelId": REPO, "sha": COMMIT, "siblings": siblings}
            )
        if path.startswith(f"{api}/revision/"):
            return self.send_json(
                h, {"error": "Invalid rev id"}, 404, {"X-Error-Code": "RevisionNotFound"}
            )
        if path.startswith(f"{api}/tree/{COMMIT}"):
            return self.send_json(h, [self.entry(n, d) for n, d in self.files.items()])
        prefix = f"/{REPO}/resolve/{COMMIT}/"
        if path.startswith(prefix) and path[len(prefix) :] in self.files:
            data = self.files[path[len(prefix) :]]
            h.send_response(200)
            h.send_header("X-Repo-Commit", COMMIT)
            h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if body:
                h.wfile.write(data)
            return None
        return self.send_json(
            h, {"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"}
        )

    @staticmethod
    def entry(name: str, data: bytes) -> dict[str, object]:
        item: dict[str, object] = {
            "type": "file",
            "path": name,
            "size": len(data),
            "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
        }
        if name.endswith((".safetensors", ".bin")):
            item["lfs"] = {
                "oid": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "pointerSize": 134,
            }
        return item

    @staticmethod
    def send_json(
        h: BaseHTTPRequestHandler,
        obj: object,
        status: int = 200,
        extra: dict[str, str] | None = None,
    ) -> None:
        data = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for key, value in (extra or {}).items():
            h.send_header(key, value)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def fetched(self) -> set[str]:
        prefix = f"/{REPO}/resolve/{COMMIT}/"
        return {
            p[len(prefix) :] for m, p, _ in self.requests if m == "GET" and p.startswith(prefix)
        }


@pytest.fixture()
def hub(
    ckpt_dir: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeHub]:
    files = {p.name: p.read_bytes() for p in sorted(ckpt_dir["llada"].iterdir()) if p.is_file()}
    fake = FakeHub({**files, **EXTRA_FILES})
    thread = threading.Thread(target=fake.server.serve_forever, daemon=True)
    thread.start()
    secret = tmp_path / "hf_token"
    secret.write_text(TOKEN + "\n")
    for var in ("HF_HUB_CACHE", "HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_TOKEN_PATH", str(secret))
    try:
        yield fake
    finally:
        fake.server.shutdown()
        fake.server.server_close()


def test_download_fetches_only_loader_files_with_the_token(
    hub: FakeHub, tmp_path: Path, ckpt_dir: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = resolve_checkpoint(REPO)
    cache = tmp_path / "hf-home" / "hub" / "models--test-org--Tiny-Remote"
    assert folder == cache / "snapshots" / COMMIT
    assert (cache / "refs" / "main").read_text() == COMMIT
    wanted = {n for n in hub.files if n not in EXTRA_FILES}
    assert hub.fetched() == wanted  # no modelling code, no .bin, no README
    assert {p.name for p in folder.iterdir()} == wanted
    assert hub.requests and all(auth == f"Bearer {TOKEN}" for _, _, auth in hub.requests)
    # The cache it wrote serves offline, with no request at all.
    seen = len(hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_checkpoint(REPO)
    assert loaded.path == folder and len(hub.requests) == seen
    assert loaded.mask_id == load_checkpoint(ckpt_dir["llada"]).mask_id


def test_a_pinned_commit_skips_revision_lookup(hub: FakeHub) -> None:
    assert resolve_checkpoint(REPO, COMMIT).name == COMMIT
    assert not [p for _, p, _ in hub.requests if "/revision/" in p]


def test_hub_errors_are_one_clear_line(hub: FakeHub) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no revision 'v404'"):
        resolve_checkpoint(REPO, "v404")
    with pytest.raises(CheckpointNotFoundError, match="'test-org/absent' does not exist"):
        resolve_checkpoint("test-org/absent")


def test_download_command_seeds_the_cache_for_offline_serving(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`dlm-triton download` on a connected host = the files `serve` needs offline later."""
    from dlm_triton.launch.cli import main

    assert main(["download", REPO, "--revision", COMMIT]) == 0
    folder = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert folder.name == COMMIT and hub.fetched() == {n for n in hub.files if n not in EXTRA_FILES}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_checkpoint(REPO, COMMIT) == folder
    assert main(["download", "tiny-dlm"]) == 2  # an embedded model: nothing to download
    assert "names no Hub id" in capsys.readouterr().err
