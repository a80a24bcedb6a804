"""The GPU runner (tests/gpu/run.py) under what stops it on a lent machine: a SIGTERM from the harness, its own time
limit, a machine without git or with an import missing. It always writes its report, names every test (passed,
stopped while running, not run) and leaves no pytest and no server behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = "tests/gpu/probe_runner.py"


def _start(tmp_path, *args, env=None):
    env = {**os.environ, "PARAVT_PROBE_DIR": str(tmp_path), **(env or {})}
    env.pop("OUT", None)
    return subprocess.Popen([sys.executable, "tests/gpu/run.py", "--tests", PROBE, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, proc, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


def _probe_pytests() -> list[int]:
    """Processes still running the probe's pytest."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "-m pytest" in cmd and PROBE in cmd:
                out.append(int(d.name))
    return out


@pytest.mark.slow
def test_a_sigterm_still_writes_the_report_and_stops_pytest_and_its_servers(tmp_path):
    report = tmp_path / "out" / "deep" / "gpu-report.md"  # a folder that does not exist yet
    proc = _start(tmp_path, "--report", str(report), "--timeout", "400")
    _wait_for(tmp_path / "server.pid", proc)
    server = int((tmp_path / "server.pid").read_text())
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    data = json.loads(report.with_suffix(".json").read_text())
    by = {t["test"].split("::")[-1]: t for t in data["tests"]}
    assert by["test_passes"]["outcome"] == "passed"
    assert by["test_holds_a_server_then_sleeps"]["outcome"] == "interrupted"
    assert "while running" in by["test_holds_a_server_then_sleeps"]["reason"]
    assert by["test_after"]["outcome"] == "not run" and by["test_after"]["reason"].startswith("not run: stopped at")
    assert data["stopped"] == "by SIGTERM" and data["exit"] == 143
    md = report.read_text()
    assert "| batch | 1.2e-05 | 0.0001 | float32: 0.0001 |" in md  # the numerics table: measured beside its bound
    assert not _alive(server), "the test's server outlived the runner"
    assert (tmp_path / "server.stopped").exists()  # pytest tore the fixture down (not only the runner's sweep)
    assert not _probe_pytests()


@pytest.mark.slow
def test_the_runners_own_limit_stops_the_tests_and_reports_what_ran(tmp_path):
    report = tmp_path / "gpu-report.md"
    # 75 s: the machine probe takes ~9 s quiet, 30 s stay for teardown and the report, ~35 s for the tests (their
    # collection takes ~5 s quiet; at 45 s the tests had 6 s, and under another pytest's load none was collected)
    proc = _start(tmp_path, "--report", str(report), "--timeout", "75")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 124, out[-3000:]
    data = json.loads(report.with_suffix(".json").read_text())
    assert "at the runner's limit" in data["stopped"] and data["seconds"] < 75 + 5
    outcomes = {t["test"].split("::")[-1]: t["outcome"] for t in data["tests"]}
    assert outcomes["test_after"] == "not run" and "test_holds_a_server_then_sleeps" in outcomes
    if (tmp_path / "server.pid").exists():
        assert not _alive(int((tmp_path / "server.pid").read_text()))


def test_no_git_and_a_missing_import_still_report_in_a_new_folder(tmp_path):
    """A bare machine: no git binary on PATH, an import of the suite's that fails (a stand-in module raising
    ImportError first on the path), the report's folder not made yet: the runner writes the report naming both and
    exits 2 at once, no traceback."""
    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "msgspec.py").write_text("raise ImportError('msgspec is not installed here')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    report = tmp_path / "new" / "gpu-report.md"
    env = {"PATH": str(bin_dir), "PYTHONPATH": str(fake)}
    proc = _start(tmp_path, "--report", str(report), env=env)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    data = json.loads(report.with_suffix(".json").read_text())
    assert data["machine"]["commit"] == "unknown (no git here)"
    assert any(m.startswith("msgspec") for m in data["machine"]["missing"])
    assert "missing imports: msgspec" in out
