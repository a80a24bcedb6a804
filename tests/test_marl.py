"""Multi-agent RL for the collaborative mode (VideoChat-M1): each agent scored on its own (R_res + R_format + R_col +
R_tool), its turns trained with its own advantage, one shared policy through ``paravt-train grpo`` and several
policies each with its own trainer and weights."""

import dataclasses
import itertools
import json
import shutil

import pytest
import torch

from paravt_agent.agent import Agent
from paravt_agent.config import AgentConfig
from paravt_agent.policy.base import text_of
from paravt_agent.policy.scripted import ScriptedPolicy
from paravt_train.data.records import PromptItem
from paravt_train.rewards import RewardConfig
from paravt_train.rl.objective import episode_advantages
from paravt_train.rl.rollout import PromptCache, RolloutSettings, run_group


def crop(a, b):
    return f'<tool_call>{json.dumps({"name": "crop_video", "arguments": {"start_time": a, "end_time": b}})}</tool_call>'


def script(role, msgs):
    """The scout answers right; the checker writes a decision that is neither continue() nor add tool, and a wrong
    answer; without a consensus the synthesizer answers with the scout."""
    if role == "subagent":
        return "red at 17"
    if role == "planner":
        return "<think>\nthe scout saw red</think><answer>[17, 20]</answer>"
    name = role.split(":")[1]
    system = text_of(msgs[0]["content"])
    if "strategic planning" in system:
        return "<think>\nhm</think>maybe" if name == "checker" else "<think>\nok</think>continue()"
    if "plan is done" in system:
        return "<answer>[17, 20]</answer>" if name == "scout" else "<answer>[30, 35]</answer>"
    return f"<think>\nlook</think>{crop(10, 20)}"


def test_each_agent_is_scored_on_its_own_answer_format_and_collaboration(red_video):
    cfg = AgentConfig(mode="collaborative", collab={"agents": [{"name": "scout"}, {"name": "checker"}]})
    agent = Agent(policy=ScriptedPolicy(script), config=cfg)
    prompt = PromptItem(id="q", video=red_video, question="When is the screen red?", options=None, answer=[17, 20],
                        task="tvg")
    settings = RolloutSettings(group=2, reward=RewardConfig(reward_bias=0.0), seed=0)
    eps = agent.run(run_group(agent, PromptCache(agent), prompt, settings, eos_id=0))
    assert [e.agent for e in eps] == ["scout", "checker", "synthesizer"] * 2
    assert len({e.id for e in eps}) == 6 and all(e.failed is None for e in eps)
    scout, checker, team = eps[:3]
    assert team.reward.acc == pytest.approx(1.0)  # the synthesizer's answer (no consensus: 2 agents disagree)
    assert scout.reward.acc == pytest.approx(1.0) and checker.reward.acc == 0.0  # R_res: each agent's own answer
    assert scout.reward.fmt == 1.0 and checker.reward.fmt == pytest.approx(2 / 3)  # one of 3 replies broke protocol
    assert scout.reward.extra["col"] == pytest.approx(1.0) and checker.reward.extra["col"] == 0.0
    assert scout.reward.tool == pytest.approx(0.1) and checker.reward.tool == pytest.approx(0.1)  # its tools worked
    assert scout.reward.total == pytest.approx(1 + 1 + 1 + 0.1)
    assert "continue()" in scout.text and "maybe" in checker.text  # each judged on its own replies


def test_each_agents_turns_get_its_own_advantage():
    class E:
        def __init__(self, agent, r):
            self.agent, self.failed, self.advantage = agent, None, 0.0
            self.reward = type("R", (), {"total": r})()

    group = [E("scout", 3.0), E("checker", 0.0), E("scout", 1.0), E("checker", 0.5), E("scout", 2.0),
             E("checker", 0.5)]
    trained = episode_advantages(group)
    adv = {a: [e.advantage for e in trained if e.agent == a] for a in ("scout", "checker")}
    assert adv["scout"] == pytest.approx([1.2247, -1.2247, 0.0], abs=1e-3)  # over the scout's rewards alone
    assert adv["checker"] == pytest.approx([-1.4142, 0.7071, 0.7071], abs=1e-3)
    alike = [E("scout", 1.0), E("scout", 1.0), E("checker", 0.0), E("checker", 1.0)]
    assert [e.advantage for e in episode_advantages(alike) if e.agent == "scout"] == [0.0, 0.0]


