"""What ``paravt api`` answers: an answer as an OpenAI chat completion (``paravt`` extension included), a stream
chunk, and the HTTP error of a run that failed (or, with ``--degraded error``, of a degraded answer)."""

from __future__ import annotations

import json
import re

from paravt_agent.errors import ConfigError, ParaVTError, PolicyError, PromptTooLong, VideoError
from paravt_agent.serving.request import ApiError
from paravt_agent.trajectory import Trace

__all__ = ["as_api_error", "chunk", "extension_of", "run_failure", "think_of", "usage_of"]


def usage_of(trace: Trace) -> dict:
    prompt, completion = trace.prompt_tokens, trace.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def extension_of(trace: Trace) -> dict:
    calls = [{"turn": t.turn, "index": c.index, "tool": c.name, "window": c.window, "summary": c.summary,
              "error": c.error, "latency": round(c.latency, 4), "batch_size": c.batch_size}
             for t in trace.turns for c in t.calls]
    return {"trace_id": trace.id, "otel_trace_id": trace.otel_trace_id, "choice": trace.choice, "span": trace.span,
            "ok": trace.ok, "status": trace.status, "failed_calls": trace.failed_calls, "errors": trace.errors,
            "warnings": trace.warnings, "turns": len(trace.turns), "calls": calls,
            "planner_batch_sizes": [t.batch_size for t in trace.turns],
            "latency": round(trace.latency, 4)}


def think_of(text: str) -> str:
    m = re.search(r"<think>(.*?)(?:</think>|$)", text, re.S)
    return (m.group(1) if m else text).strip()


def chunk(cid: str, created: int, model: str, delta: dict | None, finish: str | None = None, **extra) -> str:
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


def as_api_error(exc: ParaVTError) -> ApiError:
    if isinstance(exc, VideoError | ConfigError):
        return ApiError(400, str(exc), code="invalid_video" if isinstance(exc, VideoError) else "invalid_config")
    if isinstance(exc, PromptTooLong):
        return ApiError(400, str(exc), code="prompt_too_long")
    if isinstance(exc, PolicyError):
        if exc.transient:
            return ApiError(503, str(exc), kind="server_error", code="model_unavailable", headers={"Retry-After": "5"})
        return ApiError(502, str(exc), kind="server_error", code="model_error")
    return ApiError(400, str(exc))
