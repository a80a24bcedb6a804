"""README.md's shell and Python blocks run as pasted: in a scratch folder, in order, with the venv's commands on
PATH (as after `source .venv/bin/activate`). A block that cannot run here says why in a comment above it
(``<!-- readme-test: skip (reason) -->``)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(?:<!-- readme-test: skip \((?P<why>[^)]*(?:\([^)]*\)[^)]*)*)\) -->\n)?```(?P<lang>bash|python)\n"
                   r"(?P<code>.*?)\n```", re.S)


def blocks() -> list[tuple[int, str, str, str | None]]:
    text = (ROOT / "README.md").read_text()
    return [(text[:m.start()].count("\n") + 1, m["lang"], m["code"], m["why"]) for m in BLOCK.finditer(text)]


def test_every_block_runs_or_says_why_not():
    found = blocks()
    fences = (ROOT / "README.md").read_text().count("```bash") + (ROOT / "README.md").read_text().count("```python")
    assert len(found) == fences  # no block escapes the pattern
    assert all(why is None or why.strip() for *_, why in found)
    assert sum(why is None for *_, why in found) >= 6


@pytest.mark.slow
def test_readme_blocks_run_as_pasted(tmp_path):
    for name in (".venv", ".venv-lmms", "checkpoints", "examples"):
        if (ROOT / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PARAVT_HOME": str(tmp_path / "paravt-home"), "MPLBACKEND": "Agg"}
    env.pop("OTEL_TRACES_EXPORTER", None)
    ran = 0
    for line, lang, code, why in blocks():
        if why is not None:
            continue
        if ".venv-lmms/" in code and not (ROOT / ".venv-lmms").exists():
            continue  # make lmms-eval was not run (as the lmms-eval test, skipped without it)
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"README.md line {line} ({lang}) failed:\n{code}\n---\n" + \
            run.stdout[-3000:] + run.stderr[-3000:]
        ran += 1
    assert ran >= 6
