"""The text protocol shared by the runtime, the reward and evaluation. Pure functions, no I/O.

What the agent accepts at deployment is exactly what RL rewards as parseable
(ARCHITECTURE.md, decision 7): :func:`parse_tool_calls` is the one parser,
:func:`extract_answer` the one answer extractor (the paper's three-level
fallback), :func:`tag_stats` the one structural check.

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

__all__ = [
    "CallError",
    "DEFAULT_SIGNATURES",
    "LETTERS",
    "TAGS",
    "TagStat",
    "ToolCall",
    "extract_answer",
    "extract_choice",
    "format_time",
    "is_degenerate",
    "labelled_options",
    "option_body",
    "parse_span",
    "parse_time",
    "parse_tool_calls",
    "render_tool_call",
    "split_think",
    "subagent_report",
    "strip_tool_blocks",
    "tag_stats",
]

TAGS = ("think", "tool_call", "tool_code", "answer")
CALL_TAGS = ("tool_call", "tool_code")

#: Call blocks parsed per response; the rest are reported in one error.
MAX_CALLS = 64
#: Characters of one call block; a longer block is an error, never parsed.
MAX_CALL_CHARS = 8192
#: Largest time in seconds a call may name (a 100-year video).
MAX_SECONDS = 3.2e9

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


# --------------------------------------------------------------------------- times


_TIME_RE = re.compile(r"^(?:(\d{1,6}):)?(\d{1,2}):(\d{1,2}(?:\.\d{1,6})?)$")
_NUM_RE = re.compile(r"^([-+]?\d{1,15}(?:\.\d{1,9})?|[-+]?\.\d{1,9})\s?(?:s|sec|secs|second|seconds)?$", re.I)


def _short(value, n: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def parse_time(value) -> float:
    """Seconds from a number, a numeric string (``"80"``, ``"80.5s"``), ``MM:SS`` or ``HH:MM:SS``.

    Raises ``ValueError`` for anything else, including numbers no video has (non-finite, beyond
    :data:`MAX_SECONDS`) and strings of more than 40 characters."""
    if isinstance(value, bool):
        raise ValueError(f"not a time: {value!r}")
    if isinstance(value, int):
        if abs(value) > MAX_SECONDS:
            raise ValueError(f"not a time: {_short(value)} is beyond any video")
        return float(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")) or abs(value) > MAX_SECONDS:
            raise ValueError(f"not a finite time: {_short(value)}")
        return value
    if isinstance(value, str) and len(value) <= 40:
        v = value.strip()
        m = _NUM_RE.match(v)
        if m:
            return parse_time(float(m.group(1)))
        m = _TIME_RE.match(v)
        if m:
            h, mm, ss = m.groups()
            return int(h or 0) * 3600 + int(mm) * 60 + float(ss)
    raise ValueError(f"not a time: {_short(value)} (use seconds, MM:SS or HH:MM:SS)")


def format_time(seconds: float) -> str:
    """``MM:SS`` (``H:MM:SS`` past an hour), as the prompts show times."""
    s = max(0, round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


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
            try:  # single quotes, True/False/None
                value = ast.literal_eval(body[pos:])
                pos = len(body)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, OverflowError):
                return out, True
        except (ValueError, RecursionError, OverflowError, MemoryError):  # huge numbers, deep nesting
            return out, True
        out.extend(value if isinstance(value, list) else [value])
    return out, False


def _literal(node: ast.AST):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _literal(node.operand)
        if isinstance(v, int | float):
            return -v if isinstance(node.op, ast.USub) else v
    return ast.literal_eval(node)


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
        except (ValueError, TypeError, SyntaxError):
            calls.append(CallError(f"arguments of {name} must be literals", raw, tag, closed))
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


# --------------------------------------------------------------------------- answers and tags


_TOOL_BLOCKS_RE = re.compile(r"<(tool_call|tool_code|tool_response)>.*?(?:</\1>|\Z)", re.S)
_ANY_TAG_RE = re.compile(r"</?(?:think|answer|tool_call|tool_code|tool_response)>")


def strip_tool_blocks(text: str) -> str:
    """``text`` without tool call / tool code / tool response blocks (closed or running to the end)."""
    return _TOOL_BLOCKS_RE.sub("", text)


def split_think(text: str) -> tuple[str, str]:
    """``(reasoning, rest)``: the first ``<think>`` body and what follows ``</think>`` (rest empty if unclosed)."""
    start = text.find("<think>")
    body_from = start + len("<think>") if start >= 0 else 0
    end = text.find("</think>", body_from)
    if end < 0:
        return text[body_from:].strip() if start >= 0 else "", "" if start >= 0 else text
    return text[body_from:end].strip(), text[end + len("</think>") :]


def subagent_report(text: str, mode: str = "full") -> str:
    """What the planner reads of a sub-agent's reply ``text`` (``AgentConfig.subagent_report``): all of it, or
    for ``answer`` what follows its first ``</think>`` (all of it when it closed none, or nothing follows)."""
    text = text.strip()
    if mode == "answer":
        end = text.find("</think>")
        rest = text[end + len("</think>") :].strip() if end >= 0 else ""
        return rest or text
    return text


def extract_answer(text: str) -> str:
    """The paper's three-level fallback.

    1. the body of the last ``<answer>`` block (an unclosed final one runs to the end);
    2. otherwise the text after the last ``</think>`` with tool blocks removed;
    3. otherwise the last non-empty line.
    """
    if not text:
        return ""
    opened = text.rfind("<answer>")
    if opened >= 0:
        body = text[opened + len("<answer>") :]
        close = body.find("</answer>")
        body = body[:close] if close >= 0 else body
        body = _ANY_TAG_RE.sub("", body).strip()
        if body:
            return body
    closed = text.rfind("</think>")
    if closed >= 0:
        rest = _ANY_TAG_RE.sub("", strip_tool_blocks(text[closed + len("</think>") :])).strip()
        if rest:
            return rest
    for line in reversed(_ANY_TAG_RE.sub("", strip_tool_blocks(text)).splitlines()):
        if line.strip():
            return line.strip()
    for line in reversed(_ANY_TAG_RE.sub("", text).splitlines()):
        if line.strip():
            return line.strip()
    return ""


@dataclass(frozen=True)
class TagStat:
    opened: int
    closed: int
    balanced: bool  # every open has a later close, no stray close, no nesting
    first_closed: bool  # the first opening tag is closed later

    @property
    def present(self) -> bool:
        return self.opened > 0 or self.closed > 0


def tag_stats(text: str, tags: Sequence[str] = TAGS) -> dict[str, TagStat]:
    """Opened / closed / balanced counts per structural tag."""
    out = {}
    for tag in tags:
        depth, balanced = 0, True
        events = re.finditer(rf"<(/?){tag}>", text)
        opened = closed = 0
        first_open = None
        first_closed = False
        for m in events:
            if m.group(1):
                closed += 1
                if depth == 0:
                    balanced = False
                else:
                    depth -= 1
                    if first_open is not None and depth == 0 and not first_closed:
                        first_closed = True
            else:
                opened += 1
                if first_open is None:
                    first_open = m.start()
                if depth > 0:
                    balanced = False
                depth += 1
        if depth:
            balanced = False
        out[tag] = TagStat(opened, closed, balanced, first_closed)
    return out


_IM_START = "<|im_start|>"


def is_degenerate(text: str, count: int = 5, window: int = 300) -> bool:
    """True when ``count`` or more ``<|im_start|>`` fall within ``window`` characters (a chat-template loop)."""
    pos = [m.start() for m in re.finditer(re.escape(_IM_START), text)]
    return any(pos[i + count - 1] - pos[i] + len(_IM_START) <= window for i in range(len(pos) - count + 1))


# --------------------------------------------------------------------------- MCQ letters and time spans


#: The MCQ letters, in option order (one table for prompts, answers, rewards and evaluation).
LETTERS = "ABCDEFGHIJ"
_LABEL_RE = re.compile(r"^\s*\(?([A-J])[.):]\s*")


def option_body(option: str) -> str:
    """An option's text without a leading letter label (``"B. a cat"`` -> ``"a cat"``)."""
    return _LABEL_RE.sub("", option, count=1)


