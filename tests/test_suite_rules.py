"""Rules of the suite itself, checked by scanning it (each scan proven to catch its case).

* A test that needs a real engine or server the machine may lack (SGLang's CPU engine, lmms-eval, PostgreSQL,
  Chromium, curl, network namespaces) skips through ``tests/conftest.py``'s ``engine_unavailable``, which fails it
  under ``PARAVT_REQUIRE_ENGINES`` (CI): a missing install cannot leave CI green with the test not run. Skips for
  what the hardware or a library version decides (no CUDA here, a PyAV that cannot write a display matrix) stay.
* CI runs exactly the test command README.md gives (its "Two commands" block), as written there.
* Every port a test hands to a server it starts comes from ``free_port`` (a bind to port 0 in a test is refused by
  the scan): below the OS's ephemeral range and SGLang's own ports, one slice per xdist worker.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent
#: words of a skip reason that say something is not installed or could not start: an engine's skip
MISSING = re.compile(r"not installed|could not (start|install)|\bmake [a-z-]+|apt-get|pip install", re.I)


def silent_engine_skips(source: str, name: str = "<test>") -> list[str]:
    """``pytest.skip(...)`` calls and ``skipif(..., reason=...)`` marks whose reason says something is missing."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        fn = ast.unparse(node.func)
        if fn.endswith("pytest.skip") or fn.endswith("skipif"):
            texts = [ast.unparse(a) for a in node.args] + [ast.unparse(k.value) for k in node.keywords]
            if any(MISSING.search(t) for t in texts):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_engine_skips_go_through_engine_unavailable():
    offenders = [hit for f in sorted(ROOT.rglob("*.py")) if f.name != "conftest.py"
                 for hit in silent_engine_skips(f.read_text(), str(f.relative_to(ROOT)))]
    assert not offenders, "skip through engine_unavailable (fails under PARAVT_REQUIRE_ENGINES):\n" + "\n".join(
        offenders)


def test_the_scan_catches_each_form():
    assert silent_engine_skips('pytest.skip("lmms-eval is not installed (make lmms-eval)")')
    assert silent_engine_skips('pytestmark = pytest.mark.skipif(x, reason="Debian\'s chromium is not installed")')
    assert silent_engine_skips('if r:\n    pytest.skip(f"SGLang could not start: {r}")')
    assert not silent_engine_skips('pytest.mark.skipif(not cuda, reason="needs a CUDA GPU")')
    assert not silent_engine_skips('engine_unavailable("curl is not installed")')


def readme_test_command(readme: str) -> str:
    """The line of README.md's "Two commands" block that runs the tests."""
    block = readme.split("## Two commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    [line] = [ln for ln in block.splitlines() if ln.startswith("make test")]
    return line


def test_ci_runs_the_readmes_test_command():
    readme = (ROOT.parent / "README.md").read_text()
    ci = (ROOT.parent / ".ci" / "run").read_text().splitlines()
    line = readme_test_command(readme)
    assert line in ci, f".ci/run must run README's test command as written: {line!r}"
    assert readme_test_command(readme.replace("make test     #", "make test -j2 #")) not in ci  # the check catches it


def bind_zero_calls(source: str, name: str = "<test>") -> list[str]:
    """``.bind((host, 0))`` calls: a port the OS lends from its ephemeral range, which anything may take before the
    server started later binds it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(".bind") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Tuple) and len(arg.elts) == 2 and ast.unparse(arg.elts[1]) == "0":
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_ports_come_from_free_port_in_this_workers_slice(monkeypatch):
    from paravt_train.sync.distributed import port_clash
    from tests.conftest import free_port, rendezvous_port

    offenders = [hit for f in sorted(ROOT.rglob("*.py")) for hit in bind_zero_calls(f.read_text(), f.name)]
    assert not offenders, "take a port from tests.conftest.free_port:\n" + "\n".join(offenders)
    assert bind_zero_calls("with socket.socket() as s:\n    s.bind(('127.0.0.1', 0))\n")  # the scan catches it
    seen = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        seen[worker] = [free_port(room=3) for _ in range(20)], [rendezvous_port() for _ in range(5)]
    for ports, rendezvous in seen.values():
        assert not any(port_clash(p) or port_clash(p + 2) for p in ports)
        assert not any(port_clash(p) for p in rendezvous)
    assert max(seen["gw0"][0]) < min(seen["gw1"][0]) and max(seen["gw0"][1]) < min(seen["gw1"][1])
