"""The shape of the code (issues 45 and 55): the import graph of the package code has no circle, its packages no
cycle, ``paravt_train``'s folders import downward only, ``tools`` stands on the agent's foundation only and the agent
never imports ``tools``, no base class reads what only its subclasses set, imports inside functions say why, and
moved module paths still import (with a DeprecationWarning naming the new one).

The packages, bottom to top::

    paravt_agent foundation   errors, plugins, defaults, protocol/, video/, trajectory, types, config, prompts
    tools                     the Tool interface, the built-in tools, the registry          (→ foundation only)
    paravt_agent runtime      policy/, graph/, agent, serving/, store, telemetry, cli        (→ foundation; the
                              default tools through the ``paravt.toolsets`` entry point, never by import)
    paravt_train              its folders, in the layers of TRAIN_LAYERS below               (→ paravt_agent, tools)
    paravt_lmms               the lmms-eval plugin and its command                           (→ paravt_train, ...)

``paravt_train``'s folders (and its top-level modules), bottom to top; a module imports its own folder and the
layers below it, never a layer above or another folder of its own layer::

    judge, rewards, methods   the LLM judge; R = R_acc + λ_fmt·R_fmt + R_tool and each agent's (rewards/, pure); the
                              method table
    infra                     torchrun/FSDP2, checkpoints and the one atomic export, LoRA, SIGTERM, trackers
    data                      formats, the records they become (PromptItem, transcripts), conversion, pre-filters
    benchmarks, eval          benchmark loaders; scoring and held-out evaluation
    sft                       the SFT cold start
    sync                      weights onto the rollout servers
    rl                        the GRPO loop (multi-agent RL inside it, importing it downward only: rl/marl/)
    online, toy               online learning (its own config, state, learner, gate, rollback); the embedded toy world
    config_reference, cli     the generated configuration reference; the ``paravt-train`` command
"""

from __future__ import annotations

import ast
import importlib
import re
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
#: the direction packages may import each other in: one way, so the packages have no cycle (the agent reaches its
#: default tools through an entry point, not an import)
ALLOWED = {("paravt_train", "paravt_agent"), ("paravt_train", "tools"), ("paravt_lmms", "paravt_agent"),
           ("paravt_lmms", "paravt_train"), ("paravt_lmms", "tools"), ("tools", "paravt_agent")}
#: paravt_train's folders and top-level modules, bottom to top (the module docstring says what each layer is)
TRAIN_LAYERS = [("judge",), ("rewards",), ("methods",), ("infra",), ("data",), ("benchmarks",), ("eval",), ("sft",),
                ("sync",), ("rl",), ("online", "toy"), ("config_reference",), ("cli",)]
