"""``paravt api``: the agent behind an OpenAI-compatible endpoint, driven by real clients on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from paravt_agent.agent import Agent
from paravt_agent.errors import PolicyError
from paravt_agent.policy.base import Policy, text_of
from paravt_agent.policy.scripted import ScriptedPolicy
from paravt_agent.serving.api import ApiSettings, create_app
from paravt_agent.store import TrajectoryStore
from paravt_agent.types import Generation
from tests.conftest import engine_unavailable, free_port

CALLS = "".join(
    f'<tool_call>{{"name": "crop_video", "arguments": {{"start_time": {a}, "end_time": {b}}}}}</tool_call>'
    for a, b in ((0, 8), (10, 18), (20, 28)))


def script(role, messages):
    if role == "subagent":
        return "The window shows a green screen."
    if "<tool_response>" in text_of(messages[-1]["content"]):
        return "<think>\nThe second window is green, so B.</think>\n<answer>B</answer>"
    return "<think>\nI should look at three windows at once.</think>\n" + CALLS


class Server:
    """A uvicorn server for an app, in a thread, on a free port of 127.0.0.1."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "the API server did not start"
            time.sleep(0.05)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def serve():
    servers = []

    def start(agent, **settings):
        s = Server(create_app(agent, ApiSettings(**settings)))
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


def user(video, text):
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video}},
                                         {"type": "text", "text": text}]}]


QUESTION = "What colour is shown at second 12?\nA. red\nB. green\nC. blue"


def test_openai_client_plain_and_streaming(media, serve, tmp_path):
    from openai import OpenAI

    store = TrajectoryStore(tmp_path / "traces.db")
    agent = Agent(policy=ScriptedPolicy(script), store=store)
    srv = serve(agent, video_root=str(media["dir"]))
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["paravt"]

    r = client.chat.completions.create(model="paravt", messages=user("colours.mp4", QUESTION))
    ext = r.model_extra["paravt"]
    assert r.choices[0].message.content == "B" and ext["choice"] == "B" and ext["ok"]
    assert [c["window"] for c in ext["calls"]] == [[0.0, 8.0], [10.0, 18.0], [20.0, 28.0]]
    assert all(c["summary"] == "The window shows a green screen." for c in ext["calls"])
    stored = store.get(ext["trace_id"])  # the trace id names the stored trace
    assert stored.choice == "B" and stored.options == ["red", "green", "blue"]  # options parsed from the text
    assert stored.question == "What colour is shown at second 12?"
    assert r.usage.total_tokens == stored.prompt_tokens + stored.completion_tokens > 0
    # the same answer as in-process
    direct = Agent(policy=ScriptedPolicy(script)).answer(media["video"], stored.question, ["red", "green", "blue"])
    assert direct.text == r.choices[0].message.content

    # streaming: reasoning first, one event per sub-agent, then the answer, then usage
    stream = client.chat.completions.create(model="paravt", messages=user("colours.mp4", QUESTION), stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"n_frames": 8, "max_turns": 2})
    kinds, reasoning, content, finish, usage = [], "", "", None, None
    for chunk in stream:
        ext = (chunk.model_extra or {}).get("paravt")
        if ext:
            kinds.append(ext["event"])
        if chunk.choices:
            d = chunk.choices[0].delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert kinds == ["planner", "subagent", "subagent", "subagent", "planner", "answer"]
    assert "three windows" in reasoning and "second window is green" in reasoning
    assert content == "B" and finish == "stop" and usage.total_tokens > 0
    assert len(store.export()) == 2
    newest = max(store.export(), key=lambda t: t["created"])
    assert len(newest["overview_timestamps"]) == 8  # n_frames reached the agent

    # feedback from an HTTP client lands in the store
    fb = httpx.post(srv.url + "/v1/feedback", json={"trace_id": newest["id"],
                                                    "answer": "B", "thumbs": True}).json()
    assert store.feedback_since(0)[-1]["seq"] == fb["seq"] and store.feedback_since(0)[-1]["answer"] == "B"


