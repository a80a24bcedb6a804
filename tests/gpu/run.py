"""The GPU runner (``make test-gpu``): the tests of every path that picks CUDA when it is there, on the device the
code picks, with a report of each test's outcome — a report it writes whatever stops it.

It runs the local backend, its batcher and prefix reuse, SFT, GRPO (FSDP2 parity on gloo: one GPU cannot hold
two NCCL ranks), the toy world and the weight syncs' structure with ``--device cuda --dtype bfloat16`` where
CUDA is present (the dtype a GPU gets by default) and as on CPU elsewhere, so it passes on a CPU too. It needs
torch (with CUDA on a GPU) and the project's pure-Python dependencies, but no package registry: ``--wheels DIR``
installs wheels brought along (``tests/gpu/bundle.py`` makes them where pip works) into ``.gpu-site/``.

**Time.** ``--timeout`` bounds the whole run — installing wheels, the machine probe, the tests, ``--bench`` and the
report — so the default (540 s) fits one 600 s call of a lent machine with a minute for its start-up; ``--bench``
takes its share from the same budget. Every subprocess has a deadline and a handled timeout.

**Stopping.** pytest runs in its own session; the runner is the child subreaper of everything under it (Linux), so
a server a test started in a session of its own is still the runner's to stop. At the limit, on SIGTERM or SIGINT,
it stops pytest (SIGTERM: pytest tears its fixtures down, the engines' servers included), then every process left
under it, and writes the report of what finished: each test's outcome, and for the rest "stopped at N s while
running" or "not run: stopped at N s".

**The report** (Markdown, and the JSON it is made from): the machine (what cannot be read — no git, no torch — says
"unknown"), each test's outcome with its reason and time and what it recorded, the numerics of the exactness claims
(each measured difference beside its bound and the bound's formula, ``tests/conftest.py``), and with ``--bench`` the
local backend's per-step profile (``perf/bench_local_batching.py``). Tests print as they end (``-v``).

    python3 tests/gpu/run.py [--wheels DIR ...] [--report gpu-report.md] [--timeout 540] [--bench] [-- -k resume]
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
#: seconds kept for writing the report after the tests, and for a stopped pytest's teardown before it is killed
REPORT_MARGIN, TEARDOWN_GRACE = 10, 20
#: the share of the budget ``--bench`` takes (the benchmark is cut at it, reported as such)
BENCH_SECONDS = 120
PR_SET_CHILD_SUBREAPER = 36


class Stopped(Exception):
    """SIGTERM or SIGINT reached the runner."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def become_subreaper() -> bool:
    """Orphans of anything under the runner (a server a test started in its own session, then lost) are re-parented
    to the runner, so :func:`stop_descendants` finds them (Linux ``prctl``; elsewhere False)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux /proc), children before their own children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(x) for t in os.listdir(f"/proc/{p}/task") for x in
                    Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def stop_descendants(grace: float = 5.0) -> list[int]:
    """SIGTERM to every process left under the runner, SIGKILL after ``grace``; returns the pids it found."""
    found = descendants(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while descendants(os.getpid()) and time.monotonic() < deadline:
            reap()
            time.sleep(0.1)
        reap()
    return found


def reap() -> None:
    """Collect exited children (a subreaper inherits zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def run_bounded(cmd: list[str], seconds: float, **kw) -> tuple[int | None, str, str]:
    """``cmd`` in a session of its own, at most ``seconds``: (exit status or None when cut, stdout, stderr)."""
    if seconds <= 0:
        return None, "", "no time left"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)
    try:
        out, err = proc.communicate(timeout=seconds)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        stop_group(proc, 5)
        out, err = proc.communicate()
        return None, out, err + f"\n(cut at its {seconds:.0f} s limit)"


def stop_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to a process's session, SIGKILL after ``grace``."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def install_wheels(dirs: list[Path], seconds: float) -> Path:
    """``pip install --no-index --no-deps --target .gpu-site`` of every wheel in ``dirs``; returns the site dir."""
    site = ROOT / ".gpu-site"
    wheels = [str(w) for d in dirs for w in sorted(Path(d).glob("*.whl"))]
    if not wheels:
        sys.exit(f"no wheels in {', '.join(map(str, dirs))}: make them with tests/gpu/bundle.py where pip works")
    rc, _, err = run_bounded([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade",
                              "--target", str(site), *wheels], seconds)
    if rc != 0:
        sys.exit(f"installing the wheels failed: {err[-1500:]}")
    return site


