"""One way onto the server (issue #55): every way weights reach an SGLang server goes through the weight sync the
run's config names (``paravt_train/sync/``: ``push(model, version)`` after an update, ``serve(path, version)`` for a
saved model or adapter, ``adapter_name`` for the rollout requests), made by one registry with the servers' keys.

The rule "nothing branches on how weights move" is checked on the code itself: outside ``paravt_train/sync/`` no
module of ``paravt_train`` or ``paravt_agent`` compares ``sync.via`` (0.5.1's ``weight_sync``) with a sync's
name, or asks whether an object is one of the sync classes. The rest shows the paths: a kept version (promotion,
rollback, the operator's commands), the shadow gate's candidate and the trainer's own pushes, against servers that
check keys."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from paravt_agent.errors import ConfigError, PolicyError
from paravt_train.rl.config import GRPOConfig
from paravt_train.sync import SYNCS, SyncSettings, WeightSync, make_weight_sync

ROOT = Path(__file__).resolve().parents[1]
SYNC_DIR = ROOT / "paravt_train" / "sync"
SCANNED = ("paravt_agent", "paravt_train")


def sync_classes() -> set[str]:
    """The names of the classes ``paravt_train/sync/`` defines that are weight syncs (WeightSync and every class
    that derives from one of them)."""
    bases: dict[str, set[str]] = {}
    for f in SYNC_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
    found = {"WeightSync"}
    while True:
        more = {name for name, bs in bases.items() if bs & found} - found
        if not more:
            return found
        found |= more


#: what holds the name of a sync: ``sync.via`` (and 0.5.1's flat ``weight_sync``)
SYNC_NAME_KEYS = ("via", "weight_sync")


def _is_weight_sync(node: ast.AST) -> bool:
    """``x.via``, ``x["via"]``, ``x.get("via")``, a variable named ``via`` (and the same of ``weight_sync``)."""
    if isinstance(node, ast.Attribute):
        return node.attr in SYNC_NAME_KEYS
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value in SYNC_NAME_KEYS
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value in SYNC_NAME_KEYS
    return isinstance(node, ast.Name) and node.id in SYNC_NAME_KEYS


def _names_a_sync(node: ast.AST, names: set[str]) -> bool:
    """A sync's name (a string), or a tuple, list or set holding one."""
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_sync(e, names) for e in node.elts)
    return False


def _is_sync_class(node: ast.AST, classes: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in classes
    if isinstance(node, ast.Attribute):
        return node.attr in classes
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_sync_class(e, classes) for e in node.elts)
    return False


def backend_branches(source: str, names: set[str], classes: set[str]) -> list[tuple[int, str]]:
    """``(line, what)`` for every place ``source`` branches on how weights move: ``sync.via`` compared with a
    sync's name (``==``, ``!=``, ``in``, ``is``, or a ``match`` on it), ``isinstance`` / ``issubclass`` with a sync
    class, ``type(x)`` compared with one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_weight_sync(s) for s in sides) and any(_names_a_sync(s, names) for s in sides):
                found.append((node.lineno, "sync.via compared with a sync's name"))
            if any(isinstance(s, ast.Call) and isinstance(s.func, ast.Name) and s.func.id == "type" for s in sides) \
                    and any(_is_sync_class(s, classes) for s in sides):
                found.append((node.lineno, "type() compared with a sync class"))
        elif isinstance(node, ast.Match) and _is_weight_sync(node.subject):
            found.append((node.lineno, "match on sync.via"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
              and _is_sync_class(node.args[1], classes)):
            found.append((node.lineno, f"{node.func.id}() with a sync class"))
    return sorted(found)


def test_the_sync_names_are_the_configs():
    """The registry is the one list of syncs: the config offers exactly its names."""
    assert set(SYNCS) == set(SyncSettings.model_fields["via"].annotation.__args__) == {
        "disk", "tensor", "distributed", "lora"}


def test_no_backend_branch_outside_sync():
    """Outside ``paravt_train/sync/`` nothing compares ``sync.via`` with a sync's name or checks a sync's
    class: the trainer, the online learner, versions, promotion, rollback and the gate ask the sync the registry
    makes (``push``, ``serve``, ``adapter_name``)."""
    names, classes = set(SYNCS), sync_classes()
    assert {"WeightSync", "SGLangWeightSync", "StreamedSync", "SGLangTensorSync", "SGLangDistributedSync",
            "SGLangLoraSync"} <= classes
    found = []
    for pkg in SCANNED:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            if f.is_relative_to(SYNC_DIR):
                continue
            found += [f"{f.relative_to(ROOT)}:{line}: {what}"
                      for line, what in backend_branches(f.read_text(), names, classes)]
    assert not found, "branches on how weights move (ask the sync instead):\n" + "\n".join(found)


def test_the_scan_finds_every_kind_of_branch():
    """The scan above on the branches it forbids (each found, at its line) and on code that only passes the name
    along or asks the sync (none found)."""
    bad = """\
