"""The answer side of the text protocol: what a response answers, how its tags are balanced, which option
letter names. Pure functions, no I/O; linear time on adversarial input. :func:`extract_answer` is the one answer
extractor (the paper's three-level fallback), :func:`tag_stats` the one structural check."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LETTERS", "TAGS", "TagStat", "extract_answer", "extract_choice", "is_degenerate", "labelled_options",
           "split_options", "option_body", "split_think", "strip_tool_blocks", "subagent_report", "tag_stats"]


#: the tags a response may use
TAGS = ("think", "tool_call", "tool_code", "answer")

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


_OPTION_LINE = re.compile(r"^\s*\(?([A-Z])[\)\.:]\s*(.+?)\s*$")
_OPTIONS_HEADER = re.compile(r"^\s*(options|choices)\s*:?\s*$", re.IGNORECASE)


def split_options(text: str, anywhere: bool = False) -> tuple[str, list[str] | None]:
    """MCQ options written into a question: lines ``A. ...``, ``(B) ...``, ``C: ...`` lettered A, B, C, ... in
    order (at least two) become the options, and leave the text. ``anywhere=False`` takes only trailing lines
    (the API's rule: a question that merely mentions "A." keeps its text); ``anywhere=True`` takes the first
    such block wherever it is (a benchmark prompt with an instruction after its options), with an
    ``Options:`` line just above it. Without such a block: ``(text, None)``."""
    lines = text.rstrip().splitlines()
    starts = [i for i, ln in enumerate(lines) if (m := _OPTION_LINE.match(ln)) and m.group(1) == "A"]
    if not anywhere:
        starts = starts[-1:]
    for i in starts:
        opts, j = [], i
        while j < len(lines) and (m := _OPTION_LINE.match(lines[j])) and m.group(1) == chr(ord("A") + len(opts)):
            opts.append(m.group(2))
            j += 1
        if len(opts) < 2 or (not anywhere and j != len(lines)):
            continue
        head = i - 1 if i > 0 and _OPTIONS_HEADER.match(lines[i - 1]) else i
        return "\n".join([*lines[:head], *lines[j:]]).strip(), opts
    return text.strip(), None
