"""OpenTelemetry: one question at K = 3 gives the span tree of paravt_agent/telemetry.py, read from the SDK's
in-memory exporter; content only when the operator enables it; nothing when tracing is off."""

import json

import pytest
from test_graph import summary_script

from paravt_agent import telemetry
from paravt_agent.agent import Agent
from paravt_agent.policy.scripted import ScriptedPolicy

sdk = pytest.importorskip("opentelemetry.sdk.trace")
WINDOWS = [(2, 6), (10, 14), (20, 24)]


@pytest.fixture(scope="module")
def exporter():
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    if not telemetry.enabled():  # the global provider can be set once per process
        trace.set_tracer_provider(TracerProvider())
    exporter = InMemorySpanExporter()
    trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture
def spans(exporter):
    exporter.clear()
    return exporter


def test_one_question_at_k3_gives_the_span_tree(media, spans, monkeypatch):
    monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
    ans = Agent(policy=ScriptedPolicy(summary_script(WINDOWS))).answer(media["video"], "Which colour?", ["red", "blue"])
    got = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in got}
    names = sorted(s.name for s in got)
    assert names == sorted(["invoke_agent paravt", "paravt.overview", "paravt.planner_turn", "paravt.planner_turn",
                            *["execute_tool crop_video"] * 3, *["invoke_agent paravt.subagent"] * 3,
                            *["chat scripted"] * 5])
    assert len({s.context.trace_id for s in got}) == 1  # one trace per question
    [root] = [s for s in got if s.parent is None]
    assert root.name == "invoke_agent paravt"
    assert f"{root.context.trace_id:032x}" == ans.trace.otel_trace_id

    def parent(s):
        return by_id[s.parent.span_id]

    turns = sorted((s for s in got if s.name == "paravt.planner_turn"), key=lambda s: s.attributes["paravt.turn"])
    assert all(parent(t) is root for t in turns) and parent(next(s for s in got if s.name == "paravt.overview")) is root
    assert [t.attributes["paravt.tool_calls"] for t in turns] == [3, 0]
    tools = [s for s in got if s.name == "execute_tool crop_video"]
    assert all(parent(t) is turns[0] for t in tools)  # a call's parent is the turn that dispatched it
    assert sorted(t.attributes["gen_ai.tool.call.id"] for t in tools) == ["0:0", "0:1", "0:2"]
    assert sorted(tuple(t.attributes["paravt.window"]) for t in tools) == [tuple(map(float, w)) for w in WINDOWS]
    subs = [s for s in got if s.name == "invoke_agent paravt.subagent"]
    assert {parent(s).context.span_id for s in subs} == {t.context.span_id for t in tools}
    chats = [s for s in got if s.name == "chat scripted"]
    assert sorted(parent(c).name for c in chats) == sorted(["paravt.planner_turn"] * 2
                                                           + ["invoke_agent paravt.subagent"] * 3)
    for c in chats:
        assert c.attributes["gen_ai.operation.name"] == "chat" and c.attributes["gen_ai.provider.name"] == "scripted"
        assert c.attributes["gen_ai.usage.output_tokens"] >= 0 and "gen_ai.request.temperature" in c.attributes
        assert c.attributes["paravt.role"] in ("planner", "subagent")
        assert root.start_time <= c.start_time <= c.end_time <= root.end_time
    assert root.attributes["paravt.trace_id"] == ans.trace.id and root.attributes["paravt.tool_calls"] == 3
    assert root.attributes["gen_ai.usage.output_tokens"] == ans.trace.completion_tokens
    # no content unless the operator asks for it
    assert not any(k.startswith("gen_ai.input") or k.startswith("gen_ai.output") for s in got for k in s.attributes)


def test_content_is_recorded_when_the_operator_enables_it(media, spans, monkeypatch):
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    Agent(policy=ScriptedPolicy(summary_script(WINDOWS[:1]))).answer(media["video"], "Which colour?")
    [root] = [s for s in spans.get_finished_spans() if s.parent is None]
    assert json.loads(root.attributes["gen_ai.input.messages"])[0]["parts"][0]["content"] == "Which colour?"
    assert json.loads(root.attributes["gen_ai.output.messages"])[0]["parts"][0]["content"] == "B"