def test_failures_speak_openai(media, serve):
    """Every finish_reason is an OpenAI value (the openai client's typed models accept each reply). A question
    whose run failed (the model endpoint fell over after the tools ran) is an HTTP error with OpenAI's error
    body — in a stream, an error event the client raises on — never a 200 carrying tool-call text. An answer the
    model wrote badly is a 200 ``stop`` with the errors in ``paravt``. Usage is streamed only when asked, in its
    own final chunk with no choices."""
    import openai

    from paravt_agent.errors import PolicyError

    def failing(role, messages):
        if role == "planner" and "<tool_response>" in text_of(messages[-1]["content"]):
            raise PolicyError("the model endpoint fell over")
        return script(role, messages)

    srv = serve(Agent(policy=ScriptedPolicy(failing)), video_root=str(media["dir"]))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="paravt", messages=user("colours.mp4", QUESTION))
    assert err.value.status_code == 502 and "fell over" in err.value.message
    body = err.value.body
    assert body["code"] == "agent_error" and body["type"] == "server_error"
    stream = client.chat.completions.create(model="paravt", messages=user("colours.mp4", QUESTION), stream=True)
    with pytest.raises(openai.APIError, match="fell over"):
        for _ in stream:
            pass
    # a degenerate answer: the service worked, the model did not; still an OpenAI reply
    srv = serve(Agent(policy=ScriptedPolicy(lambda role, m: "<|im_start|>" * 6)), video_root=str(media["dir"]))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="paravt", messages=user("colours.mp4", QUESTION))
    ext = r.model_extra["paravt"]
    assert r.choices[0].finish_reason == "stop" and not ext["ok"] and "degenerate" in ext["errors"][0]
    chunks = list(client.chat.completions.create(model="paravt", messages=user("colours.mp4", QUESTION),
                                                 stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="paravt", messages=user("colours.mp4", QUESTION),
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    assert all(c.usage is None and c.choices for c in chunks[:-1])


def test_curl_plain_and_streaming(media, serve):
    engine_unavailable(None if shutil.which("curl") else "curl is not installed")
    srv = serve(Agent(policy=ScriptedPolicy(script)), video_root=str(media["dir"]))
    body = {"model": "paravt", "messages": user("colours.mp4", "What colour is it?"), "options": ["red", "green"]}
    out = subprocess.run(["curl", "-s", srv.url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps(body)], capture_output=True, text=True, timeout=60).stdout
    r = json.loads(out)
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["content"] == "B"
    out = subprocess.run(["curl", "-sN", srv.url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps({**body, "stream": True})], capture_output=True, text=True,
                         timeout=60).stdout
    events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "B"


def test_bad_requests_get_clear_errors(media, serve, tmp_path):
    import http.server

    outside = tmp_path / "outside.mp4"
    shutil.copy(media["video"], outside)
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(media["dir"]), **k)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    site = f"http://127.0.0.1:{httpd.server_address[1]}"
    srv = serve(Agent(policy=ScriptedPolicy(script)), video_root=str(media["dir"]), max_request_bytes=4096,
                max_download_bytes=1000, download_dir=str(tmp_path / "dl"), allow_url_prefixes=(site + "/",))
    url = srv.url + "/v1/chat/completions"

    def post(body, **kw):
        return httpx.post(url, json=body, timeout=30, **kw)

    def err(r, status, words):
        assert r.status_code == status, r.text
        assert words in r.json()["error"]["message"], r.json()

    err(post({"messages": user("file:///etc/passwd", "q?")}), 400, "only paths under")
    err(post({"messages": user("../outside.mp4", "q?")}), 400, "outside the server's video root")
    err(post({"messages": user(str(outside), "q?")}), 400, "outside the server's video root")
    err(post({"messages": user("missing.mp4", "q?")}), 404, "no such video")
    err(post({"messages": [{"role": "user", "content": "what colour?"}]}), 400, "no video")
    err(post({"messages": user("colours.mp4", "  ")}), 400, "question is empty")
    err(post({"model": "gpt-4o", "messages": user("colours.mp4", "q?")}), 404, "does not exist")
    err(post({"messages": user("colours.mp4", "q?"), "n_frames": 0}), 400, "n_frames")
    err(post({"messages": user("colours.mp4", "q?"), "mode": "fast"}), 400, "mode")
    err(post({"messages": user("colours.mp4", "q?"), "options": ["only one"]}), 400, "options")
    err(post({"messages": user("colours.mp4", "x" * 5000)}), 413, "over 4096 bytes")
    err(httpx.post(url, content=b"{nope", headers={"content-type": "application/json"}), 400, "not valid JSON")
    err(httpx.post(srv.url + "/v1/feedback", json={"trace_id": "x", "answer": "A"}), 400, "--store")
    deep = b"[" * 2000 + b"]" * 2000
    err(httpx.post(url, content=deep, headers={"content-type": "application/json"}), 400, "nested too deeply")
    # the same answer in a process whose recursion limit is raised (an xdist worker's is: the JSON parser then read
    # 2000 levels and the body was refused as "not a JSON object"), and at a depth the parser alone would take
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        err(httpx.post(url, content=deep, headers={"content-type": "application/json"}), 400, "nested too deeply")
        err(httpx.post(url, content=b"[" * 65 + b"]" * 65, headers={"content-type": "application/json"}), 400,
            "over 64 levels")
    finally:
        sys.setrecursionlimit(limit)
    # an http(s) video over the download limit (the operator opened this site's prefix) ...
    try:
        err(post({"messages": user(f"{site}/colours.mp4", "q?")}), 400, "download limit")
    finally:
        httpd.shutdown()
    # ... and the server never fetches from its own network otherwise: here, its own loopback
    err(post({"messages": user(srv.url + "/v1/models", "q?")}), 400, "is a loopback address (127.0.0.1)")
    err(post({"messages": user("http://localhost:9/x.mp4", "q?")}), 400, "loopback address")
    # follow-up question: the video of an earlier message is reused
    msgs = user("colours.mp4", "first?") + [{"role": "assistant", "content": "B"},
                                            {"role": "user", "content": "And now? (A) red (B) green"}]
    assert post({"messages": msgs, "options": ["red", "green"]}).json()["choices"][0]["message"]["content"] == "B"


def test_oversized_questions_are_refused_before_any_model_call(media, serve):
    """A 200,000-character question (NUL and right-to-left characters in it) is a fast 400, as is a long option;
    a long but legal question is answered."""
    policy = ScriptedPolicy(script)
    srv = serve(Agent(policy=policy), video_root=str(media["dir"]))
    url = srv.url + "/v1/chat/completions"
    hostile = ("\u202eevil\x00 " * 20_000)[:200_000]
    t0 = time.perf_counter()
    r = httpx.post(url, json={"messages": user("colours.mp4", hostile)}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long", r.text
    assert "max_question_tokens" in r.json()["error"]["message"] and time.perf_counter() - t0 < 5
    r = httpx.post(url, json={"messages": user("colours.mp4", "Which?"), "options": ["x" * 3000, "y"]}, timeout=30)
    assert r.status_code == 400 and "option A" in r.json()["error"]["message"]
    assert policy.calls == []  # nothing reached the model
    ok = httpx.post(url, json={"messages": user("colours.mp4", "What colour? " + "word " * 1000)}, timeout=60)
    assert ok.status_code == 200 and policy.calls


def test_api_key(media, serve):
    srv = serve(Agent(policy=ScriptedPolicy(script)), video_root=str(media["dir"]), api_key="s3cret")
    body = {"messages": user("colours.mp4", "What colour?\nA. red\nB. green")}
    assert httpx.post(srv.url + "/v1/chat/completions", json=body).status_code == 401
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "B"
    assert httpx.get(srv.url + "/health").status_code == 200  # liveness needs no key


def test_a_full_queue_answers_429_at_once(media, serve):
    srv = serve(Agent(policy=ScriptedPolicy(script, delay=0.5)), video_root=str(media["dir"]), max_concurrent=1,
                max_queue=1)
    body = {"messages": user("colours.mp4", "What colour?\nA. red\nB. green")}

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(delay):
                await asyncio.sleep(delay)
                t0 = time.perf_counter()
                r = await client.post(srv.url + "/v1/chat/completions", json=body)
                return r, time.perf_counter() - t0

            return await asyncio.gather(one(0), one(0.05), one(0.3))

    (a, _), (b, _), (c, tc) = asyncio.run(run())
    assert a.status_code == b.status_code == 200  # one runs, one waits its turn
    assert c.status_code == 429 and int(c.headers["Retry-After"]) >= 1 and tc < 0.5  # no hang
    assert c.json()["error"]["code"] == "queue_full"
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)  # capacity comes back
    assert r.status_code == 200


def test_no_api_error_names_a_path_of_the_server(media, serve, tmp_path):
    """Every kind of error the API answers (bad video, missing, outside the root, too long, unknown model, bad JSON,
    the API key, the agent failing with a server path in its message, a degraded answer refused, a crash of ours, a
    feedback store without the trace, a streamed failure) holds no absolute path of this server: the upload is named
    as the client sent it. Before, `invalid_video` said `/srv/.../notes.mp4: not a readable video
    (InvalidDataError: [Errno 1094995529] ...)`."""
    import re

    root = tmp_path / "videos"
    root.mkdir()
    shutil.copy(media["video"], root / "colours.mp4")
    (root / "notes.mp4").write_text("meeting notes, not a video\n")
    server_paths = [str(tmp_path), str(root.resolve()), str(Path(media["dir"]).resolve()), str(Path.home())]

    def failing(role, messages):  # the runtime failing with the server's path of the video in its words
        if role == "planner" and "<tool_response>" in text_of(messages[-1]["content"]):
            raise PolicyError(f"the model endpoint fell over on {root / 'colours.mp4'}")
        if role == "subagent":
            raise PolicyError(f"cannot decode {root / 'colours.mp4'} here")
        return script(role, messages)

    def crashing(role, messages):
        raise RuntimeError(f"a bug of ours, with a path: {root / 'colours.mp4'}")

    store = TrajectoryStore(tmp_path / "traces.db")
    key = {"Authorization": "Bearer k"}
    agents = {"fails": Agent(policy=ScriptedPolicy(failing), store=store),
              "crashes": Agent(policy=ScriptedPolicy(crashing))}
    srv = {name: serve(a, video_root=str(root), api_key="k", degraded="error", download_dir=str(tmp_path / "dl"))
           for name, a in agents.items()}
    url = srv["fails"].url
    from paravt_agent.config import AgentConfig

    subagents_fail = Agent(policy=ScriptedPolicy(lambda role, m: (_ for _ in ()).throw(
        PolicyError(f"cannot decode {root / 'colours.mp4'} here")) if role == "subagent" else script(role, m)),
        config=AgentConfig(retries=0))
    degraded = serve(subagents_fail, video_root=str(root), degraded="error").url

    def post(base, body, **kw):
        return httpx.post(base + "/v1/chat/completions", json=body, headers=kw.pop("headers", key), timeout=60, **kw)

    answers = {
        "invalid_video": post(url, {"messages": user("notes.mp4", QUESTION)}),
        "video_not_found": post(url, {"messages": user("missing.mp4", QUESTION)}),
        "outside": post(url, {"messages": user("../traces.db", QUESTION)}),
        "prompt_too_long": post(url, {"messages": user("colours.mp4", "x" * 100_000)}),
        "model_not_found": post(url, {"model": "gpt-4o", "messages": user("colours.mp4", QUESTION)}),
        "bad_json": httpx.post(url + "/v1/chat/completions", content=b"{nope", headers=key),
        "invalid_api_key": post(url, {"messages": user("colours.mp4", QUESTION)}, headers={}),
        "agent_error": post(url, {"messages": user("colours.mp4", QUESTION)}),
        "degraded_answer": post(degraded, {"messages": user("colours.mp4", QUESTION)}, headers={}),
        "internal_error": post(srv["crashes"].url, {"messages": user("colours.mp4", QUESTION)}),
        "no_trace": httpx.post(url + "/v1/feedback", json={"trace_id": "nope", "answer": "A"}, headers=key),
        "stream": post(url, {"messages": user("colours.mp4", QUESTION), "stream": True}),
    }
    codes = {name: r.status_code for name, r in answers.items()}
    assert codes == {"invalid_video": 400, "video_not_found": 404, "outside": 400, "prompt_too_long": 400,
                     "model_not_found": 404, "bad_json": 400, "invalid_api_key": 401, "agent_error": 502,
                     "degraded_answer": 502, "internal_error": 500, "no_trace": 404, "stream": 200}, codes
    for name, r in answers.items():
        for p in server_paths:
            assert p not in r.text, (name, p, r.text[:600])
        assert not [m for m in re.findall(r"(?<![\w:/.])/(?:[\w.@+-]+/)+[\w.@+-]+", r.text)
                    if Path(m).parent.exists()], (name, r.text[:600])
    said = answers["invalid_video"].json()["error"]["message"]
    assert said.startswith("notes.mp4: this is a text file") and "Errno" not in said
    assert "colours.mp4" in answers["agent_error"].json()["error"]["message"]  # named as the client sent it
    assert answers["internal_error"].json()["error"]["message"] == (
        "internal error (RuntimeError); the server's log has the details")
    assert "error" in answers["stream"].text and "fell over on colours.mp4" in answers["stream"].text


class SlowSubAgents(Policy):
    """The planner dispatches four calls; each sub-agent takes 3 s unless cancelled (counted)."""

    name = "slow"

    def __init__(self):
        self.started = self.cancelled = self.finished = 0

    async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
        if role == "planner":
            calls = "".join(f'<tool_call>{{"name": "crop_video", "arguments": {{"start_time": {s}, '
                            f'"end_time": {s + 5}}}}}</tool_call>' for s in (0, 10, 20, 30))
            return Generation(text=prefix + "look</think>" + calls)
        self.started += 1
        try:
            await asyncio.sleep(3)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1
        return Generation(text="green")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_disconnect_cancels_its_subagents(media, serve, stream):
    policy = SlowSubAgents()
    srv = serve(Agent(policy=policy), video_root=str(media["dir"]))
    body = {"messages": user("colours.mp4", "What colour?"), "stream": stream}
    with (pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=httpx.Timeout(60, read=1.0)) as client,
          client.stream("POST", srv.url + "/v1/chat/completions", json=body) as r):
        for _ in r.iter_lines():
            pass
    service = srv.server.config.app.state.service()
    deadline = time.time() + 5  # the handler releases its slot just after the cancellations land: wait for both
    while (policy.cancelled < 4 or service.admitted) and time.time() < deadline:
        time.sleep(0.05)
    assert policy.started == 4 and policy.cancelled == 4 and policy.finished == 0
    assert service.admitted == 0  # its place in the queue is free again


