"""``Trace``: everything one question went through, as JSON and as readable text."""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, Field

from paravt_agent.protocol import format_time

__all__ = ["MODEL_OUTPUT_ERRORS", "PlannerTurn", "SubAgentRecord", "Trace"]

#: How the errors about what the model wrote begin (see :meth:`Trace.run_errors`).
MODEL_OUTPUT_ERRORS = ("degenerate output:", "empty answer:")


class SubAgentRecord(BaseModel):
    """One tool call of a planner turn and what came back in its slot."""

    index: int
    raw: str = ""
    name: str | None = None
    arguments: dict = Field(default_factory=dict)
    label: str = ""
    window: tuple[float, float] | None = None
    frame_timestamps: list[float] = Field(default_factory=list)
    summary: str = ""
    evidence: str = "summary"  # summary (a sub-agent's text) | frames (the crop's frames went to the planner) | text
    error: str | None = None
    warnings: list[str] = Field(default_factory=list)
    latency: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    batch_size: int = 1  # how many model calls ran in the batch this one ran in (local backend)

    @property
    def slot_text(self) -> str:
        return f"error: {self.error}" if self.error else self.summary


class PlannerTurn(BaseModel):
    """One planner response and the calls it dispatched."""

    turn: int
    text: str
    reasoning: str = ""
    forced_final: bool = False
    latency: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    batch_size: int = 1
    calls: list[SubAgentRecord] = Field(default_factory=list)


class Trace(BaseModel):
    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    created: float = Field(default_factory=time.time)
    video: str = ""
    question: str = ""
    options: list[str] | None = None
    mode: str = "parallel"
    duration: float = 0.0
    overview_timestamps: list[float] = Field(default_factory=list)
    turns: list[PlannerTurn] = Field(default_factory=list)
    response: str = ""
    answer: str = ""
    choice: str | None = None
    span: tuple[float, float] | None = None
    errors: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)  # e.g. frames a damaged video could not give
    latency: float = 0.0

    @property
    def ok(self) -> bool:
        """An answer came back and nothing went wrong on the way (``errors`` says what did)."""
        return bool(self.answer.strip()) and not self.errors

    @property
    def run_errors(self) -> list[str]:
        """The errors of the run itself (an endpoint down, a timeout, a crash), without the notes about what
        the model wrote (an empty or degenerate answer): those are the model's doing, and RL must learn from
        them rather than drop them."""
        return [e for e in self.errors if not e.startswith(MODEL_OUTPUT_ERRORS)]

    @property
    def tool_calls(self) -> int:
        return sum(len(t.calls) for t in self.turns)

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens + sum(c.prompt_tokens for c in t.calls) for t in self.turns)

    @property
    def completion_tokens(self) -> int:
        return sum(t.completion_tokens + sum(c.completion_tokens for c in t.calls) for t in self.turns)

    def to_json(self, **kw) -> str:
        return self.model_dump_json(**kw)

    @classmethod
    def from_json(cls, data: str | bytes) -> Trace:
        return cls.model_validate_json(data)

    def render(self, width: int = 100) -> str:
        """A readable rendering: planner reasoning, each window and its summary, the answer."""

        def clip(s: str, n: int = width * 4) -> str:
            s = s.strip()
            return s if len(s) <= n else s[: n - 3] + "..."

        lines = [
            f"Question: {self.question}",
            *([f"Options: {' | '.join(self.options)}"] if self.options else []),
            f"Video: {self.video} ({format_time(self.duration)}), mode {self.mode}, "
            f"{len(self.overview_timestamps)} overview frames",
        ]
        for t in self.turns:
            tag = " (asked for the final answer)" if t.forced_final else ""
            lines.append(f"-- planner turn {t.turn + 1}{tag} [{t.latency:.2f}s, {t.prompt_tokens}+{t.completion_tokens} tok]")
            if t.reasoning:
                lines.append(f"   think: {clip(t.reasoning)}")
            for c in t.calls:
                label = c.label or c.name or "call"
                span = f"{format_time(c.window[0])}-{format_time(c.window[1])}" if c.window else ""
                where = f" {span}" if span and span not in label else ""
                lines.append(f"   [{c.index + 1}] {label}{where} [{c.latency:.2f}s]")
                via = " (frames to the planner)" if c.evidence == "frames" and not c.error else ""
                lines.append(f"       ->{via} {clip(c.slot_text)}")
                for w in c.warnings:
                    lines.append(f"       warning: {clip(w)}")
        lines.append(f"Answer: {self.answer}" + (f"  (choice {self.choice})" if self.choice else "")
                     + (f"  (span {self.span[0]:g}-{self.span[1]:g}s)" if self.span else ""))
        if self.warnings:
            lines.append("Warnings: " + "; ".join(self.warnings))
        if self.errors:
            lines.append("Errors: " + "; ".join(self.errors))
        lines.append(f"Total {self.latency:.2f}s, {self.tool_calls} tool calls, "
                     f"{self.prompt_tokens}+{self.completion_tokens} tokens")
        return "\n".join(lines)