#: base classes that still read attributes only their subclasses set (a debt, named so it cannot grow): none left
#: (the local backend's batcher became an object it holds, given its encoder and its batch runner)
READS_SUBCLASS_STATE: set[str] = set()


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


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan): every circle of ``edges``."""
    index, low, stack, on, found = {}, {}, [], set(), []
    sys.setrecursionlimit(10_000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle(graph):
    """No two modules reach each other through imports — at module level, in functions or under TYPE_CHECKING."""
    mods, imps = graph
    assert circles({m: {t for t, _, _ in imps[m]} for m in mods}) == []


def train_folder(module: str) -> str | None:
    """The folder of ``paravt_train`` a module is in (a top-level module is its own), None outside it."""
    parts = module.split(".")
    return parts[1] if parts[0] == "paravt_train" and len(parts) > 1 else None


def test_no_package_cycle_and_paravt_train_imports_downward(graph):
    """0 cycles between the packages and between paravt_train's folders, and no arrow up TRAIN_LAYERS: a folder
    imports only from the layers below its own (a new folder or top-level module takes its place in the list)."""
    mods, imps = graph
    pkg = lambda name: name.split(".")[0]  # noqa: E731
    packages: dict[str, set[str]] = {}
    folders: dict[str, set[str]] = {}
    for m in mods:
        for t, _, _ in imps[m]:
            packages.setdefault(pkg(m), set()).add(pkg(t))
            a, b = train_folder(m), train_folder(t)
            if a and b and a != b:
                folders.setdefault(a, set()).add(b)
    assert circles({p: ts - {p} for p, ts in packages.items()}) == []
    assert circles(folders) == []
    layer = {name: i for i, names in enumerate(TRAIN_LAYERS) for name in names}
    unplaced = sorted({train_folder(m) for m in mods if train_folder(m)} - set(layer))
    assert not unplaced, f"give these a layer in TRAIN_LAYERS: {unplaced}"
    upward = sorted(f"{m} -> {t}" for m in mods for t, _, _ in imps[m]
                    if train_folder(m) and train_folder(t) and train_folder(m) != train_folder(t)
                    and layer[train_folder(t)] >= layer[train_folder(m)])
    assert upward == []


def test_data_imports_nothing_from_rl(graph):
    """The records the loops share (PromptItem, the transcript a reward scores) live in data/, below rl/."""
    mods, imps = graph
    assert [(m, t) for m in mods if m.startswith("paravt_train.data") for t, _, _ in imps[m]
            if t.startswith("paravt_train.rl")] == []


def test_the_agent_reaches_tools_only_through_the_entry_point(graph):
    """``paravt_agent`` imports nothing of ``tools`` (not lazily, not by an import path in a string): its default
    tool set is the ``paravt.toolsets`` entry point, which pyproject.toml declares (and a source tree on PYTHONPATH
    reads from there)."""
    import re

    mods, imps = graph
    assert [(m, t) for m in mods if m.startswith("paravt_agent") for t, _, _ in imps[m] if t.startswith("tools")] == []
    named = [f"{m}: {node.value}" for m, f in mods.items() if m.startswith("paravt_agent")
             for node in ast.walk(ast.parse(f.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and re.fullmatch(r"tools(\.\w+)+(:[\w.]+)?|tools:[\w.]+", node.value)]
    assert named == []
    from paravt_agent.plugins import _source_entry_points, toolset
    from tools.registry import registry_of

    assert _source_entry_points("paravt.toolsets") == {"default": "tools.registry:registry_of"}
    assert toolset() is registry_of


def test_no_base_class_reads_what_only_its_subclasses_set():
    """Composition over size-cut inheritance (STYLE.md): a project class that another one inherits from defines or
    sets every attribute it reads on ``self`` (in its own body or its own project bases) — a part cut off a class
    that grew is an object the class holds (``GRPOTrainer.checkpoints``, ``OnlineLearner.promotion``), never a
    base reading the subclass's attributes. Bases with a base outside the project (pydantic, Exception) are not
    judged. READS_SUBCLASS_STATE names the ones left."""
    classes: dict[str, ast.ClassDef] = {}
    for m, f in modules().items():
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes[f"{m}.{node.name}"] = node
    by_name: dict[str, list[str]] = {}
    for q in classes:
        by_name.setdefault(q.rsplit(".", 1)[1], []).append(q)

    def bases(q: str) -> list[str | None]:  # project bases by name; None for one outside the project
        names = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in
                 classes[q].bases]
        return [x for n in names for x in (by_name.get(n) or [None if n not in ("object", "ABC", "Protocol") else
                                                              "object"]) if x != "object"]

    def own(q: str) -> set[str]:
        node, out = classes[q], set()
        for st in node.body:
            if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.add(st.name)
            elif isinstance(st, ast.Assign | ast.AnnAssign):
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        out |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Name) and n.value.id == "self"}
        return out | {a for b in bases(q) if b for a in own(b)}

    reading = []
    for base in sorted({b for q in classes for b in bases(q) if b}):
        if None in bases(base) or base in READS_SUBCLASS_STATE:
            continue
        reads = {n.attr for n in ast.walk(classes[base]) if isinstance(n, ast.Attribute)
                 and isinstance(n.ctx, ast.Load) and isinstance(n.value, ast.Name) and n.value.id == "self"}
        if reads - own(base):
            reading.append(f"{base} reads {sorted(reads - own(base))}")
    assert reading == []


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
    measured start-up cost) and says so: a comment on its line or just above its block, or — a command-line module
    whose every command imports lazily — one "Lazy imports:" paragraph in its docstring."""
    mods, imps = graph
    silent = []
    for m, found in imps.items():
        if "Lazy imports:" in (ast.get_docstring(ast.parse(mods[m].read_text())) or ""):
            continue
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
    for pkg, folders, most in (("paravt_agent", {"protocol", "graph", "policy", "video", "serving", "store"}, 12),
                               ("paravt_train", {"rl", "online", "sync", "sft", "data", "eval", "benchmarks", "toy",
                                                 "infra", "rewards"}, 6)):
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


