"""The routes of ``paravt api`` (see :mod:`paravt_agent.serving.api` for what the endpoint does): ``/health``,
``/v1/models``, ``/v1/feedback``, ``/v1/chat/completions`` (plain and streaming). Each route reads the app's
:class:`ServerState` (the agent, the settings, the admission guard) from ``request.app.state.paravt``."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from paravt_agent.agent import Agent
from paravt_agent.errors import ParaVTError, StoreError
from paravt_agent.graph.runtime import event_json
from paravt_agent.serving.redact import ClientView
from paravt_agent.serving.request import ApiError, ApiSettings, Question, parse_request, resolve_video
from paravt_agent.serving.responses import as_api_error, chunk, extension_of, run_failure, think_of, usage_of
from paravt_agent.types import AnswerEvent, MemoryEvent, PlannerEvent, SubAgentEvent

__all__ = ["ServerState", "router"]

router = APIRouter()
log = logging.getLogger("paravt.api")


@dataclass
class ServerState:
    """What the routes share: the agent, the settings, and the admission guard (made on the server's loop)."""

    agent: Agent
    settings: ApiSettings
    service: Callable


def server_of(request: Request) -> ServerState:
    return request.app.state.paravt


async def read_json(request: Request) -> Any:
    settings = server_of(request).settings
    buf = bytearray()
    async for part in request.stream():
        buf += part
        if len(buf) > settings.max_request_bytes:
            raise ApiError(413, f"the request is over {settings.max_request_bytes} bytes", code="too_large")
    try:
        body = json.loads(buf or b"null")
    except ValueError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:  # deeper than the interpreter's recursion limit
        body = None
        deep = True
    else:
        deep = _deeper_than(body, MAX_JSON_DEPTH)
    if deep:  # the same answer whatever the process's recursion limit (a thread, a test worker, a raised limit)
        raise ApiError(400, f"the body is not valid JSON: it is nested too deeply (over {MAX_JSON_DEPTH} levels)")
    return body


#: how deep a request body's arrays and objects may nest (a chat request is ~6 levels)
MAX_JSON_DEPTH = 64


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests arrays and objects more than ``limit`` deep (iteratively: no recursion)."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request):
    settings = server_of(request).settings
    return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                        "owned_by": "paravt"}]}


@router.post("/v1/feedback")
async def feedback(request: Request):
    body = await read_json(request)
    agent = server_of(request).agent
    if not isinstance(body, dict) or not isinstance(body.get("trace_id"), str):
        raise ApiError(400, "feedback needs a `trace_id` (the `paravt.trace_id` of an answer)")
    store = agent.store
    if store is None:
        raise ApiError(400, "this server keeps no traces (start it with --store)", code="no_store")
    user = body.get("user")  # OpenAI's end-user id: a sub-label within the caller's principal, never a voter
    if user is not None and (not isinstance(user, str) or len(user) > 200):
        raise ApiError(400, "`user` must be a string of at most 200 characters")
    principal = request.state.principal  # the API key's owner (the guard authenticated it)
    key = body.get("idempotency_key") or request.headers.get("idempotency-key")
    try:  # the store checks what the row says (FeedbackError: 400 with what to send instead)
        seq = await asyncio.to_thread(store.feedback, body["trace_id"], answer=body.get("answer"),
                                      reward=body.get("reward"), thumbs=body.get("thumbs"), note=body.get("note"),
                                      user=f"{principal}/{user}" if user else principal,
                                      key=str(key)[:200] if key else None, principal=principal)
    except StoreError as exc:
        view = ClientView(server_of(request).settings, store_url=store.url)
        raise view.error(ApiError(503, str(exc), kind="server_error", code="store_unavailable",
                                  headers={"Retry-After": "5"} if exc.retryable else {})) from None
    except ParaVTError as exc:
        view = ClientView(server_of(request).settings, store_url=store.url)
        raise view.error(ApiError(404 if "no trace" in str(exc) else 400, str(exc))) from None
    return {"object": "feedback", "seq": seq, "trace_id": body["trace_id"]}


