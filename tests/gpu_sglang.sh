#!/usr/bin/env bash
# kvtier's SGLang backend on a GPU machine without a package registry: one command.
#
#   bash tests/gpu_sglang.sh          (on the GPU machine, repo root; carry the git-ignored folder .whl-sgl)
#   bash tests/gpu_sglang.sh build    (on a machine with a registry: fills .whl-sgl, ~47 MiB)
#   bash tests/gpu_sglang.sh exec CMD ARGS...   (steps 1-3, then CMD in that environment instead of the tests;
#                                                exit status: CMD's; e.g. the end-to-end bench)
#
# Run mode:
#  1. installs the carried cp312 wheels (.whl-sgl: sglang 0.5.23 and the part of its import chain that must be real)
#     into /tmp/site (pip --target, --no-index --no-deps; a plain unzip if pip is missing);
#  2. writes a sitecustomize bootstrap (/tmp/kvtier_boot) that stubs, with MagicMock modules, the packages sglang
#     imports at module level but the tests never call (sgl_kernel, torchvision, PIL, IPython, aiohttp, ...), and
#     only those that are NOT installed; it prints which it stubbed;
#  3. prints the versions and devices, and checks that sglang's scheduler/pool/radix modules import;
#  4. runs tests/test_sglang_gpu.py (CUDA pools; the TP=2 test needs 2 GPUs, else it skips), then the CPU-pool
#     SGLang tests (tests/test_sglang_backend.py, tests/test_sglang_stateful.py) through the Triton interpreter;
#  5. writes gpu_sglang.log, junit_gpu.xml and junit_cpu.xml under $OUT (or /tmp/kvtier_gpu_out).
# Exit status: 0 all passed; 1 a test run failed; 2 wheels missing; 3 install failed; 4 sglang import failed;
# 5 CUDA not available (the GPU tests would only skip).
#
# Knobs (environment): PYTHON (python3), KVTIER_WHEELS (.whl-sgl), KVTIER_SITE (/tmp/site),
# KVTIER_EXTRA_STUBS (comma-separated extra top-level modules to stub if missing), KVTIER_SKIP_CPU=1 (GPU tests
# only), PYTEST_ARGS (extra pytest arguments, e.g. "-x" or "-k mla").
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
WHEELS=${KVTIER_WHEELS:-.whl-sgl}

if [ "${1:-run}" = "build" ]; then
    # Download the cp312 manylinux wheels (no dependencies resolved: the list is the import chain, checked with
    # tests importing under a simulated CUDA device) and slim the sglang wheel: its Rust server/bench/grpc/
    # multimodal extensions and sglang.multimodal_gen (~23 MiB compressed) are never imported by the backend.
    set -e
    mkdir -p "$WHEELS"
    grep -qx "/$WHEELS/" .git/info/exclude 2>/dev/null || echo "/$WHEELS/" >> .git/info/exclude
    P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_34_x86_64
       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    # shellcheck disable=SC2086
    "$PY" -m pip download -q $P -d "$WHEELS" sglang==0.5.23 apache-tvm-ffi==0.1.15.post2 orjson==3.13.0 prometheus-client==0.26.0 \
        pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 dill==0.4.1 traitlets==5.16.1 pydantic==2.14.4 \
        pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 typing-extensions==4.16.0 \
        starlette==1.10.0 transformers==5.24.0 huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 \
        regex==2026.11.19 PyYAML==6.0.4 tqdm==4.70.1 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 anyio==4.16.0 \
        idna==3.20 sniffio==1.3.1 certifi==2026.10.19.post1 openai==3.57.0 jiter==0.19.0 psutil==7.2.2 \
        requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 partial-json-parser==0.2.1.1.post7 \
        gguf==0.19.0 compressed-tensors==0.20.1 loguru==0.7.3 einops==0.8.2 \
        rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 Pygments==2.21.0
    for w in "$WHEELS"/sglang-0.5.23-*.whl; do
        "$PY" - "$w" <<'EOF'
import base64, csv, hashlib, io, os, re, sys, zipfile
src = sys.argv[1]
drop = re.compile(r"^sglang/(multimodal_gen/|srt/rust_extensions/_(server|bench|grpc|multimodal)[^/]*\.so$)")
with zipfile.ZipFile(src) as zin:
    names = [i.filename for i in zin.infolist()]
    if not any(drop.match(n) for n in names):
        print(f"{src}: already slim"); sys.exit(0)
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    rows, tmp = [], src + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if drop.match(info.filename) or info.filename == record:
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append((info.filename, f"sha256={digest}", len(data)))
        rows.append((record, "", ""))
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)  # quotes the file names that hold commas
        zout.writestr(record, buf.getvalue())