def labelled_options(options: Sequence[str]) -> list[str]:
    """Options as the prompts show them, ``"A. text"``: an option already labelled with a letter is kept."""
    if len(options) > len(LETTERS):
        raise ValueError(f"at most {len(LETTERS)} options, got {len(options)}")
    return [o if _LABEL_RE.match(o) else f"{LETTERS[i]}. {o}" for i, o in enumerate(options)]

_ALONE_RE = re.compile(r"\)?\*{0,2}\s*(?:$|[.,;:!?)\]])")
_CHOICE_PATTERNS = [
    r"^\s*\(?\*{0,2}([A-J])\*{0,2}\)?\s*$",  # "B", "(B)", "**B**"
    r"^\s*\(?([A-J])\)?\s*[.:)\]]",  # "B. text", "B) text", "(B) text", "B: text"
    r"(?:final\s+)?answer\s*(?:is|:)?\s*(?:option\s*)?[:\s]*\(?\*{0,2}([A-J])\*{0,2}\)?(?![A-Za-z])",
    r"(?:option|choice)\s*\(?([A-J])\)?(?![A-Za-z])",
    r"\(([A-J])\)",
]


def extract_choice(text: str, options: Sequence[str] | None = None, letters: str = LETTERS) -> str | None:
    """The MCQ letter (A–J) a response picks, or None.

    Understands ``B``, ``(B)``, ``B.``, ``B) text``, ``Answer: B``, ``The answer is
    (B)``, ``option B``; with ``options`` given, also the text of an option.
    """
    if not text:
        return None
    # one space between words and no empty lines: the patterns' adjacent \s* then never backtrack over a run
    s = "\n".join(" ".join(line.split()) for line in text.splitlines() if line.strip())
    allowed = set(letters[: len(options)] if options else letters)
    for pat in _CHOICE_PATTERNS:
        for m in re.finditer(pat, s, re.I | re.M):
            letter = m.group(1).upper()
            # a lowercase letter is an English word ("is a cat", "I saw") unless it stands alone:
            # "answer: b", "option c." — followed by nothing but punctuation
            alone = pat in (_CHOICE_PATTERNS[2], _CHOICE_PATTERNS[3]) and _ALONE_RE.match(s, m.end(1))
            if m.group(1).islower() and not alone:
                continue
            if letter in allowed:
                return letter
    if options:
        norm = _norm(s)
        for i, opt in enumerate(options):
            body = option_body(opt)
            if body and _norm(body) == norm:
                return letters[i]
        for i, opt in enumerate(options):
            body = option_body(opt)
            if body and len(_norm(body)) > 2 and _norm(body) in norm:
                return letters[i]
    return None


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", s.lower()).strip()


