"""The shell and Python blocks of README.md and of every docs page run as pasted: each page in a scratch folder of
its own, its blocks in order, with the venv's commands on PATH (as after `source .venv/bin/activate`). A block that
cannot run here says why in a comment above it (``<!-- readme-test: skip (reason) -->``): a GPU, a benchmark's
data, a server left running, a long training run. A block never depends on another page's files."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import engine_unavailable

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(?:<!-- readme-test: skip \((?P<why>[^)]*(?:\([^)]*\)[^)]*)*)\) -->\n)?```(?P<lang>bash|python)\n"
                   r"(?P<code>.*?)\n```", re.S)
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def blocks(page: str) -> list[tuple[int, str, str, str | None]]:
    text = (ROOT / page).read_text()
    return [(text[:m.start()].count("\n") + 1, m["lang"], m["code"], m["why"]) for m in BLOCK.finditer(text)]


@pytest.mark.parametrize("page", PAGES)
def test_every_block_runs_or_says_why_not(page):
    text = (ROOT / page).read_text()
    found = blocks(page)
    assert len(found) == text.count("```bash") + text.count("```python"), f"{page}: a block escapes the pattern"
    assert all(why is None or why.strip() for *_, why in found), f"{page}: a skipped block without a reason"
    assert text.count("readme-test:") == sum(why is not None for *_, why in found), \
        f"{page}: a readme-test marker that is not right above a bash or python block"


def test_the_pages_run_enough_of_their_blocks():
    runnable = {page: sum(why is None for *_, why in blocks(page)) for page in PAGES}
    assert runnable["README.md"] >= 3  # the quick tour: a video and an answer, the SDK, the CLI
    assert sum(runnable.values()) >= 8, runnable


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if any(why is None for *_, why in blocks(p))])
def test_page_blocks_run_as_pasted(page, tmp_path):
    for name in (".venv", ".venv-lmms", "checkpoints", "examples"):
        if (ROOT / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PARAVT_HOME": str(tmp_path / "paravt-home"), "MPLBACKEND": "Agg"}
    env.pop("OTEL_TRACES_EXPORTER", None)
    ran = 0
    for line, lang, code, why in blocks(page):
        if why is not None:
            continue
        if ".venv-lmms/" in code and not (ROOT / ".venv-lmms").exists():
            continue  # make lmms-eval was not run (as the lmms-eval test, skipped without it)
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"{page} line {line} ({lang}) failed:\n{code}\n---\n" + \
            run.stdout[-3000:] + run.stderr[-3000:]
        ran += 1
    if not ran:
        engine_unavailable(f"{page}'s blocks need .venv-lmms (make lmms-eval)")
