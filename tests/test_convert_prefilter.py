import json
import os
import subprocess
import sys

import torch

from paravt_agent.agent import Agent
from paravt_agent.policy.base import text_of
from paravt_agent.policy.scripted import ScriptedPolicy
from paravt_agent.protocol import parse_tool_calls
from paravt_train.data import RLSample, load_rl, load_sft, write_parquet
from paravt_train.data.convert import ConversionStats, convert_sample
from paravt_train.data.prefilter import prefilter

SYSTEM = {"role": "system", "content": "You are a video understanding agent."}
USER = {"role": "user", "content": [{"type": "video", "video": "v.mp4"}, {"type": "text", "text": "What happens?"}]}


def call(a, b):
    return (f'<tool_call>{{"name": "crop_video", "arguments": {{"video_path": "v.mp4", "start_time": {a}, '
            f'"end_time": {b}}}}}</tool_call>')


def frames(a, b):
    return {"role": "user", "content": [{"type": "video", "video": "v.mp4", "start": a, "end": b}]}


def seq_trace():
    return [
        SYSTEM, USER,
        {"role": "assistant", "content": "<think>Check the start.</think>" + call(30, 50)},
        frames(30, 50),
        {"role": "assistant", "content": "<think>A man enters a kitchen. Now the end.</think>" + call(130, 145)},
        frames(130, 145),
        {"role": "assistant",
         "content": "<think>He leaves with a cup. Look closer at the exit.</think>" + call(138, 142)},
        frames(138, 142),
        {"role": "assistant", "content": "<think>At 02:20 he holds the cup.</think>" + call(60, 40)},
        frames(60, 40),
        {"role": "assistant", "content": "<think>Done.</think><answer>He takes a cup from the kitchen.</answer>"},
    ]


def test_merge_independent_keep_dependent():
    stats = ConversionStats()
    out = convert_sample(seq_trace(), stats)
    assistants = [m for m in out if m["role"] == "assistant"]
    per_turn = [len(parse_tool_calls(m["content"])) for m in assistants]
    assert per_turn == [2, 1, 0]  # 30-50 and 130-145 merge; the refinement 138-142 stays on its own turn
    responses = [m["content"] for m in out if m["role"] == "user" and isinstance(m["content"], str)
                 and m["content"].startswith("<tool_response>")]
    assert len(responses) == 2
    assert "[1] crop_video(00:30-00:50): A man enters a kitchen." in responses[0]
    assert "[2] crop_video(02:10-02:25): He leaves with a cup." in responses[0]
    assert "At 02:20 he holds the cup" in responses[1]
    assert out[-1]["content"].endswith("<answer>He takes a cup from the kitchen.</answer>")
    assert stats.dropped_calls["start >= end"] == 1
    assert (stats.calls_in, stats.turns_in, stats.calls_out, stats.turns_out) == (4, 4, 3, 2)
    assert "1.00 before, 1.50 after" in stats.report()


def test_drops_empty_answers_and_cli(tmp_path):
    empty = seq_trace()[:-1] + [{"role": "assistant", "content": "<think>hmm</think><answer> </answer>"}]
    rows = [{"id": "a", "messages": seq_trace()}, {"id": "b", "messages": empty}]
    write_parquet(rows, tmp_path / "seq.parquet")
    exe = os.path.join(os.path.dirname(sys.executable), "paravt-train")
    res = subprocess.run([exe, "convert", str(tmp_path / "seq.parquet"), str(tmp_path / "par.parquet")],
                         capture_output=True, text=True, check=True)
    assert "dropped sample (empty answer): 1" in res.stdout and "samples: 2 in, 1 out" in res.stdout
    [s] = load_sft(tmp_path / "par.parquet", check_videos=False)
    assert s.id == "a" and len(s.messages) == 7


def rl_rows(video):
    user = {"role": "user", "content": [{"type": "video", "video": video}, {"type": "text", "text": "What happens?"}]}
    base = {"prompt": json.dumps([SYSTEM, user]), "videos": [video]}
    return [
        {**base, "id": "ok", "answer": "A", "question_type": "mcq", "options": ["red", "blue"], "question": "Colour?"},
        {**base, "id": "never", "answer": "B", "question_type": "mcq", "options": ["red", "blue"],
         "question": "Colour?"},
        {**base, "id": "long", "answer": " ".join(["word"] * 16), "question_type": "oe"},
        {**base, "id": "short", "answer": "a man with a cup", "question_type": "oe", "question": "Who?"},
    ]


