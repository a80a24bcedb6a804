"""Every trainer runs on the toy world from a shipped config, as a new user runs it from a fresh clone: `paravt-train
toy-data` writes data/toy, then `python -m paravt_train.cli sft|grpo|online --config examples/configs/toy_*.yaml`
(the module, not the installed command: a machine without entry points runs it too), verbatim, from a folder laid
out as the repository (its checkpoints/ and examples/). Each config is a smoke run of two updates at most."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from paravt_train.methods import METHODS

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
#: each method of the method table, and the config that trains it on the toy
GRPO = {"para-grpo": "toy_grpo_para.yaml", "vanilla-grpo": "toy_grpo_vanilla.yaml", "dapo": "toy_grpo_dapo.yaml",
        "weaver": "toy_grpo_weaver.yaml", "videochat-m1": "toy_grpo_videochat_m1.yaml"}


def cli(clone: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "paravt_train.cli", *args], cwd=clone, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A folder laid out as the repository (its checkpoints/ and examples/), with `paravt-train toy-data` run in it
    exactly as the configs' comments say."""
    d = tmp_path_factory.mktemp("clone")
    for name in ("checkpoints", "examples"):
        (d / name).symlink_to(ROOT / name)
    out = cli(d, "toy-data").stdout
    assert "wrote data/toy" in out and (d / "data" / "toy" / "feedback.db").is_file()
    return d


def test_every_trainer_and_method_has_a_toy_config():
    assert set(GRPO) == set(METHODS)  # a new method gets its toy config
    for method, name in GRPO.items():
        cfg = yaml.safe_load((CONFIGS / name).read_text())
        assert cfg["method"] == method and cfg["data"] == "data/toy/rl_train.parquet"
        assert (ROOT / cfg["model"] / "config.json").is_file()  # the shipped toy policies
    assert (CONFIGS / "toy_sft.yaml").is_file() and (CONFIGS / "toy_online.yaml").is_file()


def test_the_toy_agent_configs_are_the_toy_methods_protocols():
    """The shipped agent YAMLs of Weaver and VideoChat-M1 are exactly what the toy's code trains them with."""
    from paravt_agent.config import AgentConfig
    from paravt_train.toy.methods import toy_method_config

    for name, method in (("toy_agent_weaver.yaml", "weaver"), ("toy_agent_collab.yaml", "collab")):
        assert AgentConfig.from_yaml(CONFIGS / name) == toy_method_config(method), name


def test_toy_data_is_what_the_configs_read(clone):
    from paravt_agent.store import TrajectoryStore
    from paravt_train.data import validate_file

    toy = clone / "data" / "toy"
    for file, kind in (("sft.parquet", "sft"), ("rl_train.parquet", "rl"), ("rl_heldout.parquet", "rl")):
        ok, bad = validate_file(toy / file, "auto", toy / "videos")
        assert ok and bad == [], (file, bad[:3])
        assert cli(clone, "validate-data", f"data/toy/{file}", "--video-root", "data/toy/videos").stdout.strip(
            ).endswith(f"0 invalid {kind.upper()} rows in data/toy/{file}")
    rows = TrajectoryStore(toy / "feedback.db").feedback_since(0)
    assert len(rows) == 32 and all(r["answer"] for r in rows) and len({r["user_id"] for r in rows}) == 3


@pytest.mark.slow
def test_sft_from_its_toy_config(clone):
    out = cli(clone, "sft", "--config", "examples/configs/toy_sft.yaml").stdout
    assert "trained 2 steps" in out and (clone / "runs" / "toy_sft" / "final" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("method", list(GRPO))
def test_grpo_from_its_toy_config(clone, method):
    cfg = yaml.safe_load((CONFIGS / GRPO[method]).read_text())
    out = cli(clone, "grpo", "--config", f"examples/configs/{GRPO[method]}").stdout
    run = clone / cfg["output_dir"]
    assert out.startswith("done: reward") and (run / "final" / "config.json").is_file()
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1] and len(steps[0]["prompts"]) >= 2


@pytest.mark.slow
def test_online_from_its_toy_config(clone):
    out = cli(clone, "online", "--store", "data/toy/feedback.db", "--config", "examples/configs/toy_online.yaml",
              "--once", "--max-steps", "1").stdout
    assert "1 updates" in out and (clone / "runs" / "toy_online" / "online_state.json").is_file()
