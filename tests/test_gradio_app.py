"""The Gradio demo: its handler on real inputs, and the page in a real headless Chromium."""

import asyncio
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import engine_unavailable, free_port

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "checkpoints" / "toy"
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SEED = 3  # toy videos the demo generates are seeded, so the page shows the same video each run


def collect(gen):
    async def go():
        return [x async for x in gen]

    return asyncio.run(go())


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    import gradio_app

    return gradio_app.Demo(str(CHECKPOINT), store=str(tmp_path_factory.mktemp("store") / "traces.db"), seed=SEED)


def test_handler_streams_windows_and_stores_feedback(demo):
    video, question, options, info = demo.toy_video()
    assert question.startswith("When is the segment of colour") and options == ""
    truth = info.split("Ground truth: ")[1].split(".")[0]
    outs = collect(demo.ask(video, question, options, "embedded", "", "", 8, "parallel"))
    status, think, timeline, gallery, summaries, answer, stats, trace_id, windows, pending, lanes = outs[-1]
    assert status == "done." and answer and trace_id and not windows and not pending and not lanes
    # the scan: one window per 16 s of the video, in parallel, and the shipped policy finds the segment
    assert timeline.count('class="pvt-window') >= 4 and len(gallery) >= 4
    assert "<think>" in think and "tool calls" in stats and truth in answer
    assert len(outs) >= 4  # updates arrived while sub-agents finished, not only at the end
    assert demo.feedback(trace_id, truth, "up").startswith("Thanks")
    assert demo.store.feedback_since(0)[-1]["thumbs"] == 1


def test_approve_windows_pauses_and_runs_the_edited_windows(demo):
    """The page's "approve windows" toggle: the run stops after the planner with its windows in an editable box;
    "Run sub-agents" runs exactly the edited windows and the planner answers from them."""
    video, question, options, _ = demo.toy_video()
    outs = collect(demo.ask(video, question, options, "embedded", "", "", 8, "parallel", True))
    status, think, *_, answer, stats, trace_id, windows, pending, _ = outs[-1]
    planned = windows.splitlines()
    assert len(planned) >= 4 and all("-" in w for w in planned) and pending and not answer
    assert "windows planned" in status and "<tool_call>" in think
    outs = collect(demo.resume("0-15\n16-31", pending))
    status, _, timeline, _, summaries, answer, stats, trace_id, windows, pending, _ = outs[-1]
    assert status == "done." and answer and trace_id and not pending
    assert timeline.count('class="pvt-window') == 2 and summaries.count("**[") == 2
    assert "00:00-00:15" in summaries and "00:16-00:31" in summaries and "2 tool calls" in stats
    again = collect(demo.resume("0-15", "no-such-run"))[-1]
    assert again[0].startswith("**error:** no question is waiting")


def test_collaborative_mode_shows_one_lane_per_agent(demo, red_video):
    """The page in the collaborative mode (the rounds protocol): each agent's memory per round in its own lane, as
    the rounds finish."""
    from paravt_agent.agent import Agent
    from paravt_agent.config import AgentConfig
    from paravt_agent.policy.scripted import ScriptedPolicy

    def script(role, msgs):
        if role.startswith("agent:"):
            name = role.split(":")[1]
            a = 0 if name == "left" else 20
            call = f'<tool_call>{{"name": "crop_video", "arguments": {{"start_time": {a}, "end_time": {a + 20}}}}}'
            return f"<think>\nscan</think><plan>scan {a}-{a + 20}</plan>{call}</tool_call><info>{name} info</info>" \
                   f"<share>{'no' if name == 'right' else 'yes'}</share>"
        return "looked" if role == "subagent" else "<think>\nfrom memory</think><answer>red</answer>"

    cfg = AgentConfig(mode="collaborative",
                      collab={"protocol": "rounds", "agents": [{"name": "left"}, {"name": "right"}], "turns": 2})
    demo._agents[("embedded", "", "", "collaborative", False)] = Agent(policy=ScriptedPolicy(script), config=cfg)
    outs = collect(demo.ask(red_video, "Which colour?", "", "embedded", "", "", 8, "collaborative"))
    status, *_, answer, stats, trace_id, windows, pending, lanes = outs[-1]
    assert status == "done." and answer == "red" and "4 tool calls" in stats
    assert lanes.count('class="pvt-lane"') == 2 and lanes.count('class="pvt-card"') == 4
    left, right = lanes.split('class="pvt-lane"')[1:]
    assert left.count("round ") == 2 and "plan: scan 0-20" in left and "key info: left info" in left
    assert "plan: scan 20-40" in right and right.count("(not shared)") == 2
    assert any(o[-1].count('class="pvt-card"') == 2 for o in outs)  # lanes filled as the rounds finished


