"""Tool calls in model output: :func:`parse_tool_calls` is the one parser (what the agent runs is exactly what
RL rewards as parseable, ARCHITECTURE.md decision 7), :func:`render_tool_call` writes one.

Model output is untrusted input: every parser here runs in time linear in its
input (no regular expression that backtracks over long runs of spaces or digits;
tested on adversarial inputs of 100k characters), never raises on what a model
wrote (a call that cannot be parsed becomes a :class:`CallError`), and bounds its
work (at most :data:`MAX_CALLS` call blocks, :data:`MAX_CALL_CHARS` characters
each, numbers of at most 15 digits).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from paravt_agent.protocol.times import parse_time

__all__ = ["CALL_TAGS", "DEFAULT_SIGNATURES", "MAX_CALLS", "MAX_CALL_CHARS", "CallError", "ToolCall",
           "parse_tool_calls", "render_tool_call"]

CALL_TAGS = ("tool_call", "tool_code")

#: Call blocks parsed per response; the rest are reported in one error.
MAX_CALLS = 64
#: Characters of one call block; a longer block is an error, never parsed.
MAX_CALL_CHARS = 8192
#: Positional parameter names of tools, for python-call style ``crop_video("v.mp4", 80, 150)``.
DEFAULT_SIGNATURES: dict[str, list[str]] = {"crop_video": ["video_path", "start_time", "end_time"]}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``name`` and ``arguments`` as written (validation is the tool's job)."""

    name: str
    arguments: dict = field(default_factory=dict)
    raw: str = ""
    style: str = "json"  # json | flat | python
    tag: str = "tool_call"
    closed: bool = True

    @property
    def ok(self) -> bool:
        return True


@dataclass(frozen=True)
class CallError:
    """A call block that could not be parsed; its slot gets ``message``."""

    message: str
    raw: str = ""
    tag: str = "tool_call"
    closed: bool = True

    @property
    def ok(self) -> bool:
        return False


# --------------------------------------------------------------------------- tool calls


_OPEN_RE = re.compile(r"<(tool_call|tool_code)>")


def _blocks(text: str):
    """``(tag, body, closed, raw)`` for every tool block in order; an unclosed block runs to the next opening
    or the end. One left-to-right scan: linear in the text."""
    opens = list(_OPEN_RE.finditer(text))
    for k, m in enumerate(opens):
        tag = m.group(1)
        limit = opens[k + 1].start() if k + 1 < len(opens) else len(text)
        close = text.find(f"</{tag}>", m.end(), limit)
        if close >= 0:
            yield tag, text[m.end():close], True, text[m.start():close + len(tag) + 3]
        else:
            yield tag, text[m.end():limit], False, text[m.start():limit]


def _clean_body(body: str) -> str:
    body = body.strip()
    if body.startswith("```"):  # a code fence: drop the opening line and the closing fence
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.strip().rsplit("```", 1)[0].strip()
    # a bare language word on its own first line: "python\ncrop_video(...)"
    first, _, rest = body.partition("\n")
    if rest and first.strip().lower() in {"python", "py", "json", "tool_code"}:
        body = rest.strip()
    return body


def _from_mapping(obj: Mapping, raw: str, tag: str, closed: bool) -> ToolCall | CallError:
    if "function" in obj and isinstance(obj["function"], Mapping):  # OpenAI {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name", obj.get("tool_name", obj.get("tool")))
    if not isinstance(name, str) or not name.strip():
        return CallError("tool call has no tool name (expected a 'name' field)", raw, tag, closed)
    if "arguments" in obj or "parameters" in obj or "args" in obj:
        args = obj.get("arguments", obj.get("parameters", obj.get("args")))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                return CallError(f"arguments of {name} are not valid JSON: {exc.msg}", raw, tag, closed)
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            return CallError(f"arguments of {name} must be an object, got {type(args).__name__}", raw, tag, closed)
        return ToolCall(name.strip(), dict(args), raw, "json", tag, closed)
    flat = {k: v for k, v in obj.items() if k not in {"name", "tool_name", "tool"}}
    return ToolCall(name.strip(), flat, raw, "flat", tag, closed)


def _json_objects(body: str) -> tuple[list, bool] | None:
    """``(values, malformed)``: successive JSON values in ``body`` (JSON, else Python literal
    syntax), and whether some text failed to parse; None if ``body`` is not JSON-like."""
    if not body or body[0] not in "{[":
        return None
    dec = json.JSONDecoder()
    out: list = []
    pos = 0
    while pos < len(body):
        while pos < len(body) and body[pos] in " \t\r\n,;":
            pos += 1
        if pos >= len(body):
            break
        try:
            value, pos = dec.raw_decode(body, pos)
        except json.JSONDecodeError:
            try:  # single quotes, True/False/None (JSON values only: no ..., bytes, sets, complex numbers)
                value = _json_value(ast.literal_eval(body[pos:]))
                pos = len(body)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, OverflowError):
                return out, True
        except (ValueError, RecursionError, OverflowError, MemoryError):  # huge numbers, deep nesting
            return out, True
        out.extend(value if isinstance(value, list) else [value])
    return out, False