#: the records the trainer passes between its stages, built by keyword only (``@dataclass(kw_only=True)``)
RECORDS = ("PromptItem", "TokenSequence", "UpdateItem", "ReplayItem")


def test_records_are_built_by_keyword():
    """A record built positionally (``UpdateItem(s, a, r.alpha, True)``) breaks silently when a field is added or
    moved: the records are keyword-only, and no call in the package, tests, examples or benchmarks passes one a
    positional argument."""
    import dataclasses

    from paravt_train.data.records import PromptItem
    from paravt_train.rl.replay import ReplayItem
    from paravt_train.rl.rollout import TokenSequence
    from paravt_train.rl.update import UpdateItem

    for cls in (PromptItem, TokenSequence, UpdateItem, ReplayItem):
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls.__name__
    positional = []
    for top in (*PACKAGES, "tests", "examples", "perf"):
        for f in (ROOT / top).rglob("*.py"):
            tree = ast.parse(f.read_text())
            names = set(RECORDS) | {a.asname for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                                    for a in n.names if a.name in RECORDS and a.asname}  # `import X as Y` too
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and node.args:
                    name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                    if name in names:
                        positional.append(f"{f.relative_to(ROOT)}:{node.lineno} {name}")
    assert not positional, positional


#: sub-folders that are parts of their parent's room, not rooms of their own: the collaborative mode's nodes, which
#: the graph's wiring (graph/build.py) puts beside the planner's and which run on the graph's runtime
PARTS = ("paravt_agent.graph.collab",)


def folder_of(module: str, mods: dict[str, Path]) -> str:
    """The node a module belongs to: its sub-folder (a sub-folder's ``__init__`` its own; rl/ and rl/marl/ are two
    nodes), or itself when it sits at a package's top (``paravt_agent.agent``, ``paravt_train.cli``: the top holds the
    foundation and the commands, one node each, as TRAIN_LAYERS places them). A folder of :data:`PARTS` is its
    parent's."""
    folder = module if mods[module].name == "__init__.py" else module.rpartition(".")[0]
    for part in PARTS:
        if folder == part or folder.startswith(part + "."):
            folder = part.rpartition(".")[0]
    return module if "." not in folder else folder


#: a project module path in a string: a lazy table's value, an import path ("module:attr"), an entry point's target
MODULE_STRING = re.compile(r"(paravt_agent|paravt_train|paravt_lmms|tools)(\.\w+)+(:[\w.]+)?")
#: the tables of deprecated paths (each entry goes away at REMOVED_IN, tests/test_releases.py): redirects for old
#: user code, not dependencies of the package's own
DEPRECATION_TABLES = ("MOVED", "_MOVED")


def string_edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """``module -> {project modules its strings name}``: lazy tables, "module:attr" strings, ``importlib`` targets —
    every way to reach a module without an import statement (the deprecation tables excepted)."""

    def resolve(name: str) -> str | None:
        name = name.split(":")[0]
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out: dict[str, set[str]] = {}
    for m, f in mods.items():
        tree = ast.parse(f.read_text())
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.Assign | ast.AnnAssign)
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name) and t.id in DEPRECATION_TABLES for n in ast.walk(node)}
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                    and MODULE_STRING.fullmatch(node.value):
                target = resolve(node.value)
                if target and target != m:
                    found.add(target)
        out[m] = found
    return out


def folder_loops(mods: dict[str, Path], imps: dict, strings: dict[str, set[str]]) -> list[list[str]]:
    """The circles between folders (sub-folders are nodes of their own), counting imports and string edges."""
    edges: dict[str, set[str]] = {}
    for m in mods:
        targets = {t for t, _, _ in imps[m]} | strings.get(m, set())
        a = folder_of(m, mods)
        for t in targets:
            b = folder_of(t, mods)
            if a != b:
                edges.setdefault(a, set()).add(b)
    return circles(edges)


