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
- ``POST /v1/feedback``: ``{"trace_id", "answer"?, "reward"?, "thumbs"?, "note"?, "user"?}`` into the trajectory
  store (online learning: ``paravt-train online`` reads it). The label counts for the caller's *principal*, the
  owner of its API key (``--keys``: :mod:`~paravt_agent.serving.keys`); ``user`` is a sub-label within it, never a
  voter of its own. Without ``--keys`` every caller is one principal.
- ``GET /v1/models``, ``GET /health``.

Admission: at most ``max_concurrent`` questions run at once (the local backend batches their model
calls) and ``max_queue`` more wait; beyond that a request is answered 429 with ``Retry-After`` at once,
never left hanging. A client that disconnects cancels its question (its sub-agents stop). Local paths
must lie under ``video_root`` (no root: local paths are refused); ``file://`` is refused; http(s)
videos are downloaded with a size and a time limit.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import statistics
from collections import deque

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from paravt_agent.agent import Agent
from paravt_agent.errors import StoreError
from paravt_agent.serving.keys import KeyRing
from paravt_agent.serving.redact import ClientView
from paravt_agent.serving.request import ApiError, ApiSettings, parse_request, resolve_video
from paravt_agent.serving.responses import run_failure
from paravt_agent.serving.routes import ServerState, router

__all__ = ["AgentService", "ApiError", "ApiSettings", "create_app", "parse_request", "principal_warning",
           "resolve_video", "run_failure", "serve"]

log = logging.getLogger("paravt.api")

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
    """The FastAPI application serving ``agent`` (run it with uvicorn; ``paravt api`` does): the routes of
    :mod:`~paravt_agent.serving.routes`, OpenAI-shaped errors, and the API-key and size guard."""
    settings = settings or ApiSettings()
    ring = KeyRing(settings.api_key, settings.keys, agent.store)
    app = FastAPI(title="ParaVT agent API", version="1", docs_url=None, redoc_url=None)
    state: dict[str, AgentService] = {}

    def service() -> AgentService:
        if "svc" not in state:  # created on the server's loop (its semaphore belongs there)
            state["svc"] = AgentService(agent, settings)
        return state["svc"]

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        exc = ClientView(settings).error(exc)  # a last guard: no path of this server in any error
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):  # a bug of ours: still an OpenAI-shaped error
        log.error("internal error answering %s", request.url.path, exc_info=exc)  # the details stay here
        err = ApiError(500, f"internal error ({exc.__class__.__name__}); the server's log has the details",
                       kind="server_error", code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    app.add_middleware(_Guard, settings=settings, ring=ring)
    app.state.paravt = ServerState(agent, settings, service)
    app.state.service = service
    app.include_router(router)
    return app


class _Guard:
    """Pure ASGI (BaseHTTPMiddleware would hide client disconnects from the handlers): the API key — the caller's
    principal, which the handlers read as ``request.state.principal`` — and the declared request size, checked
    before a handler runs."""

    def __init__(self, app, settings: ApiSettings, ring: KeyRing):
        self.app, self.settings, self.ring = app, settings, ring

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            err, extra = None, {}
            given = headers.get("authorization", "")
            token = given[7:].strip() if given.lower().startswith("bearer ") else ""
            try:
                principal = (self.ring.principal(token) if self.ring.store is None
                             else await asyncio.to_thread(self.ring.principal, token))
            except StoreError as exc:
                principal, err = None, ApiError(503, f"cannot check the API key: {exc}", kind="server_error",
                                                code="store_unavailable")
            if principal is None and err is None:
                err = ApiError(401, "missing or wrong API key (Authorization: Bearer ...)",
                               kind="authentication_error", code="invalid_api_key")
                extra = {"WWW-Authenticate": "Bearer"}
            scope.setdefault("state", {})["principal"] = principal
            size = headers.get("content-length", "")
            if err is None and size.isdigit() and int(size) > self.settings.max_request_bytes:
                err = ApiError(413, f"the request is over {self.settings.max_request_bytes} bytes", code="too_large")
            if err is not None:
                await JSONResponse(err.body(), status_code=err.status, headers=extra)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def principal_warning(agent: Agent, settings: ApiSettings) -> str | None:
    """What a server that keeps feedback without ``--keys`` must say at start: its callers are one voter."""
    if agent.store is None or settings.keys:
        return None
    return (f"feedback counts for {KeyRing(settings.api_key).describe()}: without --keys mapping API keys to "
            "principals the online learner sees one voter (one quorum seat, one per-voter cap); a request's `user` "
            "is a sub-label, never a voter")


def serve(agent: Agent, settings: ApiSettings, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Run the endpoint with uvicorn until interrupted."""
    import uvicorn

    if host not in ("127.0.0.1", "localhost", "::1") and not (settings.api_key or settings.keys):
        print(f"warning: serving on {host} without --api-key or --keys: anyone who reaches this port can use the "
              "agent", flush=True)
    if (warning := principal_warning(agent, settings)) is not None:
        print(f"warning: {warning}", flush=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    uvicorn.run(create_app(agent, settings), host=host, port=port, log_level=log_level, timeout_keep_alive=30)
