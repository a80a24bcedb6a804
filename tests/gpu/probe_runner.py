"""Tests the runner's own test runs (``tests/test_gpu_runner.py``) point it at: not collected by the suite (the name
does not start with ``test_``). One passes, one holds a server — a process in a session of its own, as an engine
fixture's SGLang server is — and sleeps until it is stopped, one would run after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


@pytest.fixture
def server():
    """A process in a session of its own (it outlives a signal to pytest's process group), its pid written where
    the runner's test reads it; stopped at teardown."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    Path(os.environ["PARAVT_PROBE_DIR"], "server.pid").write_text(str(proc.pid))
    yield proc
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    Path(os.environ["PARAVT_PROBE_DIR"], "server.stopped").write_text("by the fixture's teardown")


def test_passes(record_property):
    record_property("batch_measured", "1.2e-05")
    record_property("batch_bound", "0.0001")
    record_property("batch_formula", "float32: 0.0001")


def test_holds_a_server_then_sleeps(server):
    time.sleep(float(os.environ.get("PARAVT_PROBE_SLEEP", "300")))


def test_after():
    pass