class TokenScript(ScriptedPolicy):
    """The scripted policy with token ids and logprobs (what RL assembles into sequences)."""

    async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
        g = await super().generate(messages, sampling, prefix, continuation, role)
        ids = [10 + ord(c) % 50 for c in g.text[:6]] or [10]
        return dataclasses.replace(g, prompt_ids=[1, 2, 3], prefix_ids=[], output_ids=ids, logprobs=[-0.5] * len(ids))


def test_the_team_is_credited_by_what_it_decided(red_video):
    """VideoChat-M1's team call: with a consensus the vote is the answer and the reason summary is not trained; without
    one the synthesizer's answer is the team's, and its advantage is taken over the synthesizer episodes alone (never
    mixed with the summaries' rewards, which come from the easier, agreeing rollouts)."""
    answers, synth = itertools.count(), itertools.count()

    def team_script(role, msgs):
        system = text_of(msgs[0]["content"])
        if role == "planner":
            if "agreed on the final answer" in system:  # the reason summary over the consensus
                return "the scout and the checker both saw red"
            right = next(synth) == 0  # the first synthesizer answers right, the second wrong
            return f"<think>\nfrom memory</think><answer>{'[17, 20]' if right else '[30, 35]'}</answer>"
        if role == "subagent":
            return "red at 17"
        name = role.split(":")[1]
        if "strategic planning" in system:
            return "<think>\nok</think>continue()"
        if "plan is done" in system:  # the checker agrees with the scout in the first two rollouts only
            return "<answer>[17, 20]</answer>" if name == "scout" or next(answers) < 2 else "<answer>[30, 35]</answer>"
        return f"<think>\nlook</think>{crop(10, 20)}"

    cfg = AgentConfig(mode="collaborative", collab={"agents": [{"name": "scout"}, {"name": "checker"}]})
    agent = Agent(policy=TokenScript(team_script), config=cfg)
    prompt = PromptItem(id="q", video=red_video, question="When is the screen red?", options=None, answer=[17, 20],
                        task="tvg")
    settings = RolloutSettings(group=4, reward=RewardConfig(reward_bias=0.0), seed=0)
    eps = agent.run(run_group(agent, PromptCache(agent), prompt, settings, eos_id=0))
    team = {role: [e for e in eps if e.agent == role] for role in ("summary", "synthesizer")}
    assert len(team["summary"]) == 2 and len(team["synthesizer"]) == 2 and len(eps) == 12
    for e in team["summary"]:  # the summary was generated (a planner record with tokens) but is not trained
        assert e.answer.trace.turns[-1].consensus == ["scout", "checker"] and e.reward.acc == pytest.approx(1.0)
        assert any(r.role == "planner" and r.generation.output_ids for r in e.answer.records)
        assert e.sequences == []
    for e in team["synthesizer"]:
        assert [s.role for s in e.sequences] == ["planner"] and e.answer.trace.turns[-1].consensus == []
    assert sorted(e.reward.acc for e in team["synthesizer"]) == [0.0, 1.0]
    trained = episode_advantages(eps)
    synth_adv = sorted(e.advantage for e in trained if e.agent == "synthesizer")
    assert synth_adv == pytest.approx([-1.0, 1.0], abs=1e-4)  # over the two synthesizers alone
    assert all(e.advantage == 0.0 for e in trained if e.agent == "summary")  # alike (both right), and nothing trains