# a time: numbers start where a digit run starts and have at most 12 digits (a run of 20,000 digits is tried
# once, not at every position), so matching is linear in the text
_T = r"(?<![\d.:])(\d{1,6}:\d{1,2}(?::\d{1,2})?(?:\.\d{1,6})?|\d{1,12}(?:\.\d{1,6})?)(?![\d:])"
_U = r"\s*(?:s|sec|secs|seconds?)?"
_SPAN_PATTERNS = [
    rf"\[\s*{_T}{_U}\s*,\s*{_T}{_U}\s*\]",
    rf"\(\s*{_T}{_U}\s*,\s*{_T}{_U}\s*\)",
    rf"from\s+{_T}{_U}\s+(?:to|until|till|-)\s+{_T}",
    rf"between\s+{_T}{_U}\s+and\s+{_T}",
    rf"{_T}{_U}\s*(?:-|–|—|to|until)\s*{_T}",
]


def parse_span(text: str) -> tuple[float, float] | None:
    """A time span ``(start, end)`` in seconds from ``[a, b]``, ``a - b``, ``a to b``,
    ``from a to b seconds``, ``between a and b``, with seconds or mm:ss; None if absent or inverted."""
    if not text:
        return None
    text = " ".join(text.split())  # one space between words: no backtracking over whitespace runs
    for pat in _SPAN_PATTERNS:
        for m in re.finditer(pat, text, re.I):
            try:
                a, b = parse_time(m.group(1)), parse_time(m.group(2))
            except ValueError:
                continue
            if b > a >= 0:
                return a, b
    return None
