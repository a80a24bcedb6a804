"""The whole ParaVT agent behind an OpenAI-compatible endpoint (``paravt api``).

Any OpenAI client talks to it; the "model" is the agent (planner, K sub-agents, answer)::

    client.chat.completions.create(model="paravt", messages=[{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "talks/t1.mp4"}},     # under --video-root, or http(s)
        {"type": "text", "text": "What colour is shown at second 48?\\nA. purple\\nB. yellow"}]}],
        extra_body={"n_frames": 16, "max_turns": 3, "mode": "parallel"})

- ``POST /v1/chat/completions``: the last user message holds the question (text parts) and the video
  (a ``video_url`` part; a follow-up question without one reuses the latest video of the conversation).
  MCQ options come as trailing ``A. ...`` / ``(B) ...`` lines of the text or as an ``options`` list.
  Extra fields: ``options``, ``n_frames``, ``max_turns``, ``mode``. System messages are ignored: the
  agent keeps the protocol its model was trained with. The reply's ``content`` is the answer;
  ``paravt`` carries the trace id, the parsed choice or span, the windows and summaries; ``usage``
  sums the tokens of the planner and every sub-agent.
  ``stream: true``: Server-Sent Events as the run goes — the planner's reasoning as
  ``reasoning_content`` deltas, one chunk per sub-agent as it finishes (``paravt.event = "subagent"``:
  window, summary, latency), then the answer as ``content``, a final chunk with ``finish_reason``,
  with ``stream_options.include_usage`` a usage chunk (no choices), and ``[DONE]``.
  ``finish_reason`` is always an OpenAI value (``stop``). A question whose run failed (timeout, the
  model endpoint down mid-run, no final response) is an HTTP error with OpenAI's error body
  (504 ``timeout``, 502 ``agent_error``; in a stream, an ``error`` event), the trace in ``paravt``;
  an answer the model wrote badly (empty, degenerate) is a ``stop`` with ``paravt.ok`` false and
  ``paravt.errors``. An answer built on failed work (sub-agents or tools that timed out or whose model
  call failed: ``paravt.status`` "degraded", ``paravt.failed_calls`` of them, each in ``paravt.errors``)
  is a ``stop`` with ``paravt.ok`` false, or a 502 ``degraded_answer`` with ``--degraded error``.
  With OpenTelemetry on (``OTEL_TRACES_EXPORTER=otlp|console``; :mod:`paravt_agent.telemetry`) each
  question is a trace, under the request's W3C ``traceparent`` header when it has one, and
  ``paravt.otel_trace_id`` names it.
- ``POST /v1/feedback``: ``{"trace_id", "answer"?, "reward"?, "thumbs"?, "note"?}`` into the trajectory
  store (online learning: ``paravt-train online`` reads it).
- ``GET /v1/models``, ``GET /health``.

Admission: at most ``max_concurrent`` questions run at once (the local backend batches their model
calls) and ``max_queue`` more wait; beyond that a request is answered 429 with ``Retry-After`` at once,
never left hanging. A client that disconnects cancels its question (its sub-agents stop). Local paths
must lie under ``video_root`` (no root: local paths are refused); ``file://`` is refused; http(s)
videos are downloaded with a size and a time limit.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
import re
import statistics
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from paravt_agent.agent import Agent
from paravt_agent.api_request import ApiError, ApiSettings, Question, parse_request, resolve_video
from paravt_agent.errors import ConfigError, ParaVTError, PolicyError, PromptTooLong, VideoError
from paravt_agent.graph_runtime import event_json
from paravt_agent.trajectory import Trace
from paravt_agent.types import AnswerEvent, MemoryEvent, PlannerEvent, SubAgentEvent

__all__ = ["ApiError", "ApiSettings", "create_app", "parse_request", "resolve_video"]

# --------------------------------------------------------------------------- responses


def usage_of(trace: Trace) -> dict:
    prompt, completion = trace.prompt_tokens, trace.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def extension_of(trace: Trace) -> dict:
    calls = [{"turn": t.turn, "index": c.index, "tool": c.name, "window": c.window, "summary": c.summary,
              "error": c.error, "latency": round(c.latency, 4), "batch_size": c.batch_size}
             for t in trace.turns for c in t.calls]
    return {"trace_id": trace.id, "otel_trace_id": trace.otel_trace_id, "choice": trace.choice, "span": trace.span, "ok": trace.ok,
            "status": trace.status, "failed_calls": trace.failed_calls, "errors": trace.errors,
            "warnings": trace.warnings, "turns": len(trace.turns), "calls": calls,
            "planner_batch_sizes": [t.batch_size for t in trace.turns],
            "latency": round(trace.latency, 4)}


def _think_of(text: str) -> str:
    m = re.search(r"<think>(.*?)(?:</think>|$)", text, re.S)
    return (m.group(1) if m else text).strip()


def _chunk(cid: str, created: int, model: str, delta: dict | None, finish: str | None = None, **extra) -> str:
    """One ``chat.completion.chunk`` event; ``delta=None`` is OpenAI's usage chunk (no choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices,
           **extra}
    return f"data: {json.dumps(obj)}\n\n"