@pytest.mark.slow
def test_paravt_api_on_the_toy_policy_answers_32_concurrent_requests(toy_rl, tmp_path):
    """The real CLI with the local backend: 32 questions at once, all answered, their model calls batched."""
    from openai import AsyncOpenAI

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "paravt_agent.cli", "api", "--port", str(port), "--video-root",
                             toy_rl["video_root"], "--max-concurrent", "32", "--store", str(tmp_path / "t.db")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "paravt api did not start"
            time.sleep(0.3)
        items = []
        for w in toy_rl["worlds"]:
            mcq = [q for q in w.questions if q.options][:1]
            items += [(w, q) for q in mcq] * 8

        async def run():
            client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=600)

            async def one(w, q):
                return await client.chat.completions.create(
                    model="paravt", messages=user(Path(w.video).name, q.question),
                    extra_body={"options": q.options, "n_frames": 8})

            return await asyncio.gather(*(one(w, q) for w, q in items))

        replies = asyncio.run(run())
        assert len(replies) == 32 and all(r.choices[0].message.content for r in replies)
        exts = [r.model_extra["paravt"] for r in replies]
        assert all(e["ok"] for e in exts)
        sizes = ([b for e in exts for b in e["planner_batch_sizes"]]
                 + [c["batch_size"] for e in exts for c in e["calls"]])
        assert max(sizes) > 1  # concurrent questions shared batches on the local backend
        right = sum(e["choice"] == q.answer for e, (_, q) in zip(exts, items, strict=True))
        assert right >= 24, right  # the shipped toy policy answers these colour questions
        assert TrajectoryStore(tmp_path / "t.db").count() == 32
    finally:
        proc.terminate()
        proc.wait(20)