os.replace(tmp, src)
print(f"{src}: slimmed to {os.path.getsize(src) / 2**20:.1f} MiB")
EOF
    done
    du -sh "$WHEELS"
    exit 0
fi

MODE=${1:-run}
LOGDIR=${OUT:-/tmp/kvtier_gpu_out}
mkdir -p "$LOGDIR"
if [ "$MODE" = "exec" ]; then
    exec > >(tee "$LOGDIR/exec.log") 2>&1
else
    exec > >(tee "$LOGDIR/gpu_sglang.log") 2>&1
fi
SITE=${KVTIER_SITE:-/tmp/site}
BOOT=${KVTIER_BOOT:-/tmp/kvtier_boot}
say() { printf '\n=== %s\n' "$*"; }

# A copied working tree may carry stale git metadata: name the code by the hash of its sources too
# (reproduce: find kvtier tests -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum).
code_sha=$(find kvtier tests -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)
say "kvtier SGLang GPU tests: $(date -u +%FT%TZ) on $(hostname), repo $(git rev-parse --short HEAD 2>/dev/null || echo '?'), sources sha1 $code_sha"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -eq 0 ] || ! ls "$WHEELS"/sglang-0.5.23-*.whl >/dev/null 2>&1; then
    echo "ERROR: no sglang-0.5.23 wheel in '$WHEELS'. Carry the git-ignored folder .whl-sgl with this call"
    echo "       (fill it on a machine with a registry: bash tests/gpu_sglang.sh build)."
    exit 2
fi
echo "${#wheels[@]} wheels in $WHEELS ($(du -sh "$WHEELS" | cut -f1))"

say "installing the wheels into $SITE"
mkdir -p "$SITE"
if "$PY" -m pip --version >/dev/null 2>&1; then
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "${wheels[@]}"; then
        echo "ERROR: pip could not install the carried wheels (see above)."
        exit 3
    fi
else
    echo "pip is not available: unzipping the wheels instead"
    "$PY" - "$SITE" "${wheels[@]}" <<'EOF' || exit 3
import os, shutil, sys, zipfile
site = sys.argv[1]
for w in sys.argv[2:]:
    with zipfile.ZipFile(w) as z:
        z.extractall(site)
for d in os.listdir(site):  # <name>.data/{purelib,platlib}/* belong at the top
    if d.endswith(".data"):
        for sub in ("purelib", "platlib"):
            p = os.path.join(site, d, sub)
            if os.path.isdir(p):
                for e in os.listdir(p):
                    shutil.copytree(os.path.join(p, e), os.path.join(site, e), dirs_exist_ok=True) \
                        if os.path.isdir(os.path.join(p, e)) else shutil.copy2(os.path.join(p, e), site)
EOF
fi

mkdir -p "$BOOT"
cat > "$BOOT/sitecustomize.py" <<'EOF'
"""kvtier GPU-test bootstrap, written by tests/gpu_sglang.sh and loaded as sitecustomize through PYTHONPATH (so
spawned TP ranks load it too). Never used by the CPU CI.

sglang 0.5.23 imports, at module level, packages that kvtier's tests never call: its quantization layers import
sgl_kernel when CUDA is present, multimodal helpers import torchvision and PIL, and so on. Those of them that are
NOT installed are replaced here by MagicMock modules, so that sglang's scheduler, memory-pool and radix-cache
modules import; installed packages are never stubbed. A stubbed package also answers importlib.metadata with
version 0.0.0, so availability probes that read the version (transformers') stay consistent.
"""
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from unittest import mock

_CANDIDATES = {  # top-level module -> distribution name
    "sgl_kernel": "sgl-kernel", "torchvision": "torchvision", "PIL": "pillow", "IPython": "ipython",
    "aiohttp": "aiohttp", "truststore": "truststore", "sentencepiece": "sentencepiece",
}
_CANDIDATES.update({n: n for n in os.environ.get("KVTIER_EXTRA_STUBS", "").split(",") if n})
STUBBED = {}
for _mod, _dist in _CANDIDATES.items():
    try:
        _found = importlib.util.find_spec(_mod) is not None
    except (ImportError, ValueError):
        _found = False
    if not _found:
        STUBBED[_mod] = _dist
_BY_DIST = {d.lower().replace("_", "-"): m for m, d in STUBBED.items()}


class _StubDist(importlib.metadata.Distribution):
    def __init__(self, name):
        self._name = name

    def read_text(self, filename):
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: {self._name}\nVersion: 0.0.0\n"
        return None

    def locate_file(self, path):
        return None


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = mock.MagicMock(name=spec.name)
        m.__name__, m.__path__, m.__spec__, m.__file__, m.__loader__ = spec.name, [], spec, None, self
        m.__version__ = "0.0.0"
        m.version_info = (99, 0)  # matplotlib compares IPython's version_info with a tuple
        return m

    def exec_module(self, module):
        pass

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = getattr(context, "name", None)
        if name and name.lower().replace("_", "-") in _BY_DIST:
            return iter([_StubDist(name)])
        return iter(())


