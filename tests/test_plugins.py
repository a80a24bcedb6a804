"""The four extension points, used through their entry points as a third-party package would register them
(examples/plugins): a tool, a policy backend, a reward term, a benchmark loader. Each is one module."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plugins"


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The example package on sys.path with its entry points, as `pip install` would leave it."""
    import re

    shutil.copytree(EXAMPLE / "paravt_plugins_example", tmp_path / "paravt_plugins_example")
    dist = tmp_path / "paravt_plugins_example-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: paravt-plugins-example\nVersion: 0.1.0\n")
    groups = re.findall(r'\[project\.entry-points\."([\w.]+)"\]\n((?:\w+ = "[\w.:]+"\n)+)',
                        (EXAMPLE / "pyproject.toml").read_text())
    (dist / "entry_points.txt").write_text("".join(f"[{g}]\n{body.replace(chr(34), '')}\n" for g, body in groups))
    monkeypatch.syspath_prepend(str(tmp_path))
    # each test imports its own copy (a passing test's tmp_path is removed, and with it an earlier copy)
    for name in [m for m in sys.modules if m.split(".")[0] == "paravt_plugins_example"]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path
    for name in [m for m in sys.modules if m.split(".")[0] == "paravt_plugins_example"]:
        del sys.modules[name]


def test_a_tool_plugin(installed, media):
    from paravt_agent.agent import Agent
    from paravt_agent.config import AgentConfig
    from paravt_agent.policy.scripted import ScriptedPolicy
    from tools import ToolRegistry

    assert "brightness" in ToolRegistry.default()

    def script(role, msgs):
        if "<tool_response>" in str(msgs[-1]["content"]):
            return "<think>seen</think><answer>done</answer>"
        return '<think>look</think><tool_call>{"name": "brightness", "arguments": {"time": 3}}</tool_call>'

    agent = Agent(policy=ScriptedPolicy(script), config=AgentConfig(tools=["crop_video", "brightness"]))
    ans = agent.answer(media["video"], "How bright?")
    assert ans.trace.turns[0].calls[0].summary.startswith("brightness ")
    # a moment outside the video is an invalid call, not a clamped frame
    late = Agent(policy=ScriptedPolicy(lambda role, msgs: script(role, msgs).replace('"time": 3', '"time": 9999')),
                 config=AgentConfig(tools=["crop_video", "brightness"])).answer(media["video"], "How bright?")
    assert "outside the video" in (late.trace.turns[0].calls[0].error or "")


def test_a_policy_plugin(installed, media):
    from paravt_agent.agent import Agent
    from paravt_agent.policy import available_policies

    assert "echo" in available_policies()
    ans = Agent(backend="echo", model="anything").answer(media["video"], "Which?", ["red", "blue"])
    assert ans.choice == "A"


def test_a_reward_term_plugin(installed):
    from paravt_train.rewards import RewardConfig, score

    text = "<think>\nshort and clear</think><answer>A</answer>"
    plain = score(text, "A", "mcq", ["x", "y"], RewardConfig())
    weighted = score(text, "A", "mcq", ["x", "y"], RewardConfig(extra_terms={"brevity": 0.5}))
    assert weighted.extra == {"brevity": pytest.approx(0.95)}
    assert weighted.total == pytest.approx(plain.total + 0.5 * 0.95)
    assert "brevity" in weighted.terms()


def test_a_benchmark_plugin(installed, media, tmp_path):
    from paravt_train.benchmarks import available_benchmarks, load_benchmark

    root = tmp_path / "bench"
    root.mkdir()
    shutil.copy(media["video"], root / "v.mp4")
    (root / "questions.jsonl").write_text(json.dumps({"video": "v.mp4", "question": "Which colour first?",
                                                      "options": ["red", "blue"], "answer": "A"}) + "\n")
    assert "jsonl" in available_benchmarks()
    [item] = load_benchmark("jsonl", root)
    assert item.options == ["A. red", "B. blue"] and item.task == "mcq"
    out = subprocess.run([sys.executable, "-m", "paravt_agent.cli", "tools"], capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(installed)}, check=True).stdout
    assert "brightness" in out


def test_the_default_tools_come_through_the_toolsets_entry_point_installed_or_not(monkeypatch):
    """The agent reaches its default tool set as plugins are reached (the ``paravt.toolsets`` entry point ``default``,
    never an import of ``tools``); run from the source tree without being installed (the GPU runner puts the tree
    on PYTHONPATH: no metadata), the entry point is read from the tree's own pyproject.toml and the agent still has
    every built-in."""
    import paravt_agent.plugins as plugins
    from paravt_agent.agent import Agent
    from paravt_agent.errors import ConfigError
    from paravt_agent.policy.scripted import ScriptedPolicy
    from tools.registry import ToolRegistry, registry_of

    installed = Agent(policy=ScriptedPolicy(lambda role, m: "<answer>A</answer>")).registry.names()
    monkeypatch.setattr(plugins, "entry_points", lambda group: [])  # no package metadata at all
    plugins.toolset.cache_clear()
    try:
        assert plugins.toolset() is registry_of
        agent = Agent(policy=ScriptedPolicy(lambda role, m: "<answer>A</answer>"))
        assert agent.registry.names() == installed == ToolRegistry.default().subset(agent.config.tools).names()
        monkeypatch.setattr(plugins, "_source_entry_points", lambda group: {})  # nor a source tree: said, not empty
        plugins.toolset.cache_clear()
        with pytest.raises(ConfigError, match="paravt.toolsets"):
            plugins.toolset()
    finally:
        plugins.toolset.cache_clear()