PROBE = """import json, platform
out = {'python': platform.python_version()}
try:
    import torch
    out['torch'] = torch.__version__
    out['cuda'] = torch.cuda.is_available()
    if out['cuda']:
        out['gpu'] = torch.cuda.get_device_name(0); out['gpus'] = torch.cuda.device_count()
        out['cuda_version'] = torch.version.cuda
except Exception as exc:
    out['torch'] = f'missing ({exc})'; out['cuda'] = False
missing = []
for name in NEEDS:
    try:
        __import__(name)
    except Exception as exc:
        missing.append(f'{name} ({type(exc).__name__}: {exc})')
out['missing'] = missing
try:
    import transformers; out['transformers'] = transformers.__version__
except Exception:
    pass
print(json.dumps(out))
"""


def machine(seconds: float = 90) -> dict:
    """The facts the report opens with, read in a child process (the parent stays free of torch); what cannot be
    read is "unknown", never a crash."""
    rc, out, err = run_bounded([sys.executable, "-c", PROBE.replace("NEEDS", repr(NEEDS))], seconds)
    try:
        facts = json.loads(out.strip().splitlines()[-1]) if rc == 0 else {"probe_error": err.strip()[-500:]}
    except (ValueError, IndexError):
        facts = {"probe_error": (out + err).strip()[-500:]}
    facts["host"] = platform.node() or "unknown"
    facts["commit"] = commit()
    return facts


def commit() -> str:
    """The checkout's commit (and whether it has changes), or "unknown" and why (no git binary, not a checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=20)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=20).stdout.strip()
    except FileNotFoundError:
        return "unknown (no git here)"
    except subprocess.TimeoutExpired:
        return "unknown (git did not answer)"
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" + uncommitted changes" if dirty else "")


def read_log(log: Path) -> tuple[list[str], dict[str, dict], set[str]]:
    """The plugin's log (``tests/gpu/plugin.py``): the tests collected, one record per test that reported (outcome,
    reason, seconds, recorded properties; the first phase that did not pass says why) and the tests that started."""
    collected: list[str] = []
    rows: dict[str, dict] = {}
    started: set[str] = set()
    if not log.is_file():
        return collected, rows, started
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if "collected" in rec:
            collected = collected or rec["collected"]
            continue
        if rec.get("when") == "start":
            started.add(rec["test"])
            continue
        row = rows.setdefault(rec["test"], {"test": rec["test"], "outcome": "passed", "reason": "", "seconds": 0.0,
                                            "properties": {}})
        row["seconds"] += rec["seconds"]
        row["properties"].update(rec["properties"])
        if rec["outcome"] != "passed" and row["outcome"] == "passed":
            row["outcome"] = ("error" if rec["when"] != "call" and rec["outcome"] == "failed" else rec["outcome"])
            row["reason"] = rec["reason"]
    return collected, rows, started


def outcomes(log: Path, stopped_at: float | None = None) -> list[dict]:
    """One row per test collected: what it reported; with the run stopped at ``stopped_at`` seconds, the tests that
    were running then or never ran, each saying so."""
    collected, rows, started = read_log(log)
    out = [rows[t] for t in collected if t in rows] + [r for t, r in rows.items() if t not in collected]
    for t in collected:
        if t in rows:
            continue
        if t in started:
            why = f"stopped at {stopped_at:.0f} s while running" if stopped_at is not None else "did not finish"
            out.append({"test": t, "outcome": "interrupted", "reason": why, "seconds": 0.0, "properties": {}})
        else:
            why = f"not run: stopped at {stopped_at:.0f} s" if stopped_at is not None else "not run"
            out.append({"test": t, "outcome": "not run", "reason": why, "seconds": 0.0, "properties": {}})
    return out


def numerics(rows: list[dict]) -> list[str]:
    """The exactness claims' numbers: per test and kind, the measured difference beside its bound and formula."""
    lines = []
    for r in rows:
        props = r["properties"]
        for key in sorted(k for k in props if k.endswith("_measured")):
            kind = key[: -len("_measured")]
            lines.append(f"| `{r['test']}` | {kind} | {props[key]} | {props.get(kind + '_bound', '?')} | "
                         f"{props.get(kind + '_formula', '')} |")
    if not lines:
        return []
    return ["", "## Numerics: each measured difference beside its bound", "",
            "| test | claim | measured | bound | formula |", "|---|---|---|---|---|", *lines]


