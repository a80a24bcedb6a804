"""Rules of the suite itself, checked by scanning it (each scan proven to catch its case).

* A test that needs a real engine or server the machine may lack (SGLang's CPU engine, lmms-eval, PostgreSQL,
  Chromium, curl, network namespaces) skips through ``tests/conftest.py``'s ``engine_unavailable``, which fails it
  under ``PARAVT_REQUIRE_ENGINES`` (CI): a missing install cannot leave CI green with the test not run. Skips for
  what the hardware or a library version decides (no CUDA here, a PyAV that cannot write a display matrix) stay.
* CI runs exactly the test command README.md gives (its "Two commands" block), as written there.
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
