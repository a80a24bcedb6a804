"""The GPU runner (``make test-gpu``): the tests of every path that picks CUDA when it is there, on the device the
code picks, with a report of each test's outcome.

It runs the local backend, its batcher and prefix reuse, SFT, GRPO (FSDP2 parity on gloo: one GPU cannot hold
two NCCL ranks), the toy world and the weight syncs' structure with ``--device cuda --dtype bfloat16`` where
CUDA is present (the dtype a GPU gets by default) and as on CPU elsewhere, so it passes on a CPU too. It needs
torch (with CUDA on a GPU) and the project's pure-Python dependencies, but no package registry: ``--wheels DIR``
installs wheels brought along (``tests/gpu/bundle.py`` makes them where pip works) into ``.gpu-site/``.

It writes a report (Markdown, and the JSON it is made from) with the machine, each test's outcome and reason
(the skip's reason, the failure's first lines), its time and what it recorded (the largest logprob difference
an exactness test saw: the measured tolerance on that device), and with ``--bench`` the local backend's
per-step profile (``perf/bench_local_batching.py``). Tests print as they end (``-v``), so a run cut by its
time limit still names what it reached.

    python3 tests/gpu/run.py [--wheels DIR ...] [--report gpu-report.md] [--timeout 450] [--bench]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the test modules of the paths that pick CUDA when it is there (their slow tests excluded)
SUBSET = ["tests/test_policies.py", "tests/test_reuse.py", "tests/test_load.py", "tests/test_sft.py",
          "tests/test_grpo.py", "tests/test_rl.py", "tests/test_grpo_step.py", "tests/test_disk_sync_export.py",
          "tests/test_tool_calls.py", "tests/test_toy.py", "tests/test_sync_safety.py", "tests/test_placement.py"]
#: what the suite imports beyond torch (a missing one is named with the way to bring it)
NEEDS = ["transformers", "av", "pydantic", "langgraph", "openai", "fastapi", "uvicorn", "yaml", "msgspec", "peft",
         "safetensors", "pytest", "pytest_timeout"]


def install_wheels(dirs: list[Path]) -> Path:
    """``pip install --no-index --no-deps --target .gpu-site`` of every wheel in ``dirs``; returns the site dir."""
    site = ROOT / ".gpu-site"
    wheels = [str(w) for d in dirs for w in sorted(Path(d).glob("*.whl"))]
    if not wheels:
        sys.exit(f"no wheels in {', '.join(map(str, dirs))}: make them with tests/gpu/bundle.py where pip works")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade", "--target",
                    str(site), *wheels], check=True)
    return site


def machine() -> dict:
    """The facts the report opens with, read in a child process (the parent stays free of torch)."""
    probe = ("import json, sys, platform\n"
             "out = {'python': platform.python_version()}\n"
             "try:\n"
             "    import torch\n"
             "    out['torch'] = torch.__version__\n"
             "    out['cuda'] = torch.cuda.is_available()\n"
             "    if out['cuda']:\n"
             "        out['gpu'] = torch.cuda.get_device_name(0); out['gpus'] = torch.cuda.device_count()\n"
             "        out['cuda_version'] = torch.version.cuda\n"
             "except Exception as exc:\n"
             "    out['torch'] = f'missing ({exc})'; out['cuda'] = False\n"
             "missing = []\n"
             f"for name in {NEEDS!r}:\n"
             "    try:\n"
             "        __import__(name)\n"
             "    except Exception as exc:\n"
             "        missing.append(f'{name} ({type(exc).__name__}: {exc})')\n"
             "out['missing'] = missing\n"
             "try:\n"
             "    import transformers; out['transformers'] = transformers.__version__\n"
             "except Exception:\n"
             "    pass\n"
             "print(json.dumps(out))\n")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=os.environ)
    facts = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else {"probe_error": res.stderr}
    facts["host"] = platform.node()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    facts["commit"] = (commit.stdout.strip() + (" + uncommitted changes" if dirty else "")) or "(not a git checkout)"
    return facts


def outcomes(log: Path) -> list[dict]:
    """One record per test from the log the suite's conftest writes as each test ends (``PARAVT_TEST_LOG``):
    outcome, reason, seconds, recorded properties. A run cut by its time limit keeps what ended before."""
    if not log.is_file():
        return []
    rows: dict[str, dict] = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        row = rows.setdefault(rec["test"], {"test": rec["test"], "outcome": "passed", "reason": "", "seconds": 0.0,
                                            "properties": {}})
        row["seconds"] += rec["seconds"]
        row["properties"].update(rec["properties"])
        if rec["outcome"] != "passed" and row["outcome"] == "passed":  # the first phase that did not pass says why
            row["outcome"] = ("error" if rec["when"] != "call" and rec["outcome"] == "failed" else rec["outcome"])
            row["reason"] = rec["reason"]
    return list(rows.values())


def report(path: Path, facts: dict, rows: list[dict], cmd: list[str], seconds: float, rc: int, bench: str) -> None:
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
    lines = ["# GPU runner report", "",
             "| fact | value |", "|---|---|",
             *(f"| {k} | {v} |" for k, v in facts.items() if k != "missing"),
             f"| missing imports | {', '.join(facts.get('missing') or []) or 'none'} |",
             f"| command | `{shlex.join(cmd)}` |", f"| wall time | {seconds:.0f} s (exit {rc}) |", "",
             " ".join(f"{v} {k}" for k, v in counts.items()), "",
             "| test | outcome | seconds | reason / recorded |", "|---|---|---|---|"]
    for r in rows:
        extra = "; ".join(f"{k}={v}" for k, v in r["properties"].items())
        note = " — ".join(x for x in (r["reason"], extra) if x).replace("|", "\\|")
        lines.append(f"| `{r['test']}` | {r['outcome']} | {r['seconds']:.1f} | {note} |")
    if bench:
        lines += ["", "## The local backend on this machine (`perf/bench_local_batching.py`)", "", bench.strip()]
    path.write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps({"machine": facts, "counts": counts, "tests": rows,
                                                     "command": cmd, "seconds": seconds, "exit": rc,
                                                     "bench": bench}, indent=1))
    print(f"\n{' '.join(f'{v} {k}' for k, v in counts.items())}; report: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", type=Path, nargs="*", default=[],
                    help="Folders of wheels to install first (no registry needed): tests/gpu/bundle.py makes them.")
    default_report = Path(os.environ["OUT"]) / "gpu-report.md" if os.environ.get("OUT") else ROOT / "gpu-report.md"
    ap.add_argument("--report", type=Path, default=default_report,
                    help="Where the report goes (default: $OUT/gpu-report.md when $OUT is set, else ./gpu-report.md).")
    ap.add_argument("--timeout", type=int, default=450, help="Seconds for the whole test run (default 450).")
    ap.add_argument("--workers", default="auto",
                    help="pytest-xdist workers when it is installed (auto: 4 on a GPU, none on a CPU; 0: none).")
    ap.add_argument("--bench", action="store_true", help="Also run the local backend's benchmark and step profile.")
    ap.add_argument("pytest_args", nargs="*", help="Extra pytest arguments (after --), e.g. -k resume.")
    args = ap.parse_args()

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.wheels:
        site = install_wheels(args.wheels)
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    os.environ.update(env)
    facts = machine()
    cuda = bool(facts.get("cuda"))
    if facts.get("missing"):  # the suite's conftest would not even import: say what to bring instead
        report(args.report, facts, [], [], 0.0, 2, "")
        print("missing imports: " + "; ".join(facts["missing"]) + "\nbring them as wheels: tests/gpu/bundle.py where "
              "pip works, then tests/gpu/run.py --wheels DIR")
        return 2
    log = args.report.with_suffix(".jsonl")
    args.report.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    env["PARAVT_TEST_LOG"] = str(log)
    cmd = [sys.executable, "-m", "pytest", *[t for t in SUBSET if (ROOT / t).is_file()], "-m", "not slow or gpu",
           "-v", "-p", "no:cacheprovider", "--device", "cuda" if cuda else "auto",
           "--dtype", "bfloat16" if cuda else "float32", *args.pytest_args]
    workers = (4 if cuda else 0) if args.workers == "auto" else int(args.workers)
    has_xdist = subprocess.run([sys.executable, "-c", "import xdist"], capture_output=True).returncode == 0
    if workers and has_xdist:
        cmd += ["-n", str(workers)]
    print("$ " + shlex.join(cmd), flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)  # its own group: xdist workers too
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        rc = 124
        print(f"the test run passed its {args.timeout} s limit: the report has what ended before it")
    seconds = time.monotonic() - t0
    bench = ""
    if args.bench:
        b = subprocess.run([sys.executable, "perf/bench_local_batching.py", "--device", "cuda" if cuda else "cpu",
                            "--repeat", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        bench = b.stdout if b.returncode == 0 else f"(the benchmark failed: {b.stderr[-1500:]})"
        print(bench)
    rows = outcomes(log)
    report(args.report, facts, rows, cmd, seconds, rc, bench)
    return rc


if __name__ == "__main__":
    sys.exit(main())
