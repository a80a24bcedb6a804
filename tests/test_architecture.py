"""The shape of the code (issue 45): the import graph of the package code has no circle and its packages no cycle,
``tools`` stands on the agent's foundation only, imports inside functions say why, and moved module paths still
import (with a DeprecationWarning naming the new one).

The layers, bottom to top::

    paravt_agent foundation   errors, plugins, defaults, protocol/, video/, trajectory, types, config, prompts
    tools                     the Tool interface, the built-in tools, the registry          (→ foundation only)
    paravt_agent runtime      policy/, graph/, agent, serving/, store, telemetry, cli        (→ tools, foundation)
    paravt_train              sft/, rl/, sync/, data/, eval/, benchmarks/, toy/, infra/      (→ paravt_agent, tools)
    paravt_lmms               the lmms-eval plugin and its command                           (→ paravt_train, ...)
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("paravt_agent", "paravt_train", "paravt_lmms", "tools")
#: what ``tools`` may import of ``paravt_agent``
FOUNDATION = ("paravt_agent.errors", "paravt_agent.plugins", "paravt_agent.defaults", "paravt_agent.protocol",
              "paravt_agent.video", "paravt_agent.trajectory", "paravt_agent.types", "paravt_agent.config",
              "paravt_agent.prompts")
#: the direction packages may import each other in (paravt_agent ↔ tools by the layers above)
ALLOWED = {("paravt_train", "paravt_agent"), ("paravt_train", "tools"), ("paravt_lmms", "paravt_agent"),
           ("paravt_lmms", "paravt_train"), ("paravt_lmms", "tools"), ("paravt_agent", "tools"),
           ("tools", "paravt_agent")}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(mods: dict[str, Path]) -> dict[str, list[tuple[str, ast.AST, bool]]]:
    """``module -> [(imported project module, node, inside a function)]``: every import, TYPE_CHECKING ones too."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out: dict[str, list] = {}
    for m, f in mods.items():
        found = []

        def walk(node, in_function, m=m, found=found):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import | ast.ImportFrom):
                    names = [a.name for a in child.names] if isinstance(child, ast.Import) else \
                        [f"{child.module}.{a.name}" for a in child.names]
                    for n in names:
                        target = resolve(n) if (child.level == 0 if isinstance(child, ast.ImportFrom) else True) \
                            else None
                        if target and target != m:
                            found.append((target, child, in_function))
                else:
                    walk(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef), m, found)

        walk(ast.parse(f.read_text()), False)
        out[m] = found
    return out


@pytest.fixture(scope="module")
def graph():
    mods = modules()
    return mods, imports(mods)


def test_no_import_circle(graph):
    """No two modules reach each other through imports — at module level, in functions or under TYPE_CHECKING."""
    mods, imps = graph
    edges = {m: {t for t, _, _ in imps[m]} for m in mods}
    index, low, stack, on, circles = {}, {}, [], set(), []
    sys.setrecursionlimit(10_000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in mods:
        if v not in index:
            visit(v)
    assert circles == []


def test_packages_import_in_one_direction_and_tools_only_the_foundation(graph):
    mods, imps = graph
    pkg = lambda name: name.split(".")[0]  # noqa: E731
    crossing = {(pkg(m), pkg(t)) for m in mods for t, _, _ in imps[m] if pkg(m) != pkg(t)}
    assert crossing <= ALLOWED, crossing - ALLOWED
    # tools stands on the foundation, and nothing in the foundation reaches tools or the runtime above it
    above = [(m, t) for m in mods if pkg(m) == "tools" for t, _, _ in imps[m]
             if pkg(t) == "paravt_agent" and not t.startswith(FOUNDATION)]
    assert above == []
    foundation = [m for m in mods if m.startswith(FOUNDATION)]
    seen, todo = set(), list(foundation)
    while todo:
        m = todo.pop()
        for t, _, _ in imps[m]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    assert not [m for m in seen if pkg(m) in ("tools", "paravt_train", "paravt_lmms")]
    assert not [m for m in seen if m.startswith(("paravt_agent.graph", "paravt_agent.agent", "paravt_agent.serving"))]


def test_imports_inside_functions_say_why(graph):
    """An import of the project's own modules inside a function is lazy on purpose (an optional dependency, a
    measured start-up cost) and says so: a comment on its line or just above its block."""
    mods, imps = graph
    silent = []
    for m, found in imps.items():
        lines = mods[m].read_text().splitlines()
        for _target, node, in_function in found:
            if not in_function:
                continue
            i = node.lineno - 1
            while i > 0 and lines[i - 1].strip().startswith(("from ", "import ")):
                i -= 1  # the first import of its block
            said = "#" in lines[node.lineno - 1] or lines[i - 1].strip().startswith("#")
            if not said:
                silent.append(f"{m}:{node.lineno}")
    assert silent == []


def test_the_folders_hold_their_concepts():
    """A top level of a few modules per package, the rest in folders named by concept (issue 45's shape)."""
    for pkg, folders, most in (("paravt_agent", {"protocol", "graph", "policy", "video", "serving"}, 14),
                               ("paravt_train", {"rl", "sync", "sft", "data", "eval", "benchmarks", "toy", "infra"}, 6)):
        top = [p.name for p in (ROOT / pkg).glob("*.py") if p.name != "__init__.py" and not p.name.startswith("_")]
        assert len(top) <= most, top
        assert folders <= {p.name for p in (ROOT / pkg).iterdir() if (p / "__init__.py").is_file()}


def test_moved_module_paths_import_with_a_deprecation_warning():
    import paravt_agent
    import paravt_train

    for old, new in [*paravt_agent.MOVED.items(), *paravt_train.MOVED.items()]:
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new) and module.__spec__.name == new
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old
    # the paths users put in scripts and YAML
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from paravt_train.grpo_config import GRPOConfig
        from paravt_train.grpo_trainer import GRPOTrainer
        from paravt_train.sft_config import SFTConfig
    from paravt_agent import Agent, AgentConfig  # noqa: F401
    from paravt_agent.protocol import parse_tool_calls  # noqa: F401
    from paravt_train.rl import GRPOConfig as New
    from paravt_train.rl import GRPOTrainer as NewTrainer
    from paravt_train.sft import SFTConfig as NewSFT

    assert (GRPOConfig, GRPOTrainer, SFTConfig) == (New, NewTrainer, NewSFT)


def test_importing_the_sdk_stays_cheap():
    """``import paravt_agent`` and ``paravt --help`` load no torch, transformers or gradio."""
    code = ("import sys, paravt_agent, paravt_agent.protocol, paravt_agent.config; "
            "print(sorted(m for m in ('torch', 'transformers', 'gradio', 'langgraph') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
