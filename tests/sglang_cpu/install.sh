#!/usr/bin/env bash
# SGLang's own server for CPU, in its own venv layered over the project's (`make sglang-cpu`).
#
#   BASE=.venv TARGET=.venv-sglang SGLANG_VERSION=0.5.23 bash tests/sglang_cpu/install.sh
#
# * TARGET sees BASE's site-packages through a .pth file (torch 2.14.1 / torchvision 0.29.1 are reused, never a
#   second 5.5 GB copy); what TARGET installs itself (transformers 5.19, openai 2.8, tokenizers 0.23.2: the
#   server's pins) shadows BASE's copies, since .pth entries go to the end of sys.path. BASE is never written.
# * The sglang wheel's Requires-Dist (its METADATA), minus the packages that are GPU-only or not on the registry
#   for this platform, verbatim (pins and markers), then the wheel itself without dependencies.
# * SGLang's CPU path imports `sgl_kernel` (compiled kernels; no CPU build on PyPI): TARGET gets a .pth to
#   tests/sglang_cpu, where the project's own pure-torch module for the test set-up lives (sgl_kernel/).
# ~1.5 min and ~1.3 GB with a cold pip cache (no compiling).
set -euo pipefail
BASE=${BASE:-.venv}
TARGET=${TARGET:-.venv-sglang}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=$(cd "$BASE" && pwd)

"$BASE/bin/python" -c "import torch, torchvision; assert torch.__version__.startswith('2.14.1'), torch.__version__"
rm -rf "$TARGET"
"$BASE/bin/python" -m venv "$TARGET"
TARGET=$(cd "$TARGET" && pwd)
SP=$("$TARGET/bin/python" -c 'import site; print(site.getsitepackages()[0])')
"$BASE/bin/python" -c "import site; print(site.getsitepackages()[0])" > "$SP/paravt_base.pth"
echo "$HERE" > "$SP/paravt_sgl_kernel_cpu.pth"

WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
"$TARGET/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "sglang==$SGLANG_VERSION"
WHEEL=$(ls "$WHEELS"/sglang-"$SGLANG_VERSION"-*.whl | head -1)
"$TARGET/bin/python" - "$WHEEL" "$WHEELS/requirements.txt" <<'PY'
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

wheel, out = sys.argv[1], sys.argv[2]
z = zipfile.ZipFile(wheel)
meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
# GPU-only, or not published for this platform; torch/torchvision come from BASE; audio and video inputs to the
# server are off (the client sends frames as images)
EXCLUDE = {canonicalize_name(n) for n in """
sglang-kernel cuda-python flash-attn-4 sgl-deep-ep sgl-deep-gemm sgl-flash-mla quack-kernels humming-kernels tilelang
apache-tvm-ffi torch-memory-saver kernels deepseek-recipe tml-renderers smg-grpc-servicer torchaudio torchcodec av
decord2 torch torchvision""".split()}
EXCLUDE_PREFIX = ("flashinfer", "nvidia-", "nvshmem", "flash-attn")
kept, dropped = [], []
for line in meta.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    spec = line[len("Requires-Dist: "):]
    req = Requirement(spec)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # extras and other platforms
    name = canonicalize_name(req.name)
    (dropped if name in EXCLUDE or name.startswith(EXCLUDE_PREFIX) else kept).append(spec)
open(out, "w").write("\n".join(kept) + "\n")
print(f"sglang {wheel.rsplit('/', 1)[-1]}: {len(kept)} requirements kept, {len(dropped)} GPU-only or unavailable dropped")
PY
"$TARGET/bin/python" -m pip install -q -r "$WHEELS/requirements.txt"
"$TARGET/bin/python" -m pip install -q --no-deps "$WHEEL"
# the router (Rust, runs on CPU): the venv's own copy, so BASE's cannot move it
"$TARGET/bin/python" -m pip install -q --no-deps --ignore-installed "sglang-router==0.3.2"
"$TARGET/bin/python" - "$SGLANG_VERSION" <<'PY'
import sys

import sgl_kernel
import sglang
import sglang_router  # noqa: F401
import torch
import transformers

assert sglang.__version__ == sys.argv[1], sglang.__version__
assert sgl_kernel.SGLANG_VERSION == sglang.__version__, (sgl_kernel.SGLANG_VERSION, sglang.__version__)
print(f"sglang {sglang.__version__} (transformers {transformers.__version__}, torch {torch.__version__} from the base "
      f"venv) with ParaVT's CPU sgl_kernel ({sgl_kernel.__file__})")
PY
