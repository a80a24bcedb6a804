"""The GPU runner's pytest plugin (``tests/gpu/run.py`` loads it with ``-p tests.gpu.plugin``): a log of the run
that survives the run being stopped, one JSON line per event in ``PARAVT_TEST_LOG`` as it happens:

* ``{"collected": [node ids]}`` once collection is done (the runner names every test that never ran);
* ``{"test", "when": "start"}`` as a test starts (a test stopped while running is named as such);
* ``{"test", "when", "outcome", "seconds", "reason", "properties"}`` as each phase ends (a failing setup or
  teardown, every call), with the properties the test recorded (the numerics' measured differences and bounds).

Under pytest-xdist the controller writes (it gets every worker's reports). SIGTERM becomes a KeyboardInterrupt
(:func:`interrupt_on_sigterm`, the suite's conftest does the same), so pytest tears its fixtures down, the servers
they started included, before it exits.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

__all__ = ["interrupt_on_sigterm"]


def interrupt_on_sigterm() -> None:
    """SIGTERM (a harness's time limit, ``kill``) ends the run as Ctrl-C does: pytest stops, runs every fixture's
    teardown (servers, processes) and exits, instead of dying with them left running."""

    def stop(signum, frame):  # noqa: ARG001 (the signal module's handler signature)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM during the teardown ends it at once
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, stop)


def _write(line: dict) -> None:
    path = os.environ.get("PARAVT_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def pytest_configure(config):  # noqa: ARG001
    interrupt_on_sigterm()


def pytest_collection_finish(session):
    _write({"collected": [item.nodeid for item in session.items]})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):  # noqa: ARG001 (the controller: every worker collects all)
    _write({"collected": list(ids)})


def pytest_runtest_logstart(nodeid, location):  # noqa: ARG001
    _write({"test": nodeid, "when": "start"})


def pytest_runtest_logreport(report):
    if report.when != "call" and report.passed:
        return
    reason = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
    elif report.failed:
        reason = " ".join(str(report.longrepr).split())[-400:]
    _write({"test": report.nodeid, "when": report.when, "outcome": report.outcome, "seconds": report.duration,
            "reason": reason, "properties": {str(k): str(v) for k, v in report.user_properties}})