def run_failure(trace: Trace, degraded: str = "answer") -> ApiError | None:
    """The HTTP error of a question whose run failed (the request timed out, the model endpoint failed on the
    way, the planner never gave a final response), or None. An answer the model wrote badly (empty,
    degenerate) is not a failure of the service: it is answered with ``finish_reason: "stop"`` and the errors
    in ``paravt.errors`` (``paravt.ok`` false). A degraded answer (tool calls the runtime could not run) is
    answered (``paravt.status`` "degraded", ``paravt.ok`` false, the failures in ``paravt.errors``), or is a 502
    ``degraded_answer`` when the server was started with ``degraded="error"``."""
    calls = set(trace.runtime_call_errors)
    errors = [e for e in trace.run_errors if e not in calls]
    if not errors:
        if calls and degraded == "error":
            return ApiError(502, f"the answer was built on {len(calls)} failed tool call(s) (trace {trace.id}): "
                            + "; ".join(sorted(calls)), kind="server_error", code="degraded_answer")
        return None
    detail = "; ".join(errors)
    if any("request_timeout" in e for e in errors):
        return ApiError(504, f"the question timed out (trace {trace.id}): {detail}", kind="server_error",
                        code="timeout")
    return ApiError(502, f"the agent could not answer (trace {trace.id}): {detail}", kind="server_error",
                    code="agent_error")


# --------------------------------------------------------------------------- the app


class AgentService:
    """The agents (one per requested mode/max_turns, all over one policy) and the admission control."""

    def __init__(self, agent: Agent, settings: ApiSettings):
        self.base, self.settings = agent, settings
        self._agents: dict[tuple, Agent] = {(agent.config.mode, agent.config.max_turns): agent}
        self._running = asyncio.Semaphore(settings.max_concurrent)
        self.admitted = 0
        self.latencies: deque[float] = deque(maxlen=64)

    def agent(self, mode: str | None, max_turns: int | None) -> Agent:
        key = (mode or self.base.config.mode, max_turns or self.base.config.max_turns)
        if key not in self._agents:
            cfg = self.base.config.model_copy(update={"mode": key[0], "max_turns": key[1]})
            self._agents[key] = Agent(config=cfg, policy=self.base.policy, store=self.base.store)
        return self._agents[key]

    def admit(self) -> None:
        s = self.settings
        if self.admitted >= s.max_concurrent + s.max_queue:
            typical = statistics.median(self.latencies) if self.latencies else 1.0
            raise ApiError(429, f"the server is at capacity ({s.max_concurrent} running, {s.max_queue} waiting); "
                           "retry later", kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(max(1, math.ceil(typical)))})
        self.admitted += 1

    def release(self) -> None:
        self.admitted -= 1