def test_the_videochat_m1_method_trains_with_agent_dropout(tmp_path):
    """The method turns agent dropout on in its rollouts (the supplement trains with it; the rate is ours), and a
    run's own agent settings turn it off."""
    from paravt_agent.graph.collab.cpp import dropped_agents
    from paravt_train.methods import VIDEOCHAT_M1_DROPOUT
    from paravt_train.rl.config import GRPOConfig
    from paravt_train.rl.trainer import GRPOTrainer

    cfg = GRPOConfig(model=str(tmp_path / "m"), method="videochat-m1")
    rollout = GRPOTrainer(cfg).agent_config()
    assert rollout.collab.dropout == VIDEOCHAT_M1_DROPOUT == 0.25 and rollout.collab.agent_sampling.temperature == 1
    dropped = [dropped_agents({"seed": seed}, rollout.collab) for seed in range(200)]
    share = sum(len(d) for d in dropped) / (200 * len(rollout.collab.agents))
    assert 0.18 < share < 0.32  # each of the four agents dropped about a quarter of the episodes
    assert not any(dropped_agents({"seed": s}, GRPOTrainer(cfg).eval_agent_config().collab) for s in range(50))
    off = GRPOConfig(model=str(tmp_path / "m"), method="videochat-m1", agent={"collab": {"dropout": 0.0}})
    assert GRPOTrainer(off).agent_config().collab.dropout == 0.0
    assert GRPOTrainer(GRPOConfig(model=str(tmp_path / "m"), method="weaver")).agent_config().collab.dropout == 0.0


@pytest.fixture(scope="module")
def modes_dir():
    """The toy policy that learned every mode (checkpoints/toy-modes): as a collaborating agent it plans, decides
    and answers, so sampled rollouts differ in reward and every agent's advantage is non-zero somewhere."""
    from paravt_train.toy.quickstart import REPO_CHECKPOINT

    path = REPO_CHECKPOINT.parent / "toy-modes"
    assert (path / "config.json").is_file(), "checkpoints/toy-modes is shipped with the repository"
    return str(path)


def collab_yaml(tmp_path, base, **collab):
    """The toy's collaborative protocol (two agents, the cpp protocol), colour-at-t questions on 8 frames."""
    from paravt_train.toy.methods import toy_method_config

    path = tmp_path / "collab.yaml"
    cfg = toy_method_config("collab").override(["frames.n_frames=8", *(f"collab.{k}={v}" for k, v in collab.items())])
    path.write_text(cfg.to_yaml())
    return str(path)


def grpo_config(tmp_path, model, data, root, out, agent_yaml, **kw):
    from paravt_train.rl.config import GRPOConfig

    return GRPOConfig(model=model, data=data, video_root=root, output_dir=str(out), agent_config=agent_yaml, steps=1,
                      prompts_per_step=1, group_size=2, max_new_tokens=48, subagent_max_new_tokens=16,
                      temperature=1.5, lr=1e-3, save_every=5, concurrency=1, gating=False, seed=0, **kw)


def test_a_marl_step_trains_each_agent_with_its_own_advantage(modes_dir, toy_rl, tmp_path):
    """One shared policy through the GRPO trainer (the videochat-m1 preset, agent dropout on): every rollout is
    split per agent, each agent normalised over the group apart, and one update trains every agent's turns on
    exactly the tokens it sampled."""
    from paravt_train.rl.trainer import GRPOTrainer

    agent_yaml = collab_yaml(tmp_path, modes_dir, dropout=0.5)
    cfg = grpo_config(tmp_path, modes_dir, toy_rl["data"], toy_rl["video_root"], tmp_path / "run", agent_yaml,
                      method="videochat-m1")
    assert (cfg.kl_coef, cfg.reward.reward_bias) == (1e-5, 0.0)
    tr = GRPOTrainer(cfg.model_copy(update={"temperature": 1.5}), progress=False)
    tr.setup()
    before = [p.detach().clone() for p in tr.model.parameters()]
    prompts = tr.prompts_for(0, __import__("paravt_train.data", fromlist=["x"]).prompts_from_rl(
        cfg.data, cfg.video_root))
    groups = tr.rollout(prompts)
    (group,) = groups
    assert {e.agent for e in group} - {"checker", "scout"} <= {"summary", "synthesizer"} and len(group) == 6
    trained = tr.advantages(group)
    for who in ("scout", "checker"):
        mine = [e for e in trained if e.agent == who]
        assert abs(sum(e.advantage for e in mine)) < 1e-6  # normalised over its own two rollouts
        assert all(s.role == f"agent:{who}" or s.index == ("scout", "checker").index(who) for e in mine
                   for s in e.sequences)
        assert all(s.episode.endswith(f".{who}") for e in mine for s in e.sequences)
    assert any(e.advantage for e in trained if e.agent in ("scout", "checker"))  # the agents' rewards differed
    rec = tr.learn(groups, groups, prompts, {})
    assert rec["failed_episodes"] == 0 and rec["episodes"] == 6 and rec["logprob_mismatch"] < 1e-3
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters(), strict=True))