def test_no_loop_between_folders_counting_lazy_tables_and_module_strings(graph):
    """Sub-folders are nodes (rl/ and rl/marl/ apart), and a lazy ``__getattr__`` table, a "module:attr" string or an
    ``importlib`` target counts as an edge like an import: no circle between folders. The hidden ten-module loop of
    0.5.1 (rl ⇄ rl/marl through the rollout's rewards and the lazy marl table; rl → online through online settings
    defined in rl/; methods → rl through the trainer named by string) is gone."""
    mods, imps = graph
    assert folder_loops(mods, imps, string_edges(mods)) == []


def test_the_folder_loop_scan_catches_each_form(tmp_path):
    """The scan finds a loop made by an import, by a lazy table's string, by a "module:attr" string; not by a
    deprecation table."""
    mods = {"paravt_train.a": tmp_path / "a/__init__.py", "paravt_train.a.x": tmp_path / "a/x.py",
            "paravt_train.b": tmp_path / "b/__init__.py", "paravt_train.b.y": tmp_path / "b/y.py"}
    for f in mods.values():
        f.parent.mkdir(parents=True, exist_ok=True)

    def loops(x: str, y: str) -> list:
        mods["paravt_train.a.x"].write_text(x)
        mods["paravt_train.b.y"].write_text(y)
        for init in ("a", "b"):
            (tmp_path / init / "__init__.py").write_text("")
        return folder_loops(mods, imports(mods), string_edges(mods))

    assert loops("import paravt_train.b.y\n", "import paravt_train.a.x\n")
    assert loops("import paravt_train.b.y\n", "_LAZY = {'X': 'paravt_train.a.x'}\n")
    assert loops("import paravt_train.b.y\n", "trainer: str = 'paravt_train.a.x:Trainer'\n")
    assert not loops("import paravt_train.b.y\n", "MOVED = {'paravt_train.old': 'paravt_train.a.x'}\n")
    assert not loops("import paravt_train.b.y\n", "")


#: what only the GRPO loop may touch of a trainer (its model and its optimizer): others go through its methods
TRAINER_INSIDES = ("model", "optimizer")


def trainer_insides_read(source: str) -> list[int]:
    """Lines that read ``<a trainer>.model`` / ``.optimizer`` (a name ending in ``trainer``, or ``tr``)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in TRAINER_INSIDES:
            owner = ast.unparse(node.value)
            if owner == "tr" or owner.endswith("trainer"):
                out.append(node.lineno)
    return out


def private_calls(source: str) -> list[str]:
    """Calls of another object's ``_private`` method (``x._name(...)`` with x not ``self``, ``cls`` or ``super()``);
    Python's own ``os._exit``, ``sys._getframe`` and named tuples' ``_replace``/``_asdict`` are not another class's
    insides."""
    allowed = {"os._exit", "sys._getframe"}
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, owner = node.func.attr, node.func.value
        if not name.startswith("_") or name.startswith("__") or name in ("_replace", "_asdict", "_fields", "_make"):
            continue
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
            continue
        if ast.unparse(node.func) in allowed:
            continue
        out.append(f"{node.lineno}: {ast.unparse(node.func)}")
    return out


def test_no_one_reads_the_trainers_insides_or_calls_a_private_method(graph):
    """Outside ``paravt_train/rl/`` no module reads a trainer's ``model`` or ``optimizer`` (the online learner's
    promotion goes through a port: export, load_weights, push), and no module of the package calls another object's
    ``_private`` method."""
    mods, _ = graph
    insides = [f"{m}:{line}" for m, f in mods.items() if not m.startswith("paravt_train.rl")
               for line in trainer_insides_read(f.read_text())]
    assert insides == []
    private = [f"{m}:{hit}" for m, f in mods.items() for hit in private_calls(f.read_text())]
    assert private == []


def test_the_insides_scans_catch_each_form():
    assert trainer_insides_read("tr.model.load_state_dict(sd)\nself.trainer.optimizer.state.clear()\n") == [1, 2]
    assert trainer_insides_read("cfg.model\nself.port.load_weights(p)\n") == []
    assert private_calls("self.promotion._event({})\n") == ["1: self.promotion._event"]
    assert private_calls("self._event({})\nsuper()._setup()\nos._exit(0)\nparts._replace(a=1)\n") == []