lora = cfg.sync.lora_name if cfg.sync.via == "lora" else None
if cfg["weight_sync"] in ("disk", "tensor"):
    pass
if cfg.sync.get("via") != "distributed":
    pass
if isinstance(tr.syncer, SGLangLoraSync):
    pass
if isinstance(s, (int, sync.SGLangWeightSync)):
    pass
if issubclass(kind, StreamedSync) or type(s) is SGLangTensorSync:
    pass
match cfg.sync.via:
    case "lora":
        pass
if via == "disk":
    pass
"""
    got = backend_branches(bad, set(SYNCS), sync_classes())
    assert [line for line, _ in got] == [1, 2, 4, 6, 8, 10, 10, 12, 15], got
    good = """\
sync = make_weight_sync(cfg, folder=out)
policy = make_rollout_policy(backend, model, lora=sync.adapter_name)
if cfg.sync.via not in SYNCS or isinstance(x, dict) or cfg.backend == "lora":
    raise ConfigError(f"sync.via {cfg.sync.via!r}")
sync.serve(path, version)
"""
    assert backend_branches(good, set(SYNCS), sync_classes()) == []


@pytest.mark.parametrize("name", sorted(SYNCS))
def test_every_sync_has_both_verbs_and_says_its_adapter(name, tmp_path):
    """Each sync the registry makes implements the interface's two verbs (an abstract one would refuse to be made)
    and names the adapter rollouts must name: the served adapter for lora, none for the full-weight syncs. A sync
    made from the config alone serves; it cannot push (nothing to export with)."""
    cfg = GRPOConfig(model="m", sync={"via": name, "lora_name": "mine"}, lora={"enabled": name == "lora"})
    sync = make_weight_sync(cfg, "http://127.0.0.1:9/v1")
    assert isinstance(sync, WeightSync) and sync.urls == ["http://127.0.0.1:9"]
    assert type(sync).serve is not WeightSync.serve and type(sync).push is not WeightSync.push
    assert sync.adapter_name == ("mine" if name == "lora" else None)
    if name in ("disk", "lora"):
        with pytest.raises(TypeError, match="serve"):
            sync.push(object(), "1")


# ------------------------------------------------------------------------------- versions, against keyed servers


@pytest.fixture
def keyed(tiny_model, monkeypatch):
    """The SGLang stand-in started with ``--api-key`` and ``--admin-api-key`` (401 without them), and the
    environment variables a config names them by."""
    from tests.test_sync_safety import StandIn

    srv = StandIn(tiny_model, "--api-key", "user-key", "--admin-api-key", "admin-key")
    monkeypatch.setenv("SRV_KEY", "user-key")
    monkeypatch.setenv("SRV_ADMIN_KEY", "admin-key")
    yield srv
    srv.close()


def _version_of(srv) -> str:
    return httpx.get(srv.url + "/model_info", headers={"Authorization": "Bearer user-key"},
                     timeout=30).json()["weight_version"]


def _adapter(root: Path, base: str) -> Path:
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "r": 4}))
    (root / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    return root


def test_a_kept_version_reaches_the_server_through_the_runs_sync_with_its_keys(tiny_model, keyed, tmp_path):
    """``push_version`` (the learner's start, promotion's rollback, ``paravt-train online promote|rollback``) serves
    a version with the sync ``sync.via`` names, made with the keys the config names: a model directory from disk
    for every full-weight sync (before, a disk sync made without keys: the keyed server answered 401); a LoRA
    version by its adapter name (the stand-in has no adapter routes: it answers 404 once the key is accepted).
    A version of the wrong kind for the sync, or whose weights were pruned, is a ConfigError that says so."""
    from paravt_train.online.versions import push_version

    def cfg(sync: str, keys: bool = True) -> GRPOConfig:
        keyed_env = {"api_key_env": "SRV_KEY", "admin_api_key_env": "SRV_ADMIN_KEY"} if keys else {}
        return GRPOConfig(model=tiny_model, backend="sglang", endpoint=keyed.url, sync={"via": sync, **keyed_env},
                          lora={"enabled": sync == "lora"})

    full = {"id": "v3", "path": tiny_model, "weight_version": "3"}
    for i, sync in enumerate(("disk", "tensor", "distributed")):
        push_version(cfg(sync), {**full, "weight_version": f"3{i}"})
        assert _version_of(keyed) == f"3{i}"
    with pytest.raises(ConfigError, match="401"):
        push_version(cfg("disk", keys=False), full)
    adapter = {"id": "v4", "path": str(_adapter(tmp_path / "v4", tiny_model)), "weight_version": "4"}
    with pytest.raises(PolicyError, match="load_lora_adapter refused"):
        push_version(cfg("lora"), adapter)
    with pytest.raises(ConfigError, match="401"):
        push_version(cfg("lora", keys=False), adapter)
    with pytest.raises(ConfigError, match="LoRA adapter.*sync.via lora"):
        push_version(cfg("disk"), adapter)
    with pytest.raises(ConfigError, match="not a LoRA adapter"):
        push_version(cfg("lora"), full)
    with pytest.raises(ConfigError, match="pruned"):
        push_version(cfg("disk"), {**full, "path": str(tmp_path / "gone")})
    assert _version_of(keyed) == "32" and keyed.alive()


def _posted(srv) -> list[str]:
    return [p for m, p, _ in srv.seen if m == "POST"]


def _shadow(monkeypatch, cfg, path: Path) -> dict:
    """The shadow gate's scores of ``path`` (:meth:`Promotion._scores`), the evaluation itself recorded instead."""
    from paravt_agent.config import AgentConfig
    from paravt_train.online import promotion
    from paravt_train.online.state import OnlineState
    from paravt_train.online.versions import VersionRegistry

    seen: dict = {}

    def evaluate(model_dir, agent_config, prompts, concurrency=8, endpoint=None, adapter=None, api_key=None):
        seen.update(model_dir=model_dir, endpoint=endpoint, adapter=adapter, api_key=api_key)
        return []

    monkeypatch.setattr(promotion, "evaluate_dir", evaluate)
    port = SimpleNamespace(eval_agent_config=AgentConfig)
    made = promotion.Promotion(port, VersionRegistry(path.parent / "versions"), cfg, OnlineState())
    assert made._scores(path) == []
    return seen