def test_several_policies_each_train_their_own_agents(modes_dir, toy_rl, tmp_path):
    """VideoChat-M1's team of different models: the scout on policy A, the checker on policy B, each policy its own
    trainer and weights; one step updates each on its own agents' turns (the checker's turns are not A's tokens:
    they train B only)."""
    from safetensors.torch import load_file, save_file

    from paravt_train.rl.marl import MultiPolicyTrainer

    b_dir = tmp_path / "policy_b"  # another policy: the same one with its logits 1.2x sharper (its own logprobs)
    shutil.copytree(modes_dir, b_dir)
    weights = load_file(b_dir / "model.safetensors")
    weights["model.language_model.norm.weight"] = weights["model.language_model.norm.weight"] * 1.2
    save_file(weights, b_dir / "model.safetensors", metadata={"format": "pt"})
    agent_yaml = collab_yaml(tmp_path, modes_dir, dropout=0.5)
    cfgs = {name: grpo_config(tmp_path, model, toy_rl["data"], toy_rl["video_root"], tmp_path / name, agent_yaml,
                              method="videochat-m1")
            for name, model in (("a", modes_dir), ("b", str(b_dir)))}
    cfgs = {k: c.model_copy(update={"temperature": 1.5, "group_size": 4}) for k, c in cfgs.items()}
    marl = MultiPolicyTrainer(cfgs, {"scout": "a", "checker": "b"})
    marl.setup()
    start = {k: [p.detach().clone() for p in tr.model.parameters()] for k, tr in marl.trainers.items()}
    from paravt_train.data import prompts_from_rl

    prompts = marl.trainers["a"].prompts_for(0, prompts_from_rl(cfgs["a"].data, cfgs["a"].video_root))
    groups = marl.rollout(prompts)
    checker_records = [r for e in groups[0] if e.agent in ("summary", "synthesizer") for r in e.answer.records
                       if r.role == "agent:checker"]
    assert checker_records and not any(r.trainable for r in checker_records)  # another model's calls, for A
    assert all(s.role != "agent:checker" for e in groups[0] if e.agent != "checker" for s in e.sequences)
    stats = {name: tr.learn([[e for e in g if e.agent in marl.agents_of(name)] for g in groups],
                            [[e for e in g if e.agent in marl.agents_of(name)] for g in groups], prompts, {})
             for name, tr in marl.trainers.items()}
    assert stats["a"]["episodes"] == 8 and stats["b"]["episodes"] == 4  # A: scout + team; B: the checker
    # the checker's tokens were sampled by B's live policy: B's trainer recomputes their logprobs exactly (A's
    # sharper twin would not), and A's trainer never saw them
    assert stats["b"]["sequences"] > 0 and stats["b"]["logprob_mismatch"] < 1e-3
    assert stats["a"]["logprob_mismatch"] < 1e-3
    for k in start:  # each policy took its own step (its agents' rewards differed across the group)
        assert any(e.advantage for g in groups for e in g if e.agent in marl.agents_of(k)), k
        assert any(not torch.equal(a, b) for a, b in zip(start[k], marl.trainers[k].model.parameters(), strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(marl.trainers["a"].model.parameters(),
                                                     marl.trainers["b"].model.parameters(), strict=True))
