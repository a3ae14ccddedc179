"""Debian's Chromium for the browser tests: found, or installed with apt-get when missing.

Playwright's own browser download cannot work on these machines (no internet but the package
registries), so the tests drive the distribution's Chromium through Playwright's driver.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium's own connections are refused here and it
# stalls; --disable-gpu because the test machines have none.
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def ensure_chromium(timeout_s: float = 900) -> tuple[Path | None, str]:
    """(path, "") when Chromium is usable; (None, why) where installing it is impossible here
    (no apt-get, no root): the caller skips. A failed install where it should work raises:
    that is a broken machine, not a reason to skip."""
    if CHROMIUM.exists():
        return CHROMIUM, ""
    if shutil.which("apt-get") is None:
        return None, "Chromium is not installed and this machine has no apt-get to install it"
    sudo: list[str] = []
    if os.geteuid() != 0:
        sudo = ["sudo", "-n"]
        if shutil.which("sudo") is None or _run([*sudo, "true"], dict(os.environ), 30):
            return None, "Chromium is not installed; installing it needs root or passwordless sudo"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # A failed index update (one unreachable source) need not stop the install: only the
    # install's own failure does, reported with the update's output too.
    update = _run(sudo + ["apt-get", "update"], env, timeout_s)
    install = _run(
        sudo + ["apt-get", "install", "-y", "-o", "DPkg::Lock::Timeout=300", "chromium"],
        env,
        timeout_s,
    )
    if install:
        raise RuntimeError(f"apt-get install chromium failed: {install} (update: {update or 'ok'})")
    if not CHROMIUM.exists():
        raise RuntimeError(f"apt-get installed chromium but {CHROMIUM} is missing")
    return CHROMIUM, ""


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> str:
    """'' on success, else the tail of what went wrong."""
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode != 0:
        return (done.stderr or done.stdout)[-600:].strip() or f"exit {done.returncode}"
    return ""
