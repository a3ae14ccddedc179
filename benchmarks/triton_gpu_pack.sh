#!/usr/bin/env bash
# Pack what benchmarks/triton_gpu_device.sh needs on a GPU machine that has python3 + torch but
# no tritonserver, tritonclient or numpy<2, and no network: one tar.xz laid out like a
# site-packages folder (the device run carries 64 MiB at most, with the tree; this is about 38 MB):
#   pytriton/tritonserver/{bin/tritonserver, backends/python/*, python_backend_stubs/<py>/*}
#   nvidia_pytriton.libs/*  (all but the libpython of another version)
#   numpy==1.26.4 (the 2.51 stub breaks on numpy 2), tritonclient and its gRPC dependencies,
#   unpacked from cp<py> manylinux wheels, tests, numpy's C headers and static libraries and its
#   test-only _simd module left out.
# Debug info and static symbol tables are stripped (binutils' strip): ml_dtypes' and
# python-rapidjson's extensions ship DWARF, tritonserver and libtritonserver full symbol tables.
# The dynamic symbols that loading and the backends use stay. xz compresses with the x86 filter
# (machine code compresses better) in one block whose dictionary holds the whole tar (one thread,
# about 3 minutes); Python's tarfile reads it as any .xz.
# Run from a checkout whose .venv has the serve extra (nvidia-pytriton) installed:
#   benchmarks/triton_gpu_pack.sh [DEST]        (default .tritongpu/site.tar.xz, git-ignored)
# PY_TAG=3.12 picks the stub and wheels; WHEELS=0 packs the server only; PROXY=0 leaves out
# the OpenAI proxy's stack (FastAPI, uvicorn, pydantic, httpx); XZ_FILTERS sets xz's filters.
set -euo pipefail
command -v strip >/dev/null && command -v readelf >/dev/null || {
    echo "strip and readelf (binutils) are needed" >&2
    exit 1
}
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PY_TAG:-3.12}
dest=$(realpath -m "${1:-$repo/.tritongpu/site.tar.xz}")
root=$("$repo/.venv/bin/python" -c 'from dlm_triton.launch.server_dist import wheel_root; print(wheel_root() or "")')
[ -n "$root" ] || { echo "nvidia-pytriton is not installed in $repo/.venv" >&2; exit 1; }
src=$(dirname "$(dirname "$root")")  # site-packages
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
site=$stage/site
mkdir -p "$site/pytriton/tritonserver/bin" "$site/pytriton/tritonserver/backends/python" \
    "$site/pytriton/tritonserver/python_backend_stubs/$py" "$site/nvidia_pytriton.libs"
touch "$site/pytriton/__init__.py"  # empty: only server_dist's lookup needs the package
cp "$root/bin/tritonserver" "$site/pytriton/tritonserver/bin/"
cp "$root/backends/python/libtriton_python.so" "$root/backends/python/triton_python_backend_utils.py" \
    "$site/pytriton/tritonserver/backends/python/"
cp "$root/python_backend_stubs/$py/triton_python_backend_stub" \
    "$site/pytriton/tritonserver/python_backend_stubs/$py/"
for lib in "$src"/nvidia_pytriton.libs/*; do
    case $(basename "$lib") in libpython3-*) ;; *) cp "$lib" "$site/nvidia_pytriton.libs/" ;; esac
done
if [ "${WHEELS:-1}" = 1 ]; then
    "$repo/.venv/bin/pip" download -q --no-deps --only-binary=:all: --python-version "$py" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$stage/wheels" \
        numpy==1.26.4 tritonclient==2.73.0 python-rapidjson==1.25 grpcio==1.85.1 \
        protobuf==6.33.6 ml-dtypes==0.5.4
    if [ "${PROXY:-1}" = 1 ]; then  # the OpenAI proxy's stack (traffic.py --target proxy)
        "$repo/.venv/bin/pip" download -q --no-deps --only-binary=:all: --python-version "$py" \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d "$stage/wheels" \
            fastapi==0.165.0 annotated-doc==0.0.7 starlette==1.10.0 pydantic==2.14.3 \
            pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
            typing_extensions==4.16.0 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 anyio==4.16.0 \
            sniffio==1.3.1 idna==3.20 httpx==0.28.1 httpcore==1.0.9 certifi==2026.10.18 \
            opentelemetry-api==1.45.2
    fi
    for w in "$stage"/wheels/*.whl; do "$repo/.venv/bin/python" -m zipfile -e "$w" "$site/"; done
    rm -rf "$site"/numpy/*/tests "$site"/numpy/tests "$site"/numpy/f2py "$site"/numpy/_pyinstaller \
        "$site"/tritonclient/http "$site"/tritonclient/_plugins "$site"/tritonhttpclient \
        "$site"/numpy/core/include "$site"/numpy/core/lib "$site"/numpy/core/_simd.*.so \
        "$site"/numpy/random/lib "$site"/numpy/random/_examples
fi
strip --strip-unneeded "$site/pytriton/tritonserver/bin/tritonserver" \
    "$site"/nvidia_pytriton.libs/libtritonserver-*.so
find "$site" -name '*.so' -type f -print0 | while IFS= read -r -d '' so; do
    # grep reads all of readelf's output: with -q it could exit first, and under pipefail the
    # readelf killed by SIGPIPE would make the test false
    if readelf -S "$so" | grep '\.debug_info' >/dev/null; then strip --strip-debug "$so"; fi
done
find "$site" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p "$(dirname "$dest")"
tar -cf - -C "$site" . | xz ${XZ_FILTERS:---x86 --lzma2=preset=9e,dict=256MiB} -T1 >"$dest"
ls -l "$dest"
