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
    """(path, "") when Chromium is usable, else (None, why not) for the skip message."""
    if CHROMIUM.exists():
        return CHROMIUM, ""
    if shutil.which("apt-get") is None:
        return None, "Chromium is not installed and this machine has no apt-get to install it"
    sudo: list[str] = []
    if os.geteuid() != 0:
        if shutil.which("sudo") is None:
            return None, "Chromium is not installed; installing it needs root (or sudo)"
        sudo = ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "-o", "DPkg::Lock::Timeout=300", "chromium"],
    ):
        try:
            done = subprocess.run(
                sudo + cmd, env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"installing Chromium failed: {' '.join(cmd)}: {exc}"
        if done.returncode != 0:
            tail = (done.stderr or done.stdout)[-600:]
            return None, f"installing Chromium failed: {' '.join(cmd)}: {tail}"
    if not CHROMIUM.exists():
        return None, f"apt-get installed chromium but {CHROMIUM} is missing"
    return CHROMIUM, ""