def test_prefilter_rules(media, tmp_path):
    write_parquet(rl_rows(media["video"]), tmp_path / "rl.parquet")
    samples = load_rl(tmp_path / "rl.parquet")
    kept, dropped = prefilter(samples)
    assert [s.id for s in kept] == ["ok", "never", "short"] and sum(dropped.values()) == 1
    # rollouts through the agent: a group that varies trains, a group that scores alike does not (the multiple-
    # choice prompts are answered A, B, A, ...; the open one always alike)
    import itertools

    from paravt_agent.policy.base import text_of

    flip = itertools.count()

    def script(role, msgs):
        if "Options:" in text_of(msgs[1]["content"]):
            return "<think>looks</think><answer>" + "AB"[next(flip) % 2] + "</answer>"
        return "<think>looks</think><answer>a man with a cup</answer>"

    agent = Agent(policy=ScriptedPolicy(script))
    kept, dropped = prefilter(samples, agent, group=3, progress=False)
    assert [s.id for s in kept] == ["ok", "never"]
    assert dropped == {"all 3 rollouts scored alike (right)": 1, "open-ended answer over 15 words": 1}


def test_zero_variance_is_what_grpo_cannot_learn_from():
    """A hand-built group: G rewards all alike (whatever their value) give every advantage 0; one differing
    reward is a gradient."""
    from paravt_train.data.prefilter import zero_variance
    from paravt_train.rl.objective import group_advantages

    for rewards, alike in (([-0.2] * 8, True), ([1.25] * 8, True), ([1.25] * 7 + [1.2], False), ([0.0], False)):
        assert zero_variance(rewards) == alike
        if len(rewards) > 1:
            adv = group_advantages(torch.tensor(rewards), group=len(rewards))
            assert bool((adv.abs() < 1e-6).all()) == alike


def test_rl_validation(tmp_path):
    rows = [{"prompt": json.dumps([SYSTEM, USER]), "videos": [], "answer": "[5, 3]", "question_type": "tvg"},
            {"prompt": json.dumps([SYSTEM, USER]), "videos": [], "answer": "A", "question_type": "mcq"},
            {"prompt": json.dumps([SYSTEM, USER]), "videos": [], "answer": "[3, 5]", "question_type": "tvg"}]
    write_parquet(rows, tmp_path / "rl.parquet")
    from paravt_train.data import validate_file

    ok, bad = validate_file(tmp_path / "rl.parquet", "rl", check_videos=False)
    assert [r for r, _ in bad] == [0, 1] and "not a span" in bad[0][1] and "needs options" in bad[1][1]
    assert ok[0].answer_value == [3.0, 5.0]
    assert RLSample.model_validate({**rows[2], "answer": [3, 5]}).answer == "[3, 5]"


def test_prefilter_takes_the_runs_protocol_and_reward(media, tmp_path, json_server):
    """`paravt-train prefilter --config grpo.yaml` rolls out with the run's agent protocol and scores with its
    method's reward: the same rollouts (all right, half of them reasoning in <think>) differ under vanilla GRPO's
    format reward (the prompt trains) and are alike under Weaver's, which scores the answer tags alone (dropped)."""
    import itertools

    from typer.testing import CliRunner

    from paravt_train.cli import app

    flip = itertools.count()

    def reply(path, body):
        text = ("<think>\nthe screen shows red all along</think><answer>A</answer>" if next(flip) % 2 else
                "<answer>A</answer>")
        return 200, {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": text}}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    server = json_server(reply)
    write_parquet([rl_rows(media["video"])[0]], tmp_path / "rl.parquet")
    out, systems = {}, {}
    for method in ("vanilla-grpo", "weaver"):
        cfg = tmp_path / f"{method}.yaml"
        cfg.write_text(f"method: {method}\nmodel: m\ngroup_size: 4\n")
        before = len(server.bodies)
        res = CliRunner().invoke(app, ["prefilter", str(tmp_path / "rl.parquet"), str(tmp_path / f"{method}.parquet"),
                                       "--config", str(cfg), "--backend", "openai", "--endpoint", server.url + "/v1",
                                       "--set", "agent.think_prefix=''"])
        assert res.exit_code == 0, res.output
        bodies = server.bodies[before:]
        assert len(bodies) == 4  # G = 4 from the config
        systems[method] = {text_of(b["messages"][0]["content"]) for b in bodies}
        out[method] = res.output
    assert "kept 1 of 1" in out["vanilla-grpo"]
    assert "kept 0 of 1" in out["weaver"] and "all 4 rollouts scored alike (right)" in out["weaver"]
    assert systems["vanilla-grpo"] != systems["weaver"]  # each run's own protocol
    assert all("spatial_grounding" in s for s in systems["weaver"])  # Weaver's tools
    assert not any("spatial_grounding" in s for s in systems["vanilla-grpo"])
