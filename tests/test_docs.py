"""Docs that match the code: the generated configuration reference, every documented field, the commands the
pages name, README's length and links, and the docs site (`mkdocs build --strict`)."""

import re
from pathlib import Path

from paravt_train.config_reference import render, undocumented

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_field_is_documented_once():
    assert undocumented() == []


def test_the_configuration_reference_is_current():
    page = (ROOT / "docs" / "config.md").read_text()
    assert page == render(), "regenerate it: python -m paravt_train.config_reference > docs/config.md"


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _scripts() -> dict[str, str]:
    """pyproject.toml's [project.scripts]: command -> ``module:attribute`` (read as text: no tomllib on 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"', section[1], re.M))


def test_the_commands_readme_names_exist():
    """Every `paravt X`, `paravt-train X` and `paravt-lmms X` that README.md or a docs page names is a command of
    that console script (pyproject.toml's [project.scripts], its Typer app's subcommands)."""
    import importlib

    import typer

    scripts = _scripts()
    missing = []
    for script in ("paravt", "paravt-train", "paravt-lmms"):
        named: dict[str, set[str]] = {}
        for page in _pages():
            for cmd in re.findall(rf"(?<![\w.-]){re.escape(script)} ([a-z][a-z-]+)", page.read_text()):
                named.setdefault(cmd, set()).add(str(page.relative_to(ROOT)))
        if not named:
            continue
        if script not in scripts:
            missing.append(f"{script} (not in pyproject.toml's [project.scripts]), named as: {sorted(named)}")
            continue
        module, attr = scripts[script].split(":")
        group = typer.main.get_command(getattr(importlib.import_module(module), attr))
        commands = set(getattr(group, "commands", {}))
        missing += [f"{script} {cmd} ({', '.join(sorted(pages))})" for cmd, pages in sorted(named.items())
                    if cmd not in commands]
    assert not missing, f"the docs name commands that do not exist: {missing}"


def test_readme_is_a_short_tour_whose_links_resolve():
    """README.md stays a page a newcomer reads in five minutes (the manual is the docs site), and its relative
    links (to docs pages, files) resolve; mkdocs checks the docs pages' own links."""
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 250, f"README.md has {readme.count(chr(10))} lines: move the detail to docs/"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    broken = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert links and not broken, broken


def test_the_docs_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page missing from nav or any other warning fails."""
    import os
    import shutil
    import subprocess
    import sys

    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    assert mkdocs, "mkdocs is not installed (the dev extra: pip install -e '.[dev]')"
    run = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # Material's banner about MkDocs 2.0
    log = run.stdout + run.stderr
    assert run.returncode == 0 and "WARNING" not in log, log[-5000:]
    assert (tmp_path / "site" / "index.html").exists()
    nav = (ROOT / "mkdocs.yml").read_text()
    unlisted = [p.name for p in (ROOT / "docs").glob("*.md") if p.name not in nav]
    assert not unlisted, f"pages missing from mkdocs.yml's nav: {unlisted}"


def test_modules_and_functions_stay_readable():
    """No module over 450 lines; no function over 80 unless its docstring says why (\"on purpose\", \"by design\")."""
    import ast

    long = []
    for pkg in ("paravt_agent", "paravt_train", "tools"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            src = path.read_text()
            if src.count("\n") > 450:
                long.append(f"{path.relative_to(ROOT)}: {src.count(chr(10))} lines")
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80:
                    doc = ast.get_docstring(node) or ""
                    if "on purpose" not in doc and "by design" not in doc:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long, long
