"""Deployment engines, for real on 127.0.0.1: SGLang's router in front of two SGLang servers, and
LangGraph's own server (``langgraph dev``) serving the ParaVT graph."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

BIN = os.path.dirname(sys.executable)
REPO = Path(__file__).resolve().parent.parent


def _wait(url: str, proc: subprocess.Popen, timeout: float = 120, log=None) -> None:
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"{url}: the process exited ({proc.returncode}): {log() if log else ''}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, f"{url} did not come up"
        time.sleep(0.3)


def _served(worker) -> int:
    """Prompt tokens the worker has computed so far (SGLang's cumulative counter): it grows with every request."""
    return httpx.get(worker.url + "/v1/loads", timeout=10).json()["loads"][0]["total_prefill_uncached_tokens"]


@pytest.mark.slow
def test_sglang_router_spreads_an_eval_shard_and_loses_nothing_when_a_worker_dies(toy_policy_dir, toy_rl,
                                                                                 sglang_toy, own_sglang, tmp_path):
    """SGLang's router (sglang-router 0.3.2) in front of two SGLang servers (0.5.23 on CPU): the agent's calls spread
    over both; a weight push to the router reaches every worker; while a sync updates them no request through the
    router fails: SGLang answers /health with 503 after 20 s of pause, and a router whose workers are all paused at
    once marks them unhealthy and refuses requests ("no_available_workers") until they pass its checks again, so
    the syncs update one worker at a time; an eval shard through the router loses no question when a worker is
    killed mid-run. (The router here checks health every second and gives up after one failure, so what would take
    minutes with its defaults happens in seconds; its check waits 5 s, its default: a paused worker's /health
    answers once the sync's next bucket lands, about a second apart, and at 2 s a check now and then missed it.)"""
    from paravt_agent.agent import Agent
    from paravt_train.sync.disk import SGLangWeightSync
    from paravt_train.sync.streamed import SGLangTensorSync, stream_parameters
    from tests.sglang_cpu.server import PYTHON

    w1 = sglang_toy
    [w2] = own_sglang(toy_policy_dir)
    port = free_port()
    router_url = f"http://127.0.0.1:{port}"
    log = tmp_path / "router.log"
    with log.open("w") as f:
        router = subprocess.Popen([str(PYTHON), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                   "--port", str(port), "--policy", "round_robin",
                                   "--prometheus-port", str(free_port()),
                                   "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                                   "--health-success-threshold", "1", "--health-check-timeout-secs", "5",
                                   "--worker-urls", w1.url, w2.url],
                                  stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(router_url + "/health", router, log=lambda: log.read_text()[-2000:])
        deadline = time.time() + 60
        while sorted(w["url"] for w in httpx.get(router_url + "/workers").json()["workers"]) != sorted(
                [w1.url, w2.url]):  # the router adds its workers once each answers its health check
            assert time.time() < deadline, httpx.get(router_url + "/workers").text
            time.sleep(0.2)

        # the agent through the router: its calls spread over both workers
        w = toy_rl["worlds"][0]
        q = next(q for q in w.questions if q.options)
        before = [_served(w1), _served(w2)]
        ans = Agent(model=toy_policy_dir, backend="sglang", endpoint=router_url).answer(w.video, q.question,
                                                                                        q.options, n_frames=8)
        assert ans.ok and ans.choice == q.answer
        assert _served(w1) > before[0] and _served(w2) > before[1]

        # a weight push to the router reaches every worker behind it
        before = [httpx.get(s.url + "/model_info").json()["weight_version"] for s in (w1, w2)]
        SGLangWeightSync(router_url, tmp_path / "weights").serve(Path(toy_policy_dir), version="5")
        after = [httpx.get(s.url + "/model_info").json()["weight_version"] for s in (w1, w2)]
        assert before == ["default", "default"] and after == ["5", "5"]

        # a streamed sync that keeps each worker paused ~4 s: the router never runs out of workers
        body = {"input_ids": [20, 21, 22, 23], "sampling_params": {"max_new_tokens": 4}}
        statuses: list[int] = []
        done = threading.Event()

        def client() -> None:
            while not done.is_set():
                try:
                    statuses.append(httpx.post(router_url + "/generate", json=body, timeout=60).status_code)
                except httpx.HTTPError:
                    statuses.append(0)
                time.sleep(0.2)

        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(toy_policy_dir)
        named = list(stream_parameters(model))[:4]

        def slow():  # a large model's stream, in miniature: a second a bucket
            for item in named:
                time.sleep(1.0)
                yield item

        t = threading.Thread(target=client)
        t.start()
        try:
            SGLangTensorSync(router_url, bucket_bytes=1).send_tensors(slow, version="6")
        finally:
            done.set()
            t.join(60)
        assert statuses and set(statuses) == {200}, statuses
        assert [httpx.get(s.url + "/model_info").json()["weight_version"] for s in (w1, w2)] == ["6", "6"]
        # (both paused at once, as the syncs used to: the router refuses every request within seconds)
        for s in (w1, w2):
            httpx.post(s.url + "/pause_generation", json={"mode": "retract"})
        try:
            deadline = time.time() + 30
            while True:
                try:  # a request the router still forwards waits at the paused worker
                    if httpx.post(router_url + "/generate", json=body, timeout=3).status_code == 503:
                        break
                except httpx.TimeoutException:
                    pass
                assert time.time() < deadline, "the router kept its paused workers"
        finally:
            for s in (w1, w2):
                httpx.post(s.url + "/continue_generation", json={})
        deadline = time.time() + 60
        while httpx.post(router_url + "/generate", json=body, timeout=60).status_code != 200:  # healthy again
            assert time.time() < deadline
            time.sleep(0.5)

        # an eval shard through the router; one worker is killed midway and no question is lost
        out = tmp_path / "eval.jsonl"
        start = _served(w2)
        ev = subprocess.Popen([os.path.join(BIN, "paravt-train"), "eval", "-b", "toy", "--root",
                               f"toy={toy_rl['data']}", "--backend", "sglang", "--model", toy_policy_dir,
                               "--endpoint", router_url, "--shard", "0/2", "--out", str(out), "--concurrency", "2",
                               "--set", "frames.n_frames=8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
        deadline = time.time() + 300
        while _served(w2) < start + 200:
            assert ev.poll() is None, ev.stderr.read()[-3000:]
            assert time.time() < deadline
            time.sleep(0.1)
        w2.close()  # killed mid-run
        killed_at = len(out.read_text().splitlines()) if out.exists() else 0
        stdout, stderr = ev.communicate(timeout=600)
        assert ev.returncode == 0, stderr[-3000:]
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        from paravt_train.benchmarks.toy import load_toy

        expected = len(load_toy(Path(toy_rl["data"]))[0::2])
        assert len(rows) == expected and killed_at < expected  # the kill happened before the shard was done
        assert all(not r["errors"] for r in rows), [r["errors"] for r in rows if r["errors"]]
        assert all(r["answer_text"].strip() for r in rows)
        mcq = [r["correct"] for r in rows if "correct" in r]
        assert mcq and sum(mcq) / len(mcq) >= 0.5  # the toy policy's answers, not empty replies
    finally:
        import signal

        os.killpg(router.pid, signal.SIGKILL)
        router.wait(20)


@pytest.mark.slow
def test_langgraph_dev_serves_the_paravt_graph(toy_policy_dir, toy_rl, tmp_path):
    """`langgraph dev` with the repository's langgraph.json: LangGraph's own API (threads, runs, streaming)
    answers as Agent.answer does."""
    pytest.importorskip("langgraph_api", reason="langgraph-cli[inmem] is not installed")
    from langgraph_sdk import get_client

    from paravt_agent.agent import Agent

    port = free_port()
    log = tmp_path / "langgraph.log"
    env = {**os.environ, "LANGSMITH_TRACING": "false", "PARAVT_MODEL": toy_policy_dir,
           "PARAVT_VIDEO_ROOT": toy_rl["video_root"]}
    with log.open("w") as f:  # run from elsewhere: the dev server keeps its state in the working directory
        server = subprocess.Popen([os.path.join(BIN, "langgraph"), "dev", "--no-browser", "--no-reload", "--host",
                                   "127.0.0.1", "--port", str(port), "--config", str(REPO / "langgraph.json")],
                                  cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(url + "/ok", server, log=lambda: log.read_text()[-3000:])
        w = toy_rl["worlds"][1]
        q = next(q for q in w.questions if q.options)
        inp = {"video": Path(w.video).name, "question": q.question, "options": q.options, "n_frames": 8}

        async def run():
            client = get_client(url=url)
            assert [a["graph_id"] for a in await client.assistants.search()] == ["paravt"]
            thread = await client.threads.create()
            events, values = [], None
            async for part in client.runs.stream(thread["thread_id"], "paravt", input=inp,
                                                 stream_mode=["custom", "values"]):
                if part.event == "custom":
                    events.append(part.data)
                elif part.event == "values":
                    values = part.data
            state = await client.threads.get_state(thread["thread_id"])
            history.extend(await client.threads.get_history(thread["thread_id"], limit=50))
            bad = await client.runs.wait(None, "paravt", input={**inp, "video": "../../etc/passwd"},
                                        raise_error=False)
            return events, values, state, bad

        import asyncio

        history: list[dict] = []
        events, values, state, bad = asyncio.run(run())
        kinds = [e["event"] for e in events]
        assert kinds[0] == "overview" and kinds.count("planner") >= 2 and "subagent" in kinds
        assert len(events[0]["timestamps"]) == 8
        direct = Agent(model=toy_policy_dir).answer(w.video, q.question, q.options, n_frames=8)
        assert values["ok"] and values["choice"] == direct.choice == q.answer
        assert values["answer"] == direct.text
        assert values["trace"]["question"] == q.question and values["trace_id"] == values["trace"]["id"]
        assert state["values"]["trace_id"] == values["trace_id"]  # the thread keeps the run's result
        # the server runs the agent's own graph: its thread state is the agent's (plain data, frames by key)
        st = state["values"]
        assert len(st["turns"]) >= 2 and st["results"] and all(":" in k for k in st["results"])
        assert [r["summary"] for r in st["results"].values()] == [c["summary"] for t in values["trace"]["turns"]
                                                                  for c in t["calls"]]
        images = [p for m in st["messages"] if isinstance(m["content"], list) for p in m["content"]
                  if p["type"] == "image"]
        assert len(images) >= 8 and all(set(p) == {"type", "ref", "timestamp"} for p in images)
        assert {"overview", "planner", "subagent", "aggregate", "finish"} <= {
            n for h in history for n in (h.get("next") or [])} | {"finish"}
        assert "VideoError" in json.dumps(bad)  # PARAVT_VIDEO_ROOT is enforced
        assert "outside the server's video root" in log.read_text()
    finally:
        server.terminate()
        server.wait(30)