def create_app(agent: Agent, settings: ApiSettings | None = None):
    """The FastAPI application serving ``agent`` (run it with uvicorn; ``paravt api`` does).

    Long by design: FastAPI's idiom is one factory whose routes are closures over the app's agent, settings and
    admission guard; each route body is short and the request/response helpers live at module level."""
    settings = settings or ApiSettings()
    app = FastAPI(title="ParaVT agent API", version="1", docs_url=None, redoc_url=None)
    state: dict[str, AgentService] = {}

    def service() -> AgentService:
        if "svc" not in state:  # created on the server's loop (its semaphore belongs there)
            state["svc"] = AgentService(agent, settings)
        return state["svc"]

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):  # a bug of ours: still an OpenAI-shaped error
        err = ApiError(500, f"{exc.__class__.__name__}: {exc}", kind="server_error", code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    app.add_middleware(_Guard, settings=settings)

    async def read_json(request: Request) -> Any:
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > settings.max_request_bytes:
                raise ApiError(413, f"the request is over {settings.max_request_bytes} bytes", code="too_large")
        try:
            return json.loads(buf or b"null")
        except ValueError as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        except RecursionError:
            raise ApiError(400, "the body is not valid JSON: it is nested too deeply") from None

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "paravt"}]}

    @app.post("/v1/feedback")
    async def feedback(request: Request):
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("trace_id"), str):
            raise ApiError(400, "feedback needs a `trace_id` (the `paravt.trace_id` of an answer)")
        store = agent.store
        if store is None:
            raise ApiError(400, "this server keeps no traces (start it with --store)", code="no_store")
        reward = body.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
            raise ApiError(400, "`reward` must be a number")
        thumbs = body.get("thumbs")
        if thumbs is not None and not isinstance(thumbs, bool):
            raise ApiError(400, "`thumbs` must be true or false")
        try:
            seq = await asyncio.to_thread(store.feedback, body["trace_id"], answer=body.get("answer"),
                                          reward=reward, thumbs=thumbs, note=body.get("note"))
        except ParaVTError as exc:
            raise ApiError(404 if "no trace" in str(exc) else 400, str(exc)) from None
        return {"object": "feedback", "seq": seq, "trace_id": body["trace_id"]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_json(request)
        q = parse_request(body, settings)
        svc = service()
        svc.admit()
        try:
            ag = svc.agent(q.mode, q.max_turns)
            await asyncio.to_thread(ag.check_input, q.question, q.options)  # before any download or model call
            path = await asyncio.to_thread(resolve_video, q.video, settings)
        except ParaVTError as exc:
            svc.release()
            raise _as_api_error(exc) from None
        except BaseException:
            svc.release()
            raise
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if q.stream:
            return StreamingResponse(_stream(request, svc, ag, path, q, cid, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            async with svc._running:
                task = asyncio.ensure_future(ag.aanswer(path, q.question, q.options, n_frames=q.n_frames,
                                                        trace_parent=request.headers.get("traceparent")))
                while not task.done():  # a client that goes away cancels its question
                    await asyncio.wait({task}, timeout=0.25)
                    if not task.done() and await request.is_disconnected():
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)
                        raise ApiError(499, "the client disconnected", code="client_closed")
                ans = task.result()
        except ParaVTError as exc:
            raise _as_api_error(exc) from None
        finally:
            svc.release()
        svc.latencies.append(ans.trace.latency)
        tr = ans.trace
        failed = run_failure(tr, settings.degraded)
        if failed is not None:
            return JSONResponse({**failed.body(), "paravt": extension_of(tr)}, status_code=failed.status,
                                headers=failed.headers)
        return {
            "id": f"chatcmpl-{tr.id}", "object": "chat.completion", "created": created, "model": settings.model_name,
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": ans.text,
                                     "reasoning_content": "\n\n".join(_think_of(t.text) for t in tr.turns)}}],
            "usage": usage_of(tr), "paravt": extension_of(tr),
        }

    async def _stream(request: Request, svc: AgentService, ag: Agent, path: str, q: Question, cid: str,
                      created: int) -> AsyncIterator[str]:
        """The run goes in its own task, its events through a queue: a disconnect (or the response being torn
        down) cancels that task explicitly, which stops the graph and its sub-agents."""
        name = settings.model_name
        events: asyncio.Queue = asyncio.Queue()
        end = object()

        async def produce():
            try:
                async with svc._running:
                    async for ev in ag.astream(path, q.question, q.options, n_frames=q.n_frames,
                                               trace_parent=request.headers.get("traceparent")):
                        events.put_nowait(ev)
            except Exception as exc:  # noqa: BLE001 (handed to the stream)
                events.put_nowait(exc)
            finally:
                svc.release()  # when the run has really stopped
                events.put_nowait(end)

        async def watch():  # servers on ASGI 2.4 report a disconnect only at the next write: listen for it
            while (await request.receive())["type"] != "http.disconnect":
                pass
            producer.cancel()

        producer = asyncio.ensure_future(produce())
        spec = tuple(int(x) for x in request.scope.get("asgi", {}).get("spec_version", "2.0").split("."))
        # below 2.4 Starlette listens itself and cancels this generator, whose finally cancels the run
        watcher = asyncio.ensure_future(watch()) if spec >= (2, 4) else None
        usage_null = {"usage": None} if q.include_usage else {}  # OpenAI: every chunk but the last says null
        try:
            yield _chunk(cid, created, name, {"role": "assistant", "content": ""}, **usage_null)
            while (ev := await events.get()) is not end:
                if isinstance(ev, Exception):
                    err = _as_api_error(ev) if isinstance(ev, ParaVTError) else ApiError(
                        500, f"{ev.__class__.__name__}: {ev}", kind="server_error", code="internal_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                elif isinstance(ev, PlannerEvent):
                    calls = [{"index": c.index, "label": c.label, "window": c.window, "error": c.error}
                             for c in ev.calls]
                    yield _chunk(cid, created, name, {"reasoning_content": _think_of(ev.text) + "\n"},
                                 paravt={"event": "planner", "turn": ev.turn, "calls": calls,
                                         "forced_final": ev.forced_final}, **usage_null)
                elif isinstance(ev, SubAgentEvent):
                    r = ev.record
                    yield _chunk(cid, created, name, {},
                                 paravt={"event": "subagent", "turn": ev.turn, "index": r.index, "agent": r.agent,
                                         "tool": r.name,
                                         "window": r.window, "summary": r.summary, "error": r.error,
                                         "latency": round(r.latency, 4)}, **usage_null)
                elif isinstance(ev, MemoryEvent):  # the collaborative mode: an agent's round, as it finishes
                    yield _chunk(cid, created, name, {}, paravt=event_json(ev), **usage_null)
                elif isinstance(ev, AnswerEvent):
                    tr = ev.answer.trace
                    svc.latencies.append(tr.latency)
                    failed = run_failure(tr, settings.degraded)
                    if failed is not None:  # OpenAI's in-stream error: no content, no finish reason
                        yield f"data: {json.dumps({**failed.body(), 'paravt': extension_of(tr)})}\n\n"
                        continue
                    yield _chunk(cid, created, name, {"content": ev.answer.text}, **usage_null)
                    yield _chunk(cid, created, name, {}, "stop", paravt={"event": "answer", **extension_of(tr)},
                                 **usage_null)
                    if q.include_usage:  # OpenAI: one more chunk, no choices, the whole request's usage
                        yield _chunk(cid, created, name, None, usage=usage_of(tr))
            if not producer.cancelled():
                yield "data: [DONE]\n\n"
        finally:
            if watcher is not None:
                watcher.cancel()
            # cancelled once; not gather(): a torn-down response's task is cancelled again and again, and
            # gather would pass each of those on, interrupting LangGraph while it cancels its node tasks
            producer.cancel()
            await asyncio.wait({producer})

    app.state.service = service
    return app


class _Guard:
    """Pure ASGI (BaseHTTPMiddleware would hide client disconnects from the handlers): the API key and
    the declared request size, checked before a handler runs."""

    def __init__(self, app, settings: ApiSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            err, extra = None, {}
            if self.settings.api_key:
                given = headers.get("authorization", "")
                token = given[7:] if given.lower().startswith("bearer ") else ""
                if not hmac.compare_digest(token.encode(), self.settings.api_key.encode()):
                    err = ApiError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                   kind="authentication_error", code="invalid_api_key")
                    extra = {"WWW-Authenticate": "Bearer"}
            size = headers.get("content-length", "")
            if err is None and size.isdigit() and int(size) > self.settings.max_request_bytes:
                err = ApiError(413, f"the request is over {self.settings.max_request_bytes} bytes", code="too_large")
            if err is not None:
                await JSONResponse(err.body(), status_code=err.status, headers=extra)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _as_api_error(exc: ParaVTError) -> ApiError:
    if isinstance(exc, VideoError | ConfigError):
        return ApiError(400, str(exc), code="invalid_video" if isinstance(exc, VideoError) else "invalid_config")
    if isinstance(exc, PromptTooLong):
        return ApiError(400, str(exc), code="prompt_too_long")
    if isinstance(exc, PolicyError):
        if exc.transient:
            return ApiError(503, str(exc), kind="server_error", code="model_unavailable", headers={"Retry-After": "5"})
        return ApiError(502, str(exc), kind="server_error", code="model_error")
    return ApiError(400, str(exc))


def serve(agent: Agent, settings: ApiSettings, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Run the endpoint with uvicorn until interrupted."""
    import uvicorn

    if host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        print(f"warning: serving on {host} without --api-key: anyone who reaches this port can use the agent",
              flush=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    uvicorn.run(create_app(agent, settings), host=host, port=port, log_level=log_level, timeout_keep_alive=30)
