#!/usr/bin/env bash
# SGLang's own server for CPU, in its own venv layered over the project's (`make sglang-cpu`).
#
#   BASE=.venv TARGET=.venv-sglang SGLANG_VERSION=0.5.23 bash tests/sglang_cpu/install.sh
#   TARGET=.venv-sglang bash tests/sglang_cpu/install.sh --freeze     # rewrite constraints.txt from TARGET
#
# * TARGET sees BASE's site-packages through a .pth file (torch 2.14.1 / torchvision 0.29.1 are reused, never a
#   second 5.5 GB copy); what TARGET installs itself (transformers 5.19, openai 2.8, tokenizers 0.23.2: the
#   server's pins) shadows BASE's copies, since .pth entries go to the end of sys.path. BASE is never written, and
#   TARGET may not be BASE (it is deleted first).
# * The sglang wheel's Requires-Dist (its METADATA), minus the packages that are GPU-only or not on the registry
#   for this platform, verbatim (pins and markers), installed under constraints.txt: the known-good version of
#   every requirement the wheel leaves unpinned and of what they pull in, so a new release of one cannot change
#   the engine the suite tests against. Then the wheel itself without dependencies.
# * SGLang's CPU path imports `sgl_kernel` (compiled kernels; no CPU build on PyPI): TARGET gets a .pth to
#   tests/sglang_cpu, where the project's own pure-torch module for the test set-up lives (sgl_kernel/).
# ~1.5 min and ~1.3 GB with a cold pip cache (no compiling). Python >= 3.11 (the wheel and the constraints are
# cp311+).
set -euo pipefail
BASE=${BASE:-.venv}
TARGET=${TARGET:-.venv-sglang}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
HERE=$(cd "$(dirname "$0")" && pwd)
CONSTRAINTS="$HERE/constraints.txt"

# the requirements of the wheel the CPU engine takes (stdin: its METADATA), one a line
REQUIREMENTS_PY='
import sys

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

# GPU-only, or not published for this platform; torch/torchvision come from BASE; audio and video inputs to the
# server are off (the client sends frames as images)
EXCLUDE = {canonicalize_name(n) for n in """
sglang-kernel cuda-python flash-attn-4 sgl-deep-ep sgl-deep-gemm sgl-flash-mla quack-kernels humming-kernels tilelang
apache-tvm-ffi torch-memory-saver kernels deepseek-recipe tml-renderers smg-grpc-servicer torchaudio torchcodec av
decord2 torch torchvision""".split()}
EXCLUDE_PREFIX = ("flashinfer", "nvidia-", "nvshmem", "flash-attn")
kept = dropped = 0
for line in sys.stdin.read().splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    spec = line[len("Requires-Dist: "):]
    req = Requirement(spec)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # extras and other platforms
    name = canonicalize_name(req.name)
    if name in EXCLUDE or name.startswith(EXCLUDE_PREFIX):
        dropped += 1
    else:
        kept += 1
        print(spec)
print(f"{kept} requirements kept, {dropped} GPU-only or unavailable dropped", file=sys.stderr)
'

if [ "${1:-}" = "--freeze" ]; then
  # the known-good set, from a TARGET whose tests pass: each requirement the wheel leaves unpinned and everything
  # TARGET installed itself, at the versions TARGET imports
  PY="$TARGET/bin/python"
  REQS=$(mktemp)
  trap 'rm -f "$REQS"' EXIT
  "$PY" -c 'import importlib.metadata as m, sys; sys.stdout.write(m.distribution("sglang").read_text("METADATA"))' |
    "$PY" -c "$REQUIREMENTS_PY" > "$REQS"
  "$PY" - "$REQS" "$CONSTRAINTS" <<'PY'
import datetime
import importlib.metadata as md
import platform
import site
import sys

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

reqs = [Requirement(line) for line in open(sys.argv[1]).read().splitlines() if line.strip()]
names = {canonicalize_name(r.name) for r in reqs if not any(s.operator in ("==", "===") for s in r.specifier)}
names |= {canonicalize_name(d.metadata["Name"]) for d in md.distributions(path=[site.getsitepackages()[0]])}
names -= {"pip", "setuptools", "sglang", "sglang-router"}
with open(sys.argv[2], "w") as f:
    f.write(f"# The known-good set of SGLang {md.version('sglang')}'s CPU engine (tests/sglang_cpu/install.sh installs under it):\n"
            "# every requirement the wheel leaves unpinned and everything the install put into .venv-sglang itself, at\n"
            f"# the versions of a .venv-sglang the suite passed against ({datetime.date.today()}, Python "
            f"{platform.python_version()}, {platform.machine()}).\n"
            "# torch / torchvision come from .venv (the Makefile pins them). Rewrite it after a deliberate upgrade:\n"
            "#   TARGET=.venv-sglang bash tests/sglang_cpu/install.sh --freeze\n")
    for name in sorted(names):
        f.write(f"{name}=={md.version(name)}\n")
print(f"{sys.argv[2]}: {len(names)} pins")
PY
  exit 0
fi

BASE=$(cd "$BASE" && pwd)
if [ "$(realpath -m "$TARGET")" = "$BASE" ]; then
  echo "install.sh: TARGET ($TARGET) is BASE ($BASE): TARGET is deleted and made anew, so it must be a venv of its own" >&2
  exit 2
fi
PYV=$("$BASE/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$(printf '%s\n3.11\n' "$PYV" | sort -V | head -1)" != "3.11" ]; then
  echo "install.sh: $BASE has Python $PYV; SGLang $SGLANG_VERSION's CPU engine here needs Python >= 3.11" >&2
  exit 2
fi
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
"$TARGET/bin/python" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); sys.stdout.write(z.read(next(
    n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())' "$WHEEL" |
  "$TARGET/bin/python" -c "$REQUIREMENTS_PY" > "$WHEELS/requirements.txt"
"$TARGET/bin/python" -m pip install -q -c "$CONSTRAINTS" -r "$WHEELS/requirements.txt"
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