def _json_value(value):
    """``value`` as a JSON value (a tuple becomes a list); ``TypeError`` for what JSON has not: ``...`` (Python's
    Ellipsis), bytes, sets, complex numbers, non-string keys. A call carrying one is an invalid call, answered as
    such, never an argument the episode cannot serialise."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("object keys must be strings")
        return {k: _json_value(v) for k, v in value.items()}
    raise TypeError(f"{'...' if value is Ellipsis else type(value).__name__} is not a JSON value")


def _literal(node: ast.AST):
    if isinstance(node, ast.Constant):
        return _json_value(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _literal(node.operand)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return -v if isinstance(node.op, ast.USub) else v
    return _json_value(ast.literal_eval(node))


def _time_like(value) -> bool:
    try:
        parse_time(value)
    except ValueError:
        return False
    return True


def _python_calls(body: str, signatures: Mapping[str, Sequence[str]], raw, tag, closed):
    try:
        tree = ast.parse(body.strip(), mode="exec")
    except SyntaxError as exc:
        return [CallError(f"tool call is neither JSON nor a Python call ({exc.msg})", raw, tag, closed)]
    except (ValueError, RecursionError, MemoryError, OverflowError) as exc:  # huge numbers, deep nesting
        return [CallError(f"tool call cannot be parsed ({exc.__class__.__name__})", raw, tag, closed)]
    calls = []
    for stmt in tree.body:
        node = stmt.value if isinstance(stmt, ast.Expr | ast.Assign) else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print" and node.args:
            node = node.args[0]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name is None:
            calls.append(CallError("tool call names no function", raw, tag, closed))
            continue
        try:
            pos = [_literal(a) for a in node.args]
            kw = {k.arg: _literal(k.value) for k in node.keywords if k.arg}
        except (ValueError, TypeError, SyntaxError) as exc:
            why = f" ({exc})" if isinstance(exc, TypeError) else ""
            calls.append(CallError(f"arguments of {name} must be JSON literals{why}", raw, tag, closed))
            continue
        params = [p for p in signatures.get(name, []) if p not in kw]
        if params and params[0] == "video_path" and (not pos or _time_like(pos[0])):
            params = params[1:]  # crop_video(80, 150): the video is implied
        if name not in signatures and pos:  # unknown tool: keep what was written, the registry reports it
            calls.append(ToolCall(name, {**kw, "_positional": pos}, raw, "python", tag, closed))
            continue
        if len(pos) > len(params):
            calls.append(CallError(f"{name} takes at most {len(params)} positional arguments", raw, tag, closed))
            continue
        args = dict(zip(params, pos, strict=False))
        args.update(kw)
        calls.append(ToolCall(name, args, raw, "python", tag, closed))
    if not calls:
        return [CallError("tool call block holds no call", raw, tag, closed)]
    return calls


def parse_tool_calls(
    text: str, signatures: Mapping[str, Sequence[str]] | None = None
) -> list[ToolCall | CallError]:
    """Every tool call in ``text``, in order; each a :class:`ToolCall` or a :class:`CallError`.

    Accepts ``<tool_call>`` and ``<tool_code>`` blocks (an unclosed final block
    too) holding Hermes/Qwen JSON (``{"name", "arguments"}``, arguments possibly a
    JSON string), flat JSON (``{"tool_name": ..., <args>}``), or Python calls
    (``crop_video("v.mp4", 80, 150)``, keywords, wrapped in ``print(...)``,
    fenced in a code block). One bad block never hides the good ones.
    """
    sigs = DEFAULT_SIGNATURES if signatures is None else signatures
    out: list[ToolCall | CallError] = []
    skipped = 0
    for tag, body, closed, raw in _blocks(text):
        if len(out) >= MAX_CALLS:
            skipped += 1
            continue
        if len(body) > MAX_CALL_CHARS:
            out.append(CallError(f"tool call block of {len(body)} characters is too long (at most "
                                 f"{MAX_CALL_CHARS})", raw[:200], tag, closed))
            continue
        body = _clean_body(body)
        if not body:
            out.append(CallError("empty tool call block", raw, tag, closed))
            continue
        try:
            out.extend(_parse_block(body, sigs, raw, tag, closed))
        except (ValueError, TypeError, RecursionError, MemoryError, OverflowError) as exc:  # never raise on output
            out.append(CallError(f"tool call cannot be parsed ({exc.__class__.__name__})", raw[:200], tag, closed))
    if len(out) > MAX_CALLS:
        skipped += len(out) - MAX_CALLS
        out = out[:MAX_CALLS]
    if skipped:
        out.append(CallError(f"{skipped} more tool call blocks not parsed (at most {MAX_CALLS} per response)", "",
                             "tool_call", True))
    return out


def _parse_block(body: str, sigs, raw: str, tag: str, closed: bool) -> list[ToolCall | CallError]:
    parsed = _json_objects(body)
    if parsed is None:
        return _python_calls(body, sigs, raw, tag, closed)
    objs, malformed = parsed
    out: list[ToolCall | CallError] = []
    for obj in objs:
        if isinstance(obj, Mapping):
            out.append(_from_mapping(obj, raw, tag, closed))
        else:
            out.append(CallError(f"tool call must be a JSON object, got {type(obj).__name__}", raw, tag, closed))
    if malformed:
        out.append(CallError("tool call JSON is malformed (unbalanced braces or bad syntax)", raw, tag, closed))
    return out


def render_tool_call(name: str, arguments: Mapping) -> str:
    """The canonical form the prompts teach: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False) + "</tool_call>"