def test_a_failing_tool_call_is_an_error_span(media, spans):
    from opentelemetry.trace import StatusCode

    script = summary_script(WINDOWS, fail=lambda start: start == 10)
    from paravt_agent.config import AgentConfig

    ans = Agent(policy=ScriptedPolicy(script), config=AgentConfig(retries=0)).answer(media["video"], "q?")
    assert ans.text == "B"
    tools = [s for s in spans.get_finished_spans() if s.name == "execute_tool crop_video"]
    failed = [s for s in tools if s.status.status_code == StatusCode.ERROR]
    assert len(failed) == 1 and failed[0].attributes["paravt.window"] == (10.0, 14.0)
    assert "decoder exploded" in failed[0].status.description


def test_off_by_default_and_nothing_is_built(media, monkeypatch):
    import subprocess
    import sys

    # a fresh process: no provider configured, so no span (and the trace carries no OpenTelemetry id)
    code = ("from paravt_agent import telemetry; import sys; "
            "from paravt_agent.agent import Agent; from paravt_agent.policy.scripted import ScriptedPolicy; "
            "a = Agent(policy=ScriptedPolicy(lambda role, m: '<think>x</think><answer>A</answer>'));"
            "t = a.answer(sys.argv[1], 'q?').trace; print(telemetry.enabled(), t.otel_trace_id)")
    out = subprocess.run([sys.executable, "-c", code, str(media["video"])], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["False", "None"], out.stderr


def test_configure_from_env_console_exporter(media, tmp_path):
    import subprocess
    import sys

    code = ("from paravt_agent import telemetry; import sys; "
            "from paravt_agent.agent import Agent; from paravt_agent.policy.scripted import ScriptedPolicy; "
            "assert telemetry.configure_from_env(); "
            "a = Agent(policy=ScriptedPolicy(lambda role, m: '<think>x</think><answer>A</answer>'));"
            "print('TRACE', a.answer(sys.argv[1], 'q?').trace.otel_trace_id, flush=True)")
    env = {**__import__("os").environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "paravt-test"}
    out = subprocess.run([sys.executable, "-c", code, str(media["video"])], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    trace_id = out.stdout.split("TRACE ")[1].split()[0]
    assert f'"trace_id": "0x{trace_id}"' in out.stdout and '"service.name": "paravt-test"' in out.stdout
    assert '"name": "invoke_agent paravt"' in out.stdout


def test_the_api_reply_names_the_trace_and_continues_the_callers(media, spans):
    import httpx
    from test_api import QUESTION, Server, script, user

    from paravt_agent.serving.api import ApiSettings, create_app

    srv = Server(create_app(Agent(policy=ScriptedPolicy(script)), ApiSettings(video_root=str(media["dir"]))))
    try:
        caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                       headers={"traceparent": f"00-{caller_trace}-{caller_span}-01"},
                       json={"model": "paravt", "messages": user("colours.mp4", QUESTION)})
        r.raise_for_status()
        plain = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                           json={"model": "paravt", "messages": user("colours.mp4", QUESTION)}).json()
    finally:
        srv.close()
    assert r.json()["paravt"]["otel_trace_id"] == caller_trace  # the caller's trace goes on
    roots = [s for s in spans.get_finished_spans() if s.name == "invoke_agent paravt"]
    [called] = [s for s in roots if f"{s.context.trace_id:032x}" == caller_trace]
    assert f"{called.parent.span_id:016x}" == caller_span
    # without the header: a trace of its own (under the server's request span, where the web framework makes one)
    assert plain["paravt"]["otel_trace_id"] in {f"{s.context.trace_id:032x}" for s in roots} - {caller_trace}


def test_a_bare_question_run_by_the_graph_itself_is_one_trace(media, spans):
    """LangGraph Server's path: the graph decodes the overview itself and opens the question's span there."""
    import asyncio

    from paravt_agent.graph import build_graph

    agent = Agent(policy=ScriptedPolicy(summary_script(WINDOWS)))
    out = asyncio.run(build_graph().ainvoke({"video": str(media["video"]), "question": "Which colour?"},
                                            context=agent.context()))
    got = spans.get_finished_spans()
    assert len({s.context.trace_id for s in got}) == 1 and len(got) == 2 + 2 + 3 * 3 + 2
    [root] = [s for s in got if s.parent is None]
    assert root.name == "invoke_agent paravt" and out["trace"]["otel_trace_id"] == f"{root.context.trace_id:032x}"
    assert {s.name for s in got if s.parent and s.parent.span_id == root.context.span_id} == {
        "paravt.overview", "paravt.planner_turn"}
