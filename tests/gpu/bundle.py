"""Prepare what a GPU machine without a package registry needs to run the GPU suite (``tests/gpu/run.py``).

Run it where pip reaches a registry, in the project's venv (the versions sent are the ones the suite passed with
here). It resolves **versions, not names**: starting from the project's own requirements (no extras) and what the
GPU subset's tests import, each requirement is checked against the target machine's ``pip freeze``
(``--target-freeze``): a package the target has at a version inside every specifier that reaches it is left there; any
other is sent (this venv's version) and its own requirements are resolved in turn — so a package the target has at
too old a version for what is sent (``huggingface-hub`` for transformers 5.24, which needs ≥ 1.31) is sent too. torch
and its CUDA libraries are the target's (their specifiers are checked and a mismatch is said). It writes
``dist/gpu/``: the wheels for that machine's Python and platform, ``closure.json`` (what is sent, what is relied on,
and why), and ``paravt-src.tar.gz``, the tracked files without ``checkpoints/toy-modes``. Then, on the GPU machine::

    tar xzf paravt-src.tar.gz && python3 tests/gpu/run.py --wheels wheels/

The default target is the last GPU machine measured (``tests/gpu/targets/h200.txt``: the H200 image, versions
where a session read them); a line ``name`` without a version is present at an unknown version (assumed to satisfy,
and said; ``--unknown send`` sends those instead).

    .venv/bin/python tests/gpu/bundle.py [--target-freeze have.txt] [--python 3.12] [--out dist/gpu] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TARGET = Path(__file__).with_name("targets") / "h200.txt"
#: beyond the package's own dependencies, what the GPU subset's test modules and the runner import
TEST_EXTRAS = ["msgspec", "safetensors", "pyyaml", "pytest", "pytest-timeout"]
#: the target's own: never sent (its CUDA build is the point), their specifiers checked
TARGETS_OWN = ("torch", "torchvision", "triton")


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_freeze(path: Path) -> dict[str, str | None]:
    """``pip freeze`` text → name → version (None: present, version not read). Comments and blank lines skipped;
    ``name @ url`` lines count as present at an unknown version."""
    have: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line or line.startswith("-"):
            continue
        if "==" in line:
            name, version = line.split("==", 1)
            have[canon(name)] = version.strip().split("+")[0] if version.strip() else None
        else:
            have[canon(re.split(r"[ @<>=!~;\[]", line)[0])] = None
    return have


def satisfies(version: str | None, req: Requirement) -> bool | None:
    """Whether ``version`` is inside ``req``'s specifier (None: unknown — no version read and a specifier to meet)."""
    if not str(req.specifier):
        return True
    if version is None:
        return None
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return None


@dataclass
class Closure:
    """What the target lacks (``send``: name → version here) and what it is relied on for (``relied``: name → its
    version), with why (every requirement that reached each name, by who asked)."""

    send: dict[str, str] = field(default_factory=dict)
    relied: dict[str, str | None] = field(default_factory=dict)
    assumed: list[str] = field(default_factory=list)  # relied on at an unknown version
    why: dict[str, list[str]] = field(default_factory=dict)
    target_own: list[str] = field(default_factory=list)  # torch & co: the target's, with any specifier it misses

    def as_dict(self) -> dict:
        return {"send": self.send, "relied": self.relied, "assumed": self.assumed, "why": self.why,
                "target_own": self.target_own}


def resolve(roots: list[str], have: dict[str, str | None], python: str, unknown: str = "assume") -> Closure:
    """The closure of ``roots`` against the target's packages ``have`` (markers evaluated for Linux and ``python``):
    a name is relied on when the target has it at a version every requirement reaching it allows; otherwise this
    venv's version is sent and its requirements resolved. A name first relied on and later reached by a requirement
    the target's version misses is sent after all."""
    env = {**default_environment(), "python_version": python, "python_full_version": f"{python}.0",
           "sys_platform": "linux", "platform_system": "Linux", "extra": ""}
    out = Closure()
    reqs: dict[str, list[Requirement]] = {}
    todo: list[tuple[Requirement, str]] = [(Requirement(r), "paravt") for r in roots]
    while todo:
        req, who = todo.pop()
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canon(req.name)
        if name.startswith("nvidia-") or name in TARGETS_OWN:
            if name in have and satisfies(have[name], req) is False:
                out.target_own.append(f"{who} needs {req}; the target has {name} {have[name]}")
            continue
        reqs.setdefault(name, []).append(req)
        out.why.setdefault(name, []).append(f"{who}: {req}")
        if name in out.send:
            continue
        verdicts = [satisfies(have.get(name), r) for r in reqs[name]] if name in have else [False]
        if all(v is True for v in verdicts) or (unknown == "assume" and False not in verdicts):
            out.relied[name] = have[name]
            if None in verdicts and name not in out.assumed:
                out.assumed.append(name)
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is needed ({who}: {req}) and not installed here: run in the project's "
                             "venv") from None
        if not req.specifier.contains(Version(dist.version), prereleases=True):
            raise SystemExit(f"{who} needs {req}, this venv has {name} {dist.version}")
        out.relied.pop(name, None)
        out.assumed = [a for a in out.assumed if a != name]
        out.send[name] = dist.version
        todo += [(Requirement(r), name) for r in dist.requires or []]
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


