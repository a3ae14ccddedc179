"""Resolve the images' install set into ``docker/constraints.txt``, or check that it still does.

One file pins both the images and the test suite: the triton image installs into the Python
of NVIDIA's tritonserver image (3.12; docs/deployment.md says which release and why), the suite
runs on Debian's Python 3.11 (its Triton stub embeds that libpython). So the set is resolved for
the older one and must resolve to the very same versions for the image's Python too (binary
wheels only, PyPI, manylinux x86_64). ``python docker/lock.py`` rewrites the file;
``python docker/lock.py --check`` resolves again *under* the file for each Python and fails if
a result differs (a dependency added to pyproject.toml without re-locking, a pin that no longer
resolves, a yanked release). tests/integration/test_image_lock.py runs the check in CI.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "docker" / "constraints.txt"
INPUTS = [ROOT / "pyproject.toml", ROOT / "docker" / "requirements-image.in"]
EXTRAS = ["quant"]
IMAGE_PYTHON = "3.12"  # nvcr.io/nvidia/tritonserver:26.02-py3: Ubuntu 24.04, Python 3.12
SUITE_PYTHON = "3.11"  # the Makefile's venv (Debian's python3.11)
PYTHONS = (SUITE_PYTHON, IMAGE_PYTHON)  # resolved for the first, checked for each
IMAGE_PLATFORM = "x86_64-manylinux_2_28"  # glibc 2.39 in the image; 2.28 = torch's wheel tag
INDEX_URL = "https://pypi.org/simple"
_PIN = re.compile(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", re.M)


def uv_binary() -> str:
    from uv import find_uv_bin  # the `uv` package of the dev extra

    return find_uv_bin()


def compile_command(
    output: Path, constraints: Path | None = None, python: str = PYTHONS[0]
) -> list[str]:
    """``uv pip compile`` of INPUTS for one Python on the image's platform, wheels only."""
    cmd = [
        uv_binary(), "pip", "compile", "--no-config", "--quiet",
        "--python-version", python, "--python-platform", IMAGE_PLATFORM,
        "--index-url", INDEX_URL, "--only-binary", ":all:",
        "--custom-compile-command", "python docker/lock.py",
        *[a for extra in EXTRAS for a in ("--extra", extra)],
        *[str(p.relative_to(ROOT)) for p in INPUTS],
        "--output-file", str(output),
    ]  # fmt: skip
    if constraints is not None:
        cmd += ["--constraints", str(constraints)]
    return cmd


def pins(text: str) -> dict[str, str]:
    """``name -> version`` of a requirements file (names normalised as PEP 503 does)."""
    return {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in _PIN.findall(text)}


def resolve(python: str, constraints: Path | None = LOCK, timeout: float = 300) -> dict[str, str]:
    """Pins of a fresh resolution for ``python`` (under ``constraints``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "resolved.txt"
        proc = subprocess.run(
            compile_command(out, constraints, python),
            cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"uv pip compile for Python {python} failed:\n{proc.stderr.strip()}")
        return pins(out.read_text())


def differences(locked: dict[str, str], fresh: dict[str, str], python: str) -> list[str]:
    """What a fresh resolution for ``python`` changes against the lock (empty = current)."""
    problems = [
        f"{n}=={fresh[n]} is needed but not locked" for n in sorted(set(fresh) - set(locked))
    ]
    problems += [f"{n}=={v} is locked but not needed" for n, v in locked.items() if n not in fresh]
    problems += [
        f"{n}: locked {locked[n]}, resolved {fresh[n]}"
        for n in sorted(set(fresh) & set(locked))
        if fresh[n] != locked[n]
    ]
    return [f"Python {python}: {p}" for p in problems]


def check() -> list[str]:
    """Resolve under the lock for every Python at once (uv is network-bound); list problems."""
    from concurrent.futures import ThreadPoolExecutor

    locked = pins(LOCK.read_text())
    with ThreadPoolExecutor(len(PYTHONS)) as pool:
        fresh = dict(zip(PYTHONS, pool.map(resolve, PYTHONS), strict=True))
    return [p for py in PYTHONS for p in differences(locked, fresh[py], py)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the lock is stale")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for line in problems:
            print(f"docker/constraints.txt: {line}", file=sys.stderr)
        if problems:
            print("run `python docker/lock.py` and commit the result", file=sys.stderr)
        return 1 if problems else 0
    subprocess.run(compile_command(LOCK), cwd=ROOT, check=True, timeout=600)
    print(f"wrote {LOCK.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
