"""Resilience (#35): a GRPO resume that passes over an unloadable newest checkpoint, and LangGraph Server's graph
refusing what the API refuses (an over-long question before any download or model call, a video URL that points
into the operator's network)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from test_rl import _cfg as _grpo_cfg  # the toy GRPO config of tests/test_rl.py


def test_grpo_resumes_from_the_checkpoint_before_an_unloadable_newest_one(toy_policy_dir, toy_rl, tmp_path):
    """#35: a truncated newest GRPO checkpoint is passed over with a warning for the one before it, and the step
    it held is redone exactly; every checkpoint unreadable is a clear error, never a silent restart from step 0."""
    from paravt_train.infra.checkpoint import CheckpointError
    from paravt_train.rl.trainer import GRPOTrainer

    out = tmp_path / "run"
    full = GRPOTrainer(_grpo_cfg(toy_policy_dir, toy_rl, out, steps=2, save_every=1), progress=False)
    full.run()
    w_full = {k: v.detach().clone() for k, v in full.model.state_dict().items()}
    rewards = [json.loads(x)["reward"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == 2 and (out / "checkpoint-1" / "trainer_state.json").is_file()
    shard = max((out / "checkpoint-2").glob("*.distcp"), key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a disk that lost half the newest

    logs: list[str] = []
    resumed = GRPOTrainer(_grpo_cfg(toy_policy_dir, toy_rl, out, steps=2, save_every=1), progress=False,
                          log=logs.append)
    resumed.run()
    text = "\n".join(logs)
    assert "checkpoint-2 cannot be loaded" in text and "resumed from checkpoint-1, not the newest" in text, text
    assert f"resumed from {out / 'checkpoint-1'} (step 1)" in text and resumed.step == 2
    for k, v in resumed.model.state_dict().items():  # step 2 redone from checkpoint-1: the uninterrupted weights
        torch.testing.assert_close(v, w_full[k], rtol=0, atol=1e-6)
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and [r["reward"] for r in logged] == rewards

    for c in out.glob("checkpoint-*"):
        (c / "extra.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no checkpoint under .* can be loaded"):
        GRPOTrainer(_grpo_cfg(toy_policy_dir, toy_rl, out, steps=3), progress=False, log=logs.append).setup()


@pytest.mark.parametrize("video_root", [False, True], ids=["urls-only", "with-video-root"])
def test_langgraph_server_graph_refuses_what_the_api_refuses(toy_policy_dir, toy_rl, json_server, tmp_path,
                                                             monkeypatch, video_root):
    """#35 on LangGraph Server's graph (server_graph.make_graph, run in-process through its overview node, as
    `langgraph dev` runs it): a 200,000-character question is refused before the video is downloaded or the model
    called, and a video URL on a loopback or private address is refused without a connection to it, with or
    without PARAVT_VIDEO_ROOT (the two ways server_graph resolves a video)."""
    import time

    from paravt_agent.errors import PromptTooLong, VideoError
    from paravt_agent.serving import server_graph

    for k in ("PARAVT_VIDEO_ROOT", "PARAVT_ALLOW_URL_PREFIXES", "PARAVT_ENDPOINT", "PARAVT_PRESET"):
        monkeypatch.delenv(k, raising=False)
    if video_root:
        monkeypatch.setenv("PARAVT_VIDEO_ROOT", toy_rl["video_root"])
    monkeypatch.setenv("PARAVT_MODEL", toy_policy_dir)
    monkeypatch.setenv("PARAVT_BACKEND", "local")
    monkeypatch.setenv("PARAVT_HOME", str(tmp_path / "home"))  # where a URL's download would land
    monkeypatch.setattr(server_graph, "_agents", {})
    site = json_server(lambda path, body: (200, {"not": "a video"}))  # a service on the operator's loopback
    calls: list = []

    async def no_model_call(*a, **kw):
        calls.append(a)
        raise AssertionError("the model was called")

    monkeypatch.setattr(server_graph._agent(None, None).policy, "generate", no_model_call)
    graph = server_graph.make_graph()

    def run(video: str, question: str) -> None:
        asyncio.run(graph.ainvoke({"video": video, "question": question}))

    url = site.url + "/x.mp4"
    with pytest.raises(VideoError, match="is a loopback address"):
        run(url, "Which colour?")
    with pytest.raises(VideoError, match="is a private address"):
        run("http://10.1.2.3/x.mp4", "Which colour?")
    assert site.paths == []
    # the operator opens the loopback service: the question's limit is still checked before the download
    monkeypatch.setenv("PARAVT_ALLOW_URL_PREFIXES", site.url + "/")
    hostile = ("\u202eevil\x00 " * 20_000)[:200_000]
    t0 = time.perf_counter()
    with pytest.raises(PromptTooLong, match="max_question_tokens"):
        run(url, hostile)
    assert time.perf_counter() - t0 < 5 and site.paths == [] and calls == []
    # the control: an ordinary question does reach the (opened) URL
    with pytest.raises(VideoError, match="not a video"):
        run(url, "Which colour?")
    assert site.paths == ["/x.mp4"] and calls == []