def test_the_shadow_gate_serves_its_candidate_with_the_runs_sync(tiny_model, keyed, json_server, tmp_path,
                                                                  monkeypatch):
    """The shadow gate puts the candidate on its server with the run's own sync, keys included (before, a disk
    sync without keys, whatever the run's sync: a LoRA candidate was sent to /update_weights_from_disk), then
    evaluates it there naming the adapter the sync served it under, with the server's key."""
    from paravt_train.online.config import OnlineConfig

    keys = {"api_key_env": "SRV_KEY", "admin_api_key_env": "SRV_ADMIN_KEY"}
    cfg = OnlineConfig(model=tiny_model, backend="sglang", endpoint="http://127.0.0.1:9",
                       sync={"via": "tensor", **keys}, online={"gate": {"mode": "shadow",
                                                                        "shadow_endpoint": keyed.url}})
    seen = _shadow(monkeypatch, cfg, Path(tiny_model))
    assert _version_of(keyed) == f"candidate-{Path(tiny_model).name}"
    assert seen == {"model_dir": Path(tiny_model), "endpoint": keyed.url, "adapter": None, "api_key": "user-key"}

    srv = json_server(lambda path, body: (200, {"success": True}))
    lora = cfg.model_copy(update={"sync": cfg.sync.model_copy(update={"via": "lora", "lora_name": "mine"}),
                                  "lora": cfg.lora.model_copy(update={"enabled": True}),
                                  "online": cfg.online.model_copy(update={"gate": cfg.online.gate.model_copy(
                                      update={"shadow_endpoint": srv.url})})})
    candidate = _adapter(tmp_path / "versions" / "v5", tiny_model)
    seen = _shadow(monkeypatch, lora, candidate)
    assert _posted(srv) == ["/unload_lora_adapter", "/load_lora_adapter", "/update_weight_version"]  # its version too
    assert srv.bodies[-2] == {"lora_name": "mine", "lora_path": str(candidate.resolve().parent / ".served-mine")}
    assert srv.bodies[-1] == {"new_version": "candidate-v5", "abort_all_requests": False}
    assert seen == {"model_dir": candidate, "endpoint": srv.url, "adapter": "mine", "api_key": "user-key"}


