"""The method table (paravt_train/methods.py): one name gives a run its training settings, its agent protocol and its
trainer; both configs load together for every method, a run's saved configs reproduce it, one merge applies every
preset and method, and 0.4's keys still load with a warning naming the new key."""

from __future__ import annotations

import warnings

import pytest
import yaml

from paravt_agent.config import AgentConfig
from paravt_agent.errors import ConfigError
from paravt_agent.protocol.presets import PRESETS
from paravt_train.methods import METHODS, agent_config_for
from paravt_train.rewards import RewardConfig
from paravt_train.rl import trainer_class
from paravt_train.rl.config import GRPOConfig


def _get(obj, dotted: str):
    for key in dotted.split("."):
        obj = getattr(obj, key)
    return obj


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in data.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _future_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("name", list(METHODS))
def test_each_methods_agent_and_training_settings_load_together(name, tmp_path):
    """A model without an agent file: the method's protocol (or this project's), its agent settings over it, its
    training settings on the GRPO config, its trainer importable."""
    from paravt_train.rl.trainer import GRPOTrainer

    m = METHODS[name]
    cfg = GRPOConfig(model=str(tmp_path / "model"), method=name)
    assert cfg.method == name
    for key, value in _flat(m.training).items():
        assert _get(cfg, key) == value, key
    agent = agent_config_for(cfg)
    assert agent.preset == (m.protocol or "paravt") and (m.protocol is None or m.protocol in PRESETS)
    for key, value in _flat(m.agent).items():
        assert _get(agent, key) == value, key
    if m.protocol:  # the protocol's own settings, e.g. Weaver's dispatch mode and tools
        assert agent.mode == AgentConfig(preset=m.protocol).mode and agent.tools == AgentConfig(preset=m.protocol).tools
    assert trainer_class(name) is GRPOTrainer
    # the trainer's rollout agent is that protocol, sampled at the method's τ
    rollout = GRPOTrainer(cfg, progress=False).agent_config()
    assert rollout.preset == agent.preset and rollout.think_prefix == agent.think_prefix
    assert rollout.planner_sampling.temperature == cfg.temperature


@pytest.mark.parametrize("name", list(METHODS))
def test_a_runs_saved_config_reproduces_it(name, tmp_path):
    """What a run saves (the config its trackers get, the agent_config.yaml beside the trained model) loads back to
    the same run: the same GRPO config, and a run started from the trained model rolls out the same agent."""
    from paravt_train.rl.trainer import GRPOTrainer

    cfg = GRPOConfig(model=str(tmp_path / "start"), method=name, steps=3, reward={"gamma": 0.1})
    saved = yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert GRPOConfig.model_validate(saved) == cfg
    trainer = GRPOTrainer(cfg, progress=False)
    agent = trainer.eval_agent_config().model_copy(update={"frames": trainer.base_agent_config().frames})
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "agent_config.yaml").write_text(agent.to_yaml())  # what save_model writes
    assert AgentConfig.for_model(trained) == agent
    again = GRPOTrainer(cfg.model_copy(update={"model": str(trained)}), progress=False)
    assert again.agent_config() == trainer.agent_config()


def test_the_protocol_follows_the_method_unless_given(tmp_path):
    """A method with a protocol brings it (Weaver's, over a model trained on this project's layout); an agent YAML
    or ``agent.preset`` given wins; a method without one keeps the model's own."""
    own = tmp_path / "model"
    own.mkdir()
    (own / "agent_config.yaml").write_text(AgentConfig(preset="paravt-rl").to_yaml())
    assert agent_config_for(GRPOConfig(model=str(own), method="weaver")).preset == "weaver"
    para = agent_config_for(GRPOConfig(model=str(own)))
    assert para.preset == "paravt-rl" and para.layout.tool_response == "per_call" and para.think_prefix == "<think>\n"
    van = agent_config_for(GRPOConfig(model=str(own), method="vanilla-grpo", agent={"preset": "longvt"}))
    assert (van.preset, van.layout.tool_response, van.think_prefix) == ("longvt", "blocks", "")
    given = tmp_path / "agent.yaml"
    given.write_text("preset: paravt-eval\nmax_turns: 2\n")
    weaver = agent_config_for(GRPOConfig(model=str(own), method="weaver", agent_config=str(given)))
    assert (weaver.preset, weaver.max_turns) == ("paravt-eval", 2)
    with pytest.raises(ConfigError, match="does not exist"):
        agent_config_for(GRPOConfig(model=str(own), agent_config=str(tmp_path / "missing.yaml")))


def test_one_merge_for_every_preset_and_method():
    """Nested settings given explicitly keep the rest of the preset's or method's section, however they are given
    (a dict or a model: 0.4's GRPO merge dropped the whole of a preset's reward for a RewardConfig)."""
    agent = AgentConfig(preset="weaver", frames={"n_frames": 8})
    assert (agent.frames.n_frames, agent.frames.max_frames, agent.frames.crop_max_frames) == (8, 128, 32)
    for reward in ({"lambda_fmt": 1.0}, RewardConfig(lambda_fmt=1.0)):
        r = GRPOConfig(model="m", method="weaver", reward=reward).reward
        assert (r.lambda_fmt, r.acc_weight, r.tool_reward, r.reward_bias) == (1.0, 0.7, "success", 0.0)


def test_bad_methods_and_agent_settings_are_refused_when_loaded(tmp_path):
    with pytest.raises(ValueError, match="method"):
        GRPOConfig(model="m", method="grpo-9000")
    with pytest.raises(ValueError, match="agent"):
        GRPOConfig(model="m", agent={"no_such_setting": 1})
    with pytest.raises(ValueError, match="unknown preset"):
        GRPOConfig(model="m", agent={"preset": "paravt-9000"})


def test_old_keys_load_with_a_warning_naming_the_new_key(tmp_path):
    """0.4's GRPO YAML (`preset`, `think_prefix`, the `custom` preset) loads as the new keys say, until REMOVED_IN."""
    from paravt_agent.compat import REMOVED_IN

    old = tmp_path / "old.yaml"
    old.write_text('model: m\npreset: weaver\nthink_prefix: "<think>\\n"\nreward: {lambda_fmt: 0.5}\n')
    new = tmp_path / "new.yaml"
    new.write_text('model: m\nmethod: weaver\nagent: {think_prefix: "<think>\\n"}\nreward: {lambda_fmt: 0.5}\n')
    cfg, said = _future_warnings(lambda: GRPOConfig.from_yaml(old))
    assert cfg == GRPOConfig.from_yaml(new) and agent_config_for(cfg).think_prefix == "<think>\n"
    assert any("`preset` is renamed `method`" in s and REMOVED_IN in s for s in said)
    assert any("`think_prefix` is renamed `agent.think_prefix`" in s for s in said)
    # an override in either name wins over the file's key in the other
    assert _future_warnings(lambda: GRPOConfig.from_yaml(old, ["method=dapo"]))[0].method == "dapo"
    assert _future_warnings(lambda: GRPOConfig.from_yaml(new, ["preset=dapo"]))[0].method == "dapo"
    custom, said = _future_warnings(lambda: GRPOConfig(model="m", preset="custom"))
    assert custom == GRPOConfig(model="m", method="para-grpo") and any("`custom`" in s for s in said)
    # the new keys load without a warning
    assert _future_warnings(lambda: GRPOConfig.from_yaml(new))[1] == []