if STUBBED:
    sys.meta_path.append(_StubFinder())
    if not os.environ.get("_KVTIER_STUBS_SHOWN"):
        os.environ["_KVTIER_STUBS_SHOWN"] = "1"  # once per process tree
        print(f"[kvtier bootstrap] stubbed (not installed; imported by sglang, unused by the tests): "
              f"{', '.join(sorted(STUBBED))}", file=sys.stderr)
EOF
export PYTHONPATH="$BOOT:$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

say "environment"
"$PY" - <<'EOF'
import importlib, platform, sys
import torch
print(f"python {platform.python_version()}  torch {torch.__version__} (CUDA {torch.version.cuda})  "
      f"cuda available: {torch.cuda.is_available()}  devices: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
for name in ("triton", "cupy", "numba", "xxhash", "hypothesis", "pytest", "sglang", "transformers", "pydantic"):
    try:
        m = importlib.import_module(name)
        print(f"  {name:12s} {getattr(m, '__version__', '?'):12s} {getattr(m, '__file__', '')}")
    except Exception as e:
        note = " (layerwise counter falls back to torch events)" if name == "cupy" else ""
        print(f"  {name:12s} MISSING: {type(e).__name__}: {e}{note}")
EOF

say "importing sglang's scheduler, memory-pool and radix-cache modules and the kvtier backend"
if ! "$PY" -c 'import sglang, sglang.srt.managers.schedule_batch, sglang.srt.mem_cache.memory_pool, sglang.srt.mem_cache.radix_cache, sglang.srt.mem_cache.allocator.paged, sglang.srt.mem_cache.common, kvtier.sglang.radix_cache, kvtier.sglang as ks; print("ok: sglang", ks.check_sglang_version(), "from", sglang.__file__)'; then
    echo "ERROR: sglang does not import here (traceback above). If it stops at 'No module named X' for a module"
    echo "       the tests never use, rerun with KVTIER_EXTRA_STUBS=X; otherwise its wheel must join .whl-sgl."
    exit 4
fi

if [ "$MODE" = "exec" ]; then
    shift
    say "running: $*"
    "$@"
    exit $?
fi

CUDA_OK=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
# shellcheck disable=SC2206
EXTRA=(${PYTEST_ARGS:-})

say "GPU tests: tests/test_sglang_gpu.py (CUDA pools; TP=2 needs 2 GPUs)"
timeout "${KVTIER_GPU_TIMEOUT:-420}" "$PY" -m pytest tests/test_sglang_gpu.py -v -rA -m "gpu or not gpu" \
    -p no:cacheprovider --junitxml="$LOGDIR/junit_gpu.xml" "${EXTRA[@]}"
GPU_RC=$?

CPU_RC=0
INTERP_OK=$("$PY" -c '
import numpy, triton
v = lambda s: tuple(int(x) for x in s.split("+")[0].split(".")[:2])
print(int(not (v(numpy.__version__) >= (2, 4) and v(triton.__version__) < (3, 8))))' 2>/dev/null || echo 0)
if [ "$INTERP_OK" != "1" ]; then
    say "CPU-pool SGLang tests SKIPPED: this Triton's interpreter cannot run with this numpy (int() of a 1-element"
    echo "    array is an error from numpy 2.4; Triton < 3.8's interpreter does it). The GPU tests are unaffected."
elif [ "${KVTIER_SKIP_CPU:-0}" != "1" ]; then
    say "CPU-pool SGLang tests through the Triton interpreter (same wheels, this machine's torch)"
    TRITON_INTERPRET=1 timeout "${KVTIER_CPU_TIMEOUT:-150}" "$PY" -m pytest tests/test_sglang_backend.py \
        tests/test_sglang_stateful.py -q -rfEs -p no:cacheprovider --junitxml="$LOGDIR/junit_cpu.xml" "${EXTRA[@]}"
    CPU_RC=$?
fi

say "RESULT: GPU tests rc=$GPU_RC, CPU-pool tests rc=$CPU_RC (0 = passed; 124 = timed out). Logs in $LOGDIR"
if [ "$CUDA_OK" != "1" ]; then
    echo "WARNING: CUDA is not available here: the GPU tests were skipped, nothing ran on a GPU."
    exit 5
fi
[ "$GPU_RC" -eq 0 ] && [ "$CPU_RC" -eq 0 ] && exit 0
exit 1
