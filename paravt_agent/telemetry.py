"""OpenTelemetry spans of a question, named and attributed after the GenAI semantic conventions.

One trace per question::
    invoke_agent paravt                      the question (gen_ai.operation.name = invoke_agent)
    ├── paravt.overview                      decoding the overview frames (a run that starts from a question)
    ├── paravt.planner_turn                  one planner turn (paravt.turn, paravt.tool_calls)
    │   ├── chat <model>                     its policy call (gen_ai.usage.input_tokens / output_tokens ...)
    │   ├── execute_tool crop_video          each call it dispatched (gen_ai.tool.name, gen_ai.tool.call.id)
    │   │   └── invoke_agent paravt.subagent the sub-agent that inspects the window
    │   │       └── chat <model>             its policy call
    │   └── ...
    └── paravt.planner_turn                  the answering turn
        └── chat <model>

Parents travel in the graph's state as W3C ``traceparent`` strings (plain data: a checkpoint keeps them and a
resumed run goes on in the same trace), so the tree does not depend on which task LangGraph runs a node in.
A tool call's span is a child of the turn that dispatched it, and starts when the tool runs (after that
turn's span ended). Latency is each span's duration. Where no span can stay open for the whole question, the
question's span covers its first step only and the rest still hangs under it: a LangGraph Server run (the
``overview`` node opens it), a run resumed after a crash or after a ``review_windows`` pause (its outcome
attributes, set at the answer, are then missing).

Off by default and free when off: with no tracer provider configured (OpenTelemetry's default, or
``opentelemetry-api`` not installed) no span or attribute is built. An application configures its own
provider and exporter; the CLI and ``paravt api`` configure one from the standard environment
(``OTEL_TRACES_EXPORTER=otlp|console``, ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SERVICE_NAME``; see
:func:`configure_from_env`). The question and answer text (``gen_ai.input.messages`` /
``gen_ai.output.messages``) are recorded only with ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Any

from paravt_agent.errors import ConfigError

__all__ = ["capture_content", "configure_from_env", "enabled", "span", "traceparent"]

_TRUE = ("1", "true", "yes", "on")


def _trace_api():
    try:
        from opentelemetry import trace
    except ImportError:  # pragma: no cover - opentelemetry-api comes with langgraph's dependencies
        return None
    return trace


def enabled() -> bool:
    """True when a real tracer provider is configured (checked per call: an app may set one at any time)."""
    trace = _trace_api()
    if trace is None:
        return False
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def capture_content() -> bool:
    """The operator's opt-in to recording question and answer text on spans (the GenAI conventions' switch)."""
    return os.environ.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "").strip().lower() in _TRUE


def traceparent(sp) -> str | None:
    """A span as a W3C ``traceparent`` string (None for no span)."""
    if sp is None:
        return None
    c = sp.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def trace_id(parent: str | None) -> str | None:
    """The 32-hex trace id of a ``traceparent`` string."""
    return parent.split("-")[1] if parent else None


def _context(parent: str | None):
    if not parent:
        return None  # the current context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": parent})


@contextmanager
def span(name: str, parent: str | None = None, attributes: dict[str, Any] | None = None, *,
         current: bool = True):
    """A span named ``name`` under ``parent`` (a ``traceparent``; None: the current span), or ``None`` when
    tracing is off. ``current`` makes it the current span inside the block (for spans nested in the same
    coroutine, e.g. a policy call in a planner turn). An exception marks it as an error and propagates."""
    if not enabled():
        yield None
        return
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    tracer = trace.get_tracer("paravt")
    attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
    if current:
        cm = tracer.start_as_current_span(name, context=_context(parent), attributes=attrs,
                                          record_exception=True, set_status_on_exception=True)
        with cm as sp:
            yield sp
        return
    sp = tracer.start_span(name, context=_context(parent), attributes=attrs)
    try:
        yield sp
    except Exception as exc:  # a consumer that stops early or a cancellation is no error (as use_span has it)
        sp.record_exception(exc)
        sp.set_status(Status(StatusCode.ERROR, f"{exc.__class__.__name__}: {exc}"))
        raise
    finally:
        sp.end()


def set_attributes(sp, attributes: dict[str, Any]) -> None:
    """Attributes on ``sp`` (nothing when tracing is off); None values are left out."""
    if sp is not None:
        sp.set_attributes({k: v for k, v in attributes.items() if v is not None})


def messages_attr(role: str, text: str) -> str:
    """A one-message ``gen_ai.input.messages`` / ``gen_ai.output.messages`` value (JSON, as the conventions
    record structured values on spans)."""
    return json.dumps([{"role": role, "parts": [{"type": "text", "content": text}]}], ensure_ascii=False)


def generation_attributes(policy, sampling, gen=None) -> dict[str, Any]:
    """A policy call's GenAI attributes: the request, and when ``gen`` is given, its usage."""
    attrs = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": getattr(policy, "name", None),
             "gen_ai.request.model": model_name(policy), "gen_ai.request.temperature": sampling.temperature,
             "gen_ai.request.top_p": sampling.top_p, "gen_ai.request.max_tokens": sampling.max_new_tokens}
    if gen is not None:
        attrs.update(usage_attributes(gen.prompt_tokens, gen.completion_tokens))
        attrs["paravt.batch_size"] = gen.batch_size
    return attrs


def usage_attributes(prompt_tokens: int | None, completion_tokens: int | None) -> dict[str, Any]:
    return {"gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.usage.output_tokens": completion_tokens}


def model_name(policy) -> str:
    """The served model's name as a span names it: the endpoint's model id or the model directory's name."""
    for attr in ("model", "path"):
        value = getattr(policy, attr, None)
        if isinstance(value, str) and value:
            return os.path.basename(value.rstrip("/")) or value
    return getattr(policy, "name", "policy")


def configure_from_env() -> bool:
    """Install a tracer provider from the standard environment when none is set and the operator named an
    exporter (``OTEL_TRACES_EXPORTER``: ``otlp`` = OTLP over HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT``,
    ``console`` = spans printed as JSON; comma-separated for several). Returns True when tracing is on."""
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if enabled() or not names or names == ["none"]:
        return enabled()

    unknown = [n for n in names if n not in ("otlp", "console")]
    if unknown:
        raise ConfigError(f"OTEL_TRACES_EXPORTER={','.join(unknown)}: paravt configures otlp or console (another "
                          "exporter: configure the tracer provider in your application)")
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

        if "otlp" in names:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ConfigError(f"OTEL_TRACES_EXPORTER={','.join(names)} needs the OpenTelemetry SDK and exporter: pip "
                          "install 'paravt[telemetry]'") from exc
    # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES are read by Resource.create; "paravt" only where neither names it
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "paravt"}))
    for name in names:
        # OTLP over HTTP reads OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT / _HEADERS itself
        exporter = ConsoleSpanExporter() if name == "console" else OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True
