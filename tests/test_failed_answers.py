"""Runs that fail, said as failures: empty and degenerate answers flagged, a failed request stored with its error,
a request deadline that keeps what finished, an endpoint answering 200 with junk as a policy error."""

import time

import pytest


def test_empty_and_degenerate_answers_are_flagged(media):
    from paravt_agent.agent import Agent
    from paravt_agent.config import AgentConfig
    from paravt_agent.policy.scripted import ScriptedPolicy

    empty = Agent(policy=ScriptedPolicy(lambda role, m: ""), config=AgentConfig(mode="none", think_prefix=""))
    ans = empty.answer(media["video"], "q?")
    assert not ans.ok and "empty answer" in ans.trace.errors[0]
    loop = Agent(policy=ScriptedPolicy(lambda role, m: "<|im_start|>assistant\n" * 8), config=AgentConfig(mode="none"))
    ans = loop.answer(media["video"], "q?")
    assert not ans.ok and "degenerate" in ans.trace.errors[0]
    good = Agent(policy=ScriptedPolicy(lambda role, m: "<think>fine</think><answer>A</answer>"),
                 config=AgentConfig(mode="none"))
    assert good.answer(media["video"], "q?").ok


def test_failed_requests_are_stored_with_their_error(media, tmp_path):
    from paravt_agent.agent import Agent
    from paravt_agent.errors import PolicyError
    from paravt_agent.policy.scripted import ScriptedPolicy
    from paravt_agent.store import TrajectoryStore

    def down(role, messages):
        raise PolicyError("endpoint down")

    store = TrajectoryStore(tmp_path / "t.db")
    agent = Agent(policy=ScriptedPolicy(down), store=store)
    with pytest.raises(PolicyError):
        agent.answer(media["video"], "q?")
    [row] = store.export()
    assert row["errors"] == ["endpoint down"] and row["question"] == "q?"


def test_a_request_deadline(media):
    from paravt_agent.agent import Agent
    from paravt_agent.config import AgentConfig
    from paravt_agent.policy.scripted import ScriptedPolicy

    def script(role, messages):
        if role == "planner" and "<tool_response>" not in str(messages[-1]["content"]):
            return ('<think>look</think>'
                    '<tool_call>{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 3}}</tool_call>')
        return "<think>x</think><answer>A</answer>"

    agent = Agent(policy=ScriptedPolicy(script, delay=0.6), config=AgentConfig(request_timeout=1.0, retries=0))
    t0 = time.perf_counter()
    ans = agent.answer(media["video"], "q?")
    assert time.perf_counter() - t0 < 2.5 and not ans.ok and "request_timeout" in ans.trace.errors[0]
    assert ans.trace.turns  # what finished is kept


@pytest.mark.parametrize("body,ctype", [(b"this is not json", "application/json"),
                                        (b"<html><body>proxy login</body></html>", "text/html")])
def test_an_endpoint_answering_200_with_junk_is_a_policy_error(media, body, ctype):
    import http.server
    import threading

    from paravt_agent.agent import Agent
    from paravt_agent.config import AgentConfig
    from paravt_agent.errors import PolicyError

    class Junk(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Junk)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        agent = Agent(backend="openai", endpoint=f"http://127.0.0.1:{srv.server_address[1]}/v1", model="m",
                      config=AgentConfig(retries=0, mode="none"), policy_kwargs={"max_retries": 0})
        with pytest.raises(PolicyError, match="not a chat completion"):
            agent.answer(media["video"], "q?")
    finally:
        srv.shutdown()
