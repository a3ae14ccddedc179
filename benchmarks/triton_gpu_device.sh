#!/usr/bin/env bash
# Run benchmarks/triton_gpu_bench.py on a GPU machine whose python3 has torch (and numpy 2) but
# no tritonserver, tritonclient or numpy<2, from the pack that benchmarks/triton_gpu_pack.sh
# writes (.tritongpu/site.tar.xz: the wheel's tritonserver files laid out as in site-packages,
# numpy 1.26.4, tritonclient and its gRPC dependencies for cp312).
#
# A venv of that python3's base interpreter gets a .pth: the pack first (numpy<2 for the 3.12
# stub), then this repository, then the machine's torch site-packages. With the venv's python
# running the benchmark, the launcher puts its bin/ first on PATH for the stub and finds the
# server through the pack's `pytriton` folder (dlm_triton/launch/server_dist.py, wheel layout).
#
# Wheels the pack lacks (llguidance) go in gpu_wheels/ (git-ignored; carry it):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d gpu_wheels llguidance==1.6.1
#
#   benchmarks/triton_gpu_device.sh OUT_DIR [triton_gpu_bench.py arguments...]
#   BENCH_SCRIPT=benchmarks/traffic.py benchmarks/triton_gpu_device.sh OUT_DIR --target triton \
#       --serve --device cuda --model random:llada-8b --requests 8 --caches dual
set -euo pipefail
out=${1:?output folder}
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
pack=${TRITONGPU_PACK:-$repo/.tritongpu/site.tar.xz}
work=${TRITONGPU_WORK:-/tmp/tritongpu}
site=$work/site
venv=$work/venv
mkdir -p "$site" "$out"
echo "unpacking $pack -> $site"
python3 - "$pack" "$site" <<'EOF'
import sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
    tar.extractall(sys.argv[2], **kw)
EOF
# a regular package: wins over any other pytriton on the path (a namespace portion would not)
touch "$site/pytriton/__init__.py"
# Wheels the pack lacks, put in gpu_wheels/ here and carried (git-ignored): llguidance, which
# the engine imports (with it only on PYTHONPATH the model failed to load in the stub).
# They stay out of the pack, which with the tree is already near the 64 MiB a call carries.
if compgen -G "$repo/gpu_wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
        "$repo"/gpu_wheels/*.whl
fi
ln -sfn "$repo/client" "$site/dlm_client"
torch_site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
# The 3.12 stub embeds the system libpython3.12: build the venv on that interpreter if present.
base=python3
[ -x /usr/bin/python3.12 ] && base=/usr/bin/python3.12
"$base" -m venv --without-pip "$venv"
echo "torch python: $(python3 -c 'import sys; print(sys.executable, sys.base_prefix, sys.version.split()[0])'); venv on $base"
purelib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pth=$purelib/00-tritongpu.pth
# The engine's import path (transformers' AutoTokenizer + a tokenizer load), root cause printed.
# Run with the library path the launcher gives tritonserver and its stub.
check() {
    LD_LIBRARY_PATH="$site/nvidia_pytriton.libs:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}" \
        "$venv/bin/python" - <<'PYEOF'
import importlib, tempfile, traceback
from pathlib import Path
try:
    import numpy, torch, transformers
    print("venv:", numpy.__version__, torch.__version__, transformers.__version__,
          torch.cuda.is_available(), flush=True)
    importlib.import_module("transformers.models.auto.tokenization_auto")
    from transformers import AutoTokenizer
    from dlm_engine.tokenizer_build import build_char_tokenizer
    d = Path(tempfile.mkdtemp())
    build_char_tokenizer(d, "llada")
    AutoTokenizer.from_pretrained(str(d))
    import tritonclient.grpc, dlm_client, dlm_triton.launch.server_dist as sd
    print("server:", sd.find_server().binary, sd.check_model_environment(), flush=True)
except Exception:
    traceback.print_exc()
    raise SystemExit(1)
PYEOF
}
# Packages of the machine's site-packages built against numpy 2 can break under numpy 1.26 when
# transformers probes them, so the venv sees only the install-time dependency closure of what
# the engine imports (symlinks); the whole site-packages is the fallback.
echo "check with the whole torch site-packages (diagnostic):"
full_ok=1
printf '%s\n%s\nimport site; site.addsitedir("%s")\n' "$site" "$repo" "$torch_site" >"$pth"
check || full_ok=0
filtered=$work/torch-deps
echo "dependency closure of torch + transformers in $filtered"
python3 - "$torch_site" "$filtered" <<'PYEOF'
import os, sys
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon
src, dst = os.path.abspath(sys.argv[1]), sys.argv[2]
dists = {canon(d.metadata["Name"]): d for d in metadata.distributions(path=[src])}
todo = [(n, "") for n in ("torch", "transformers", "tokenizers", "safetensors", "huggingface-hub")]
seen, names = set(), set()
while todo:  # (distribution, extra): extras pull their own requirements (cuda-toolkit[cublas])
    name, extra = todo.pop()
    name = canon(name)
    if (name, extra) in seen or name == "numpy" or name not in dists:
        continue
    seen.add((name, extra))
    names.add(name)
    for raw in dists[name].requires or []:
        req = Requirement(raw)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            todo += [(req.name, "")] + [(req.name, e) for e in req.extras]
tops = {f.parts[0] for n in names for f in dists[n].files or [] if f.parts[0] not in ("..", "__pycache__")}
tops = {t for t in tops if not t.endswith(".pth")}
os.makedirs(dst, exist_ok=True)
for top in sorted(tops):
    if os.path.exists(os.path.join(src, top)) and not os.path.lexists(os.path.join(dst, top)):
        os.symlink(os.path.join(src, top), os.path.join(dst, top))
print(len(names), "distributions:", " ".join(sorted(names)))
PYEOF
printf '%s\n%s\n%s\n' "$site" "$repo" "$filtered" >"$pth"
if ! check; then
    [ $full_ok = 1 ] || { echo "no working environment for the stub" >&2; exit 1; }
    echo "closure failed: using the whole torch site-packages"
    printf '%s\n%s\nimport site; site.addsitedir("%s")\n' "$site" "$repo" "$torch_site" >"$pth"
fi
export TORCHINDUCTOR_COMPILE_THREADS=1  # compile in the stub itself: no worker subprocesses
export PYTHONUNBUFFERED=1
cd "$repo"
status=0
# BENCH_TIMEOUT_S: SIGTERM then (the benchmark stops the server on it), SIGKILL 40 s later
# BENCH_SCRIPT: another benchmark run the same way (e.g. benchmarks/traffic.py --serve)
timeout -k 40 "${BENCH_TIMEOUT_S:-3600}" "$venv/bin/python" "${BENCH_SCRIPT:-benchmarks/triton_gpu_bench.py}" \
    --out "$out" "$@" || status=$?
echo "left over (should be none):"
pgrep -a -x tritonserver || true
pgrep -a -f triton_python_backend_stub || true
ls /dev/shm | grep triton_python_backend || true
exit $status
