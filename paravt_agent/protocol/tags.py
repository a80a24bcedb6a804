"""The protocol's tags, and text made safe to put between them (:func:`neutralize`): tool output and memory
are data, never protocol."""

from __future__ import annotations

import re

__all__ = ["neutralize"]

_PROTOCOL_TAG_RE = re.compile(r"<(/?)(think|answer|tool_call|tool_code|tool_response)>|<\|([A-Za-z_]+)\|>", re.I)


def neutralize(text: str) -> str:
    """Tool output as data: protocol tags (``<answer>``, ``</think>``, ``<tool_call>``, ...) and chat-template
    control tokens (``<|im_end|>``) are escaped (``&lt;answer&gt;``), so text a tool read from a user's
    file or a sub-agent wrote can neither earn a reward nor forge a turn. Everything else is kept."""

    def esc(m: re.Match) -> str:
        return "&lt;" + m.group(0)[1:-1] + "&gt;"

    return _PROTOCOL_TAG_RE.sub(esc, text)