# ------------------------------------------------------------------------------------------- the trainer


def test_the_trainer_pushes_on_update_only_when_made_to_and_rolls_out_through_the_syncs_adapter(
        toy_policy_dir, json_server, tmp_path):
    """``push_updates`` is the trainer's own argument: made with False (as the online learner makes its trainer),
    setup pushes nothing to a server that takes pushes; by default it pushes its starting weights. The rollout
    policy names the adapter the sync serves the weights under (a LoRA run's ``sync.lora_name``), and none for a
    full-weight sync."""
    from paravt_train.online.learner import OnlineLearner
    from paravt_train.rl.trainer import GRPOTrainer

    srv = json_server(lambda path, body: (200, {"success": True}))
    base = dict(model=toy_policy_dir, backend="sglang", endpoint=srv.url, resume=False)
    quiet = GRPOTrainer(GRPOConfig(**base, output_dir=str(tmp_path / "a")), progress=False, log=lambda *_: None,
                        push_updates=False)
    quiet.setup()
    assert quiet.syncer is not None and quiet.agent.policy.lora is None
    assert not srv.bodies  # nothing pushed
    cfg = GRPOConfig(**base, output_dir=str(tmp_path / "b"), sync={"via": "lora", "lora_name": "mine"},
                     lora={"enabled": True, "r": 4, "alpha": 8})
    tr = GRPOTrainer(cfg, progress=False, log=lambda *_: None)
    tr.setup()
    assert tr.syncer.adapter_name == tr.agent.policy.lora == "mine"
    assert _posted(srv) == ["/unload_lora_adapter", "/load_lora_adapter", "/update_weight_version"]  # its version too
    assert srv.bodies[-2]["lora_name"] == "mine" and Path(srv.bodies[-2]["lora_path"]).name == ".served-mine"
    assert OnlineLearner(cfg, tmp_path / "store", progress=False).trainer.push_updates is False


def test_the_old_names_work_until_their_release(json_server, tmp_path):
    """``load`` (now ``serve``) and ``GRPOTrainer.auto_sync`` (now the ``push_updates`` argument) keep working,
    with a DeprecationWarning naming the release they go in."""
    from paravt_agent.compat import REMOVED_IN
    from paravt_train.rl.trainer import GRPOTrainer
    from paravt_train.sync import SGLangLoraSync, SGLangWeightSync

    srv = json_server(lambda path, body: (200, {"success": True}))
    with pytest.warns(DeprecationWarning, match=f"SGLangWeightSync.load is serve now.*{REMOVED_IN}"):
        SGLangWeightSync(srv.url).load(tmp_path, version="2")
    assert _posted(srv) == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    assert srv.bodies[1]["weight_version"] == "2"
    with pytest.warns(DeprecationWarning, match="SGLangLoraSync.load is serve now"):
        SGLangLoraSync(srv.url, name="mine").load(_adapter(tmp_path / "a", "m"))
    assert srv.bodies[-1]["lora_name"] == "mine"
    tr = GRPOTrainer(GRPOConfig(model="m"))
    with pytest.warns(DeprecationWarning, match=f"push_updates.*{REMOVED_IN}"):
        tr.auto_sync = False
    assert tr.push_updates is False


def test_a_lora_run_on_a_server_is_refused_a_full_weight_sync():
    """A LoRA run pushing to SGLang through disk/tensor/distributed would send the peft model's adapter parameters
    as if they were the model's: refused when the config is made, naming the sync to use."""
    from paravt_train.rl.config import GRPOConfig

    for sync in ("disk", "tensor", "distributed"):
        with pytest.raises(ValueError, match="a LoRA run pushes adapters.*set sync.via lora"):
            GRPOConfig(model="m", backend="sglang", endpoint="http://127.0.0.1:9", sync={"via": sync},
                       lora={"enabled": True})
    GRPOConfig(model="m", backend="sglang", endpoint="http://127.0.0.1:9", sync={"via": "lora"}, lora={"enabled": True})
    GRPOConfig(model="m", sync={"via": "disk"}, lora={"enabled": True})  # in-process rollouts push nothing