@router.post("/v1/chat/completions")
async def chat(request: Request):
    server = server_of(request)
    settings = server.settings
    body = await read_json(request)
    q = parse_request(body, settings)
    svc = server.service()
    svc.admit()
    view = ClientView(settings)
    try:
        ag = svc.agent(q.mode, q.max_turns)
        await asyncio.to_thread(ag.check_input, q.question, q.options)  # before any download or model call
        path = await asyncio.to_thread(resolve_video, q.video, settings)
    except ParaVTError as exc:
        svc.release()
        raise view.error(as_api_error(exc)) from None
    except BaseException:
        svc.release()
        raise
    view = ClientView(settings, path, q.video)  # the upload named as the client sent it, never the server's path
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if q.stream:
        return StreamingResponse(_stream(request, svc, ag, path, q, cid, created, view),
                                 media_type="text/event-stream",
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
        raise view.error(as_api_error(exc)) from None
    finally:
        svc.release()
    svc.latencies.append(ans.trace.latency)
    tr = ans.trace
    failed = run_failure(tr, settings.degraded)
    if failed is not None:
        failed = view.error(failed)
        return JSONResponse({**failed.body(), "paravt": view.data(extension_of(tr))}, status_code=failed.status,
                            headers=failed.headers)
    return {
        "id": f"chatcmpl-{tr.id}", "object": "chat.completion", "created": created, "model": settings.model_name,
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": ans.text,
                                 "reasoning_content": "\n\n".join(think_of(t.text) for t in tr.turns)}}],
        "usage": usage_of(tr), "paravt": view.data(extension_of(tr)),
    }


async def _stream(request: Request, svc: Any, ag: Agent, path: str, q: Question, cid: str,
                  created: int, view: ClientView) -> AsyncIterator[str]:
    """The run goes in its own task, its events through a queue: a disconnect (or the response being torn
    down) cancels that task explicitly, which stops the graph and its sub-agents."""
    settings = svc.settings
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
        yield chunk(cid, created, name, {"role": "assistant", "content": ""}, **usage_null)
        while (ev := await events.get()) is not end:
            if isinstance(ev, Exception):
                if isinstance(ev, ParaVTError):
                    err = view.error(as_api_error(ev))
                else:  # a bug of ours: its class for the client, the traceback for the server's log
                    log.error("internal error in a streamed answer", exc_info=ev)
                    err = ApiError(500, f"internal error ({ev.__class__.__name__}); the server's log has the "
                                   "details", kind="server_error", code="internal_error")
                yield f"data: {json.dumps(err.body())}\n\n"
            elif isinstance(ev, PlannerEvent):
                calls = [{"index": c.index, "label": c.label, "window": c.window, "error": c.error}
                         for c in ev.calls]
                yield chunk(cid, created, name, {"reasoning_content": think_of(ev.text) + "\n"},
                             paravt={"event": "planner", "turn": ev.turn, "calls": calls,
                                     "forced_final": ev.forced_final}, **usage_null)
            elif isinstance(ev, SubAgentEvent):
                r = ev.record
                yield chunk(cid, created, name, {},
                             paravt={"event": "subagent", "turn": ev.turn, "index": r.index, "agent": r.agent,
                                     "tool": r.name,
                                     "window": r.window, "summary": r.summary, "error": view.text(r.error or "")
                                     or None,
                                     "latency": round(r.latency, 4)}, **usage_null)
            elif isinstance(ev, MemoryEvent):  # the collaborative mode: an agent's round, as it finishes
                yield chunk(cid, created, name, {}, paravt=event_json(ev), **usage_null)
            elif isinstance(ev, AnswerEvent):
                tr = ev.answer.trace
                svc.latencies.append(tr.latency)
                failed = run_failure(tr, settings.degraded)
                if failed is not None:  # OpenAI's in-stream error: no content, no finish reason
                    body = {**view.error(failed).body(), "paravt": view.data(extension_of(tr))}
                    yield f"data: {json.dumps(body)}\n\n"
                    continue
                yield chunk(cid, created, name, {"content": ev.answer.text}, **usage_null)
                yield chunk(cid, created, name, {}, "stop", paravt={"event": "answer", **view.data(extension_of(tr))},
                             **usage_null)
                if q.include_usage:  # OpenAI: one more chunk, no choices, the whole request's usage
                    yield chunk(cid, created, name, None, usage=usage_of(tr))
        if not producer.cancelled():
            yield "data: [DONE]\n\n"
    finally:
        if watcher is not None:
            watcher.cancel()
        # cancelled once; not gather(): a torn-down response's task is cancelled again and again, and
        # gather would pass each of those on, interrupting LangGraph while it cancels its node tasks
        producer.cancel()
        await asyncio.wait({producer})