def roots() -> list[str]:
    """The package's own requirements (no extras) and what the GPU subset's tests import."""
    return [r for r in metadata.requires("paravt") or [] if "extra ==" not in r] + TEST_EXTRAS


def download(pins: list[str], python: str, platform: str, wheels: Path, timeout: float = 600) -> list[str]:
    """Each pin's wheel for ``python`` on ``platform``; returns the pins that had none (the newest with one instead)."""
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", *(a for p in platforms(platform) for a in ("--platform", p)), "-d",
           str(wheels)]
    substituted = []
    for pin in pins:
        if subprocess.run([*cmd, pin], capture_output=True, timeout=timeout).returncode != 0:
            substituted.append(pin)
            subprocess.run([*cmd, pin.split("==")[0]], check=True, capture_output=True, timeout=timeout)
    return substituted


def source_tarball(path: Path) -> Path:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True,
                           timeout=60).stdout.split()
    with tarfile.open(path, "w:gz") as tar:
        for f in files:
            if not f.startswith("checkpoints/toy-modes/") and (ROOT / f).is_file():
                tar.add(ROOT / f, arcname=f)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-freeze", "--have", type=Path, default=DEFAULT_TARGET,
                    help="`pip freeze` of the GPU machine (default: tests/gpu/targets/h200.txt, the last one "
                         "measured).")
    ap.add_argument("--python", default="3.12", help="The GPU machine's Python (major.minor).")
    ap.add_argument("--platform", default="manylinux_2_28_x86_64")
    ap.add_argument("--unknown", choices=["assume", "send"], default="assume",
                    help="A package the target has at an unknown version: assume it satisfies (said), or send ours.")
    ap.add_argument("--out", type=Path, default=ROOT / "dist" / "gpu")
    ap.add_argument("--dry-run", action="store_true", help="Print the resolution; download nothing.")
    ap.add_argument("--no-source", action="store_true", help="No source tarball.")
    args = ap.parse_args(argv)
    have = read_freeze(args.target_freeze)
    closure = resolve(roots(), have, args.python, args.unknown)
    pins = [f"{n}=={v}" for n, v in sorted(closure.send.items())]
    print(f"{len(pins)} packages to send ({args.target_freeze.name}, Python {args.python}):")
    for n, v in sorted(closure.send.items()):
        target = f"target has {have[n]}" if have.get(n) else ("target has it, version unknown" if n in have else
                                                               "not on the target")
        print(f"  {n}=={v}  ({target}; {'; '.join(closure.why[n][:2])})")
    print(f"relied on the target for {len(closure.relied)}: " + ", ".join(
        f"{n}=={v}" if v else f"{n} (version unknown{', assumed' if n in closure.assumed else ''})"
        for n, v in sorted(closure.relied.items())))
    for line in closure.target_own:
        print(f"warning: {line}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "closure.json").write_text(json.dumps({"target": str(args.target_freeze), "python": args.python,
                                                        **closure.as_dict()}, indent=1))
    if args.dry_run:
        return 0
    wheels = args.out / "wheels"
    for pin in download(pins, args.python, args.platform, wheels):
        print(f"  {pin}: no wheel for Python {args.python} on {args.platform}; the newest that has one instead")
    size = sum(f.stat().st_size for f in wheels.glob("*.whl"))
    print(f"wheels: {len(list(wheels.glob('*.whl')))} files, {size / 2**20:.1f} MiB in {wheels}")
    if not args.no_source:
        src = source_tarball(args.out / "paravt-src.tar.gz")
        print(f"source: {src.stat().st_size / 2**20:.1f} MiB in {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