def test_handler_errors_are_messages(demo, tmp_path):
    text = tmp_path / "notes.mp4"
    text.write_text("not a video")
    out = collect(demo.ask(str(text), "q?", "", "embedded", "", "", 8, "parallel"))[-1]
    assert out[0].startswith("**error:**") and "not a video" in out[0]
    assert str(tmp_path) not in out[0]  # the server's paths are not shown
    out = collect(demo.ask(None, "q?", "", "embedded", "", "", 8, "parallel"))[-1]
    assert "upload a video" in out[0]
    video, *_ = demo.toy_video()
    # endpoint switching is off unless the operator allows it (a page user must not make the server post anywhere)
    out = collect(demo.ask(video, "q?", "", "endpoint", "http://169.254.169.254/v1", "m", 8, "parallel"))[-1]
    assert "endpoint switching is off" in out[0]
    allowed = type(demo)(str(CHECKPOINT), allow_endpoints=["http://127.0.0.1:9"])
    out = collect(allowed.ask(video, "q?", "", "endpoint", "http://10.0.0.1/v1", "m", 8, "parallel"))[-1]
    assert "not allowed" in out[0]
    out = collect(allowed.ask(video, "q?", "", "endpoint", "http://127.0.0.1:9/v1", "m", 8, "parallel"))[-1]
    assert out[0].startswith("**error:**") and "cannot reach" in out[0]
    out = collect(demo.ask(video, "\u202eq\x00 " * 50_000, "", "embedded", "", "", 8, "parallel"))[-1]
    assert out[0].startswith("**error:**") and "max_question_tokens" in out[0]  # the API's limit, as a message
    small = type(demo)(str(CHECKPOINT), max_upload_mb=0)
    out = collect(small.ask(video, "q?", "", "embedded", "", "", 8, "parallel"))[-1]
    assert "the limit is 0 MB" in out[0]



def test_page_in_headless_chromium(tmp_path):
    engine_unavailable(None if CHROMIUM else "Debian's chromium is not installed (make test installs it)")
    from playwright.sync_api import sync_playwright

    port = free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "gradio_app.py"), "--port", str(port),
                             "--model", str(CHECKPOINT), "--store", str(tmp_path / "t.db"), "--seed", str(SEED)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "the demo did not start"
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-dev-shm-usage", "--no-first-run", "--disable-component-update", "--disable-sync"])
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(url)
            page.click("#pvt-toy")
            page.wait_for_function(
                "() => document.querySelector('#pvt-question textarea, #pvt-question input').value.length > 0",
                timeout=60_000)
            page.click("#pvt-ask")
            page.wait_for_function(
                "() => { const e = document.querySelector('#pvt-answer textarea, #pvt-answer input');"
                " return e && e.value.length > 0; }", timeout=180_000)
            assert page.locator(".pvt-window").count() >= 4
            assert "done." in page.inner_text("#pvt-status")
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "gradio_demo.png"), full_page=True)
            browser.close()
        assert (ARTIFACTS / "gradio_demo.png").stat().st_size > 10_000
    finally:
        proc.terminate()
        proc.wait(10)
