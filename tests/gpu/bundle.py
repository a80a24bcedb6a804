"""Prepare what a GPU machine without a package registry needs to run the GPU suite (``tests/gpu/run.py``).

Run it where pip reaches a registry, in the project's venv (the versions sent are the ones the suite passed with
here); it writes ``dist/gpu/``: the wheels of every package the project and the GPU suite import that the GPU
machine lacks, for that machine's Python and platform, and ``paravt-src.tar.gz``, the project's tracked files
without ``checkpoints/toy-modes`` (the GPU suite does not use it). Then, on the GPU machine::

    tar xzf paravt-src.tar.gz && python3 tests/gpu/run.py --wheels wheels/

What the GPU machine already has is read from ``--have``: its ``pip freeze`` (``python3 -m pip freeze > have.txt``
there), or by default the set measured on the H200 the project first ran on (torch and its CUDA libraries,
numpy, pillow, peft, typer, rich, tqdm, httpx, pyarrow, matplotlib, pytest with xdist and timeout).

    .venv/bin/python tests/gpu/bundle.py [--have have.txt] [--python 3.12] [--out dist/gpu]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
#: what the GPU image had (FACTS, 2026-11-28): the closure below stops at these
DEFAULT_HAVE = {"torch", "numpy", "pillow", "peft", "typer", "rich", "tqdm", "httpx", "httpcore", "anyio", "certifi",
                "h11", "sniffio", "pyarrow", "matplotlib", "pytest", "pytest-xdist", "pytest-timeout", "pyyaml",
                "packaging", "filelock", "fsspec", "jinja2", "markupsafe", "networkx", "sympy", "mpmath", "setuptools",
                "typing-extensions", "click", "pygments", "markdown-it-py", "mdurl", "shellingham", "psutil",
                "accelerate", "safetensors", "huggingface-hub", "requests", "urllib3", "charset-normalizer",
                "contourpy", "cycler", "fonttools", "kiwisolver", "pyparsing", "python-dateutil", "six", "iniconfig",
                "pluggy", "execnet", "triton"}
#: beyond the package's own dependencies, what the GPU subset's test modules import
TEST_EXTRAS = ["msgspec", "safetensors", "pyyaml"]


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str], have: set[str], python: str) -> dict[str, str]:
    """Installed name -> version of ``roots`` and everything they need (markers evaluated for Linux and
    ``python``), stopping at what the GPU machine has."""
    env = {**default_environment(), "python_version": python, "python_full_version": f"{python}.0",
           "sys_platform": "linux", "platform_system": "Linux", "extra": ""}
    out: dict[str, str] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canon(req.name)
        if name in out or name in have or name.startswith("nvidia-") or name in {"torch", "torchvision"}:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # not installed here: an optional dependency on another platform
        out[name] = dist.version
        for r in dist.requires or []:
            dep = Requirement(r)
            if dep.marker is None or dep.marker.evaluate(env):
                todo.append(dep)
    return out


def platforms(newest: str) -> list[str]:
    """``newest`` (e.g. ``manylinux_2_28_x86_64``) and every older manylinux tag it runs (pip's ``--platform``
    matches one tag exactly), then pure-Python wheels."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", newest)
    if not m:
        return [newest, "any"]
    arch = m.group(2)
    return [*(f"manylinux_2_{v}_{arch}" for v in range(int(m.group(1)), 4, -1)), f"manylinux2014_{arch}",
            f"manylinux2010_{arch}", f"manylinux1_{arch}", "any"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--have", type=Path, help="`pip freeze` of the GPU machine (default: the H200 image's set)")
    ap.add_argument("--python", default="3.12", help="The GPU machine's Python (major.minor).")
    ap.add_argument("--platform", default="manylinux_2_28_x86_64")
    ap.add_argument("--out", type=Path, default=ROOT / "dist" / "gpu")
    args = ap.parse_args()
    have = ({canon(line.split("==")[0].split(" @ ")[0]) for line in args.have.read_text().splitlines()
             if line.strip() and not line.startswith("#")} if args.have else DEFAULT_HAVE)
    deps = [r for r in metadata.requires("paravt") or [] if "extra ==" not in r]  # the package's own, no extras
    wanted = closure([*deps, *TEST_EXTRAS], have, args.python)
    wheels = args.out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pins = [f"{n}=={v}" for n, v in sorted(wanted.items())]
    print(f"{len(pins)} packages the GPU machine lacks: {' '.join(pins)}")
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                args.python, "--implementation", "cp",
                *(a for p in platforms(args.platform) for a in ("--platform", p)), "-d", str(wheels)]
    for pin in pins:  # one at a time: a version without a wheel for that machine falls back to the newest with one
        if subprocess.run([*download, pin], capture_output=True).returncode != 0:
            name = pin.split("==")[0]
            print(f"  {pin}: no wheel for Python {args.python} on {args.platform}; the newest that has one instead")
            subprocess.run([*download, name], check=True)
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    src = args.out / "paravt-src.tar.gz"
    with tarfile.open(src, "w:gz") as tar:
        for f in files:
            if not f.startswith("checkpoints/toy-modes/") and (ROOT / f).is_file():
                tar.add(ROOT / f, arcname=f)
    size = sum(f.stat().st_size for f in wheels.glob("*.whl"))
    print(f"wheels: {len(list(wheels.glob('*.whl')))} files, {size / 2**20:.1f} MiB in {wheels}")
    print(f"source: {src.stat().st_size / 2**20:.1f} MiB in {src}")


if __name__ == "__main__":
    main()