def report(path: Path, facts: dict, rows: list[dict], cmd: list[str], seconds: float, rc: int, bench: str,
           stop: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    kinds = ("passed", "failed", "error", "skipped", "interrupted", "not run")
    counts = {k: sum(r["outcome"] == k for r in rows) for k in kinds}
    lines = ["# GPU runner report", "",
             "| fact | value |", "|---|---|",
             *(f"| {k} | {v} |" for k, v in facts.items() if k != "missing"),
             f"| missing imports | {', '.join(facts.get('missing') or []) or 'none'} |",
             f"| command | `{shlex.join(cmd)}` |" if cmd else "| command | (none: the tests did not start) |",
             f"| wall time | {seconds:.0f} s (exit {rc}) |", *([f"| stopped | {stop} |"] if stop else []), "",
             ", ".join(f"{v} {k}" for k, v in counts.items() if v or k in ("passed", "failed")), "",
             "| test | outcome | seconds | reason / recorded |", "|---|---|---|---|"]
    for r in rows:
        extra = "; ".join(f"{k}={v}" for k, v in r["properties"].items())
        note = " — ".join(x for x in (r["reason"], extra) if x).replace("|", "\\|")
        lines.append(f"| `{r['test']}` | {r['outcome']} | {r['seconds']:.1f} | {note} |")
    lines += numerics(rows)
    if bench:
        lines += ["", "## The local backend on this machine (`perf/bench_local_batching.py`)", "", bench.strip()]
    path.write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps({"machine": facts, "counts": counts, "tests": rows,
                                                     "command": cmd, "seconds": seconds, "exit": rc, "stopped": stop,
                                                     "bench": bench}, indent=1))
    print(f"\n{', '.join(f'{v} {k}' for k, v in counts.items() if v)}; report: {path}", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", type=Path, nargs="*", default=[],
                    help="Folders of wheels to install first (no registry needed): tests/gpu/bundle.py makes them.")
    default_report = Path(os.environ["OUT"]) / "gpu-report.md" if os.environ.get("OUT") else ROOT / "gpu-report.md"
    ap.add_argument("--report", type=Path, default=default_report,
                    help="Where the report goes (default: $OUT/gpu-report.md when $OUT is set, else ./gpu-report.md); "
                         "its folder is made.")
    ap.add_argument("--timeout", type=int, default=540,
                    help="Seconds for the whole run: wheels, probe, tests, --bench and the report (default 540: one "
                         "600 s call with a minute for the machine's start-up).")
    ap.add_argument("--workers", default="auto",
                    help="pytest-xdist workers when it is installed (auto: 4 on a GPU, none on a CPU; 0: none).")
    ap.add_argument("--bench", action="store_true",
                    help=f"Also run the local backend's benchmark and step profile (its last {BENCH_SECONDS} s of the "
                         "budget).")
    ap.add_argument("--tests", nargs="*", default=None, help="Test files or node ids instead of the GPU subset.")
    ap.add_argument("pytest_args", nargs="*", help="Extra pytest arguments (after --), e.g. -k resume.")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    t0 = time.monotonic()
    deadline = t0 + args.timeout
    subreaper = become_subreaper()

    def on_signal(signum, frame):  # noqa: ARG001
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    for name in [k for k in env if k.startswith("PYTEST_XDIST") or k == "PYTEST_CURRENT_TEST"]:
        del env[name]  # started from an xdist worker (the suite's own test): its pytest is a session of its own
    facts: dict = {"host": platform.node() or "unknown"}
    cmd: list[str] = []
    log = args.report.with_suffix(".jsonl")
    rc, bench, stop, stopped_at = 0, "", "", None
    try:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        site = install_wheels(args.wheels, min(300, deadline - time.monotonic())) if args.wheels else None
        path = [str(site)] if site else []
        env["PYTHONPATH"] = os.pathsep.join([*path, str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        os.environ.update(env)
        facts = machine(min(90, deadline - time.monotonic()))
        if facts.get("missing") or "probe_error" in facts:  # the conftest would not import: say what to bring
            report(args.report, facts, [], [], time.monotonic() - t0, 2, "")
            print("missing imports: " + "; ".join(facts.get("missing") or [facts.get("probe_error", "")]) +
                  "\nbring them as wheels: tests/gpu/bundle.py where pip works, then tests/gpu/run.py --wheels DIR")
            return 2
        cuda = bool(facts.get("cuda"))
        log.unlink(missing_ok=True)
        env["PARAVT_TEST_LOG"] = str(log)
        tests = args.tests if args.tests is not None else [t for t in SUBSET if (ROOT / t).is_file()]
        cmd = [sys.executable, "-m", "pytest", *tests, "-p", "tests.gpu.plugin", "-m", "not slow or gpu", "-v",
               "-p", "no:cacheprovider", "--device", "cuda" if cuda else "auto",
               "--dtype", "bfloat16" if cuda else "float32", *args.pytest_args]
        workers = (4 if cuda else 0) if args.workers == "auto" else int(args.workers)
        if workers and run_bounded([sys.executable, "-c", "import xdist"], 30)[0] == 0:
            cmd += ["-n", str(workers)]
        budget = deadline - time.monotonic() - REPORT_MARGIN - TEARDOWN_GRACE - (BENCH_SECONDS if args.bench else 0)
        print(f"$ {shlex.join(cmd)}\n(the tests' share of the {args.timeout} s budget: {budget:.0f} s)", flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)  # its own group: xdist workers too
        try:
            rc = proc.wait(timeout=max(budget, 1))
        except subprocess.TimeoutExpired:
            stopped_at, rc = time.monotonic() - t0, 124
            stop = f"at the runner's limit ({args.timeout} s budget, {budget:.0f} s for the tests)"
            print(f"the tests passed their share of the limit: stopping them ({stop})", flush=True)
            stop_group(proc, TEARDOWN_GRACE)
        except Stopped as sig:
            stopped_at, rc, stop = time.monotonic() - t0, 128 + sig.signum, f"by {sig}"
            print(f"stopped {stop}: stopping the tests", flush=True)
            stop_group(proc, TEARDOWN_GRACE)
        if args.bench and stopped_at is None:
            bench = run_bench(cuda, env, deadline - time.monotonic() - REPORT_MARGIN)
    except Stopped as sig:
        stopped_at, rc, stop = time.monotonic() - t0, 128 + sig.signum, f"by {sig}"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the report is written whatever comes now
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        left = stop_descendants()
        if left:
            print(f"stopped {len(left)} processes the tests left behind"
                  + ("" if subreaper else " (of this process's own children only: no subreaper here)"), flush=True)
    if cmd:
        report(args.report, facts, outcomes(log, stopped_at), cmd, time.monotonic() - t0, rc, bench, stop)
    elif stop:
        report(args.report, facts, [], [], time.monotonic() - t0, rc, bench, stop)
    return rc


def run_bench(cuda: bool, env: dict, seconds: float) -> str:
    """The local backend's benchmark within ``seconds`` (cut there, saying so)."""
    seconds = min(seconds, BENCH_SECONDS)
    rc, out, err = run_bounded([sys.executable, "perf/bench_local_batching.py", "--device", "cuda" if cuda else "cpu",
                                "--repeat", "2"], seconds, cwd=ROOT, env=env)
    if rc == 0:
        print(out, flush=True)
        return out
    why = f"cut at {seconds:.0f} s" if rc is None else f"exit {rc}"
    return f"(the benchmark did not finish: {why}) {out[-1500:]} {err[-1500:]}"


if __name__ == "__main__":
    sys.exit(main())
