"""Times in the text protocol: seconds from what a model or a user writes (:func:`parse_time`), times as the
prompts show them (:func:`format_time`), and time spans in answers (:func:`parse_span`). Pure functions, linear in
their input, never raising on what a model wrote except ``parse_time``'s documented ``ValueError``."""

from __future__ import annotations

import re

__all__ = ["MAX_SECONDS", "format_time", "parse_span", "parse_time"]

#: Largest time in seconds a call may name (a 100-year video).
MAX_SECONDS = 3.2e9


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


