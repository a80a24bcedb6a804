"""``Trace``: everything one question went through, as JSON and as readable text."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from paravt_agent.protocol import format_time, neutralize

__all__ = ["MODEL_OUTPUT_ERRORS", "MemoryEntry", "Phase", "PlannerTurn", "SubAgentRecord", "Trace", "agent_view"]

#: How the errors about what the model wrote begin (see :meth:`Trace.run_errors`).
MODEL_OUTPUT_ERRORS = ("degenerate output:", "empty answer:")


class Phase(BaseModel):
    """One timed step of a run: ``overview`` (decoding the planner's frames), ``planner`` (one planner
    call), ``crop`` (a tool call's work, e.g. decoding a crop), ``subagent`` (a sub-agent's generation),
    ``aggregate`` (laying out a turn's results), ``answer`` (the planner call that gave the final response).
    ``start`` is seconds since the question began; ``detail`` splits a model call where the backend can
    tell (``encode``, ``prefill``, ``decode``)."""

    name: str
    start: float
    seconds: float
    turn: int | None = None
    index: int | None = None
    detail: dict[str, float] = Field(default_factory=dict)


class SubAgentRecord(BaseModel):
    """One tool call of a planner turn (or of a collaborating agent's round) and what came back in its slot."""

    index: int
    agent: str | None = None  # the collaborating agent that made the call (collaborative mode)
    raw: str = ""
    name: str | None = None
    arguments: dict = Field(default_factory=dict)
    label: str = ""
    window: tuple[float, float] | None = None
    frame_timestamps: list[float] = Field(default_factory=list)
    summary: str = ""
    reply: str | None = None  # the sub-agent's whole reply, when the planner read only part of it (subagent_report)
    evidence: str = "summary"  # summary (a sub-agent's text) | frames (the crop's frames went to the planner) | text
    error: str | None = None
    runtime_error: bool = False  # the error is the runtime's (a tool or the policy failed after its retries, a
    # timeout), not the model's (an invalid call): RL counts such an episode as failed instead of scoring it
    warnings: list[str] = Field(default_factory=list)
    latency: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    batch_size: int = 1  # how many model calls ran in the batch this one ran in (local backend)

    @property
    def slot_text(self) -> str:
        return f"error: {self.error}" if self.error else self.summary


class MemoryEntry(BaseModel):
    """What one collaborating agent wrote to the shared memory in one round or turn (the collaborative mode).

    ``collab.protocol: rounds``: its plan, its tool calls and their outputs, the key information it took from them,
    and whether it shares the entry with the other agents (the synthesizer reads every entry).
    ``cpp`` (VideoChat-M1's memory buffer, keyed by agent: :meth:`Trace.memory_buffer`): turn 0 holds the agent's
    plan (the ordered tools) and key info; turn k the tool it ran (``calls``), the decision it took after reading
    the others' outputs (``decision``: ``continue()`` or ``add tool``) and its key info; its last entry its own
    ``answer`` and ``reason``."""

    agent: str
    round: int  # the round (rounds) or the turn (cpp: 0 the plan, k the k-th tool step)
    plan: str = ""
    calls: list[SubAgentRecord] = Field(default_factory=list)
    info: str = ""
    share: bool = True
    text: str = ""  # the agent's whole response (cpp: its plan or decision reply)
    latency: float = 0.0
    prompt_tokens: int = 0  # the agent's own model calls (its tool calls' are on their records)
    completion_tokens: int = 0
    error: str | None = None  # the agent's model call failed after its retries (the round goes on without it)
    decision: str = ""  # cpp: "continue()", "add tool <label>", or what it wrote when neither parsed
    pending: list[str] = Field(default_factory=list)  # cpp: the tool calls left in its plan (their raw text)
    answer: str | None = None  # cpp: the agent's own answer (the body of its <answer>), on its last entry
    reason: str = ""  # cpp: the reasoning it gave with the answer
    answer_text: str = ""  # cpp: its whole answer reply
    dropped: bool = False  # cpp: agent dropout took it out of the communication this episode
    replies: int = 0  # cpp: its model calls in this entry, and how many broke the protocol (R_format)
    invalid: int = 0

    def render(self, limit: int = 600) -> str:
        """The entry as the agents and the synthesizer read it: every text neutralised (a tool's output or an
        agent's note cannot forge a tag or a turn in another agent's prompt)."""
        def clip(s: str) -> str:
            s = neutralize(" ".join(s.split()))
            return s if len(s) <= limit else s[: limit - 3] + "..."

        return "\n".join([f"[{self.agent}, round {self.round + 1}]",
                          *(f"  {name}: {clip(text)}" for name, text in self.items())])

    def items(self) -> list[tuple[str, str]]:
        """The entry's parts in reading order, ``(name, text)``: an error, the plan, each call's output (by its
        label), the key info."""
        return [*([("no entry", self.error)] if self.error else []), *([("plan", self.plan)] if self.plan else []),
                *((c.label or c.name or "call", c.slot_text) for c in self.calls),
                *([("decision", self.decision)] if self.decision else []),
                *([("key info", self.info)] if self.info else []),
                *([("answer", self.answer)] if self.answer is not None else []),
                *([("reason", self.reason)] if self.reason else [])]


def _clip_text(text: str, limit: int = 600) -> str:
    text = neutralize(" ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def agent_view(name: str, entries: list[MemoryEntry]) -> str:
    """One agent's memory buffer as the agents read it (VideoChat-M1, Fig. 6): its plan, key info, each turn's
    tool, output and decision, its answer and reason; every text neutralised."""
    lines = [f"Agent: {name}"]
    info = None
    for e in sorted(entries, key=lambda e: e.round):
        if e.error:
            lines.append(f"Error: {_clip_text(e.error)}")
        if e.round == 0 and e.plan:
            lines.append(f"Plan: {_clip_text(e.plan)}")
        if e.info and e.info != info:
            lines.append(f"Key info: {_clip_text(e.info)}")
            info = e.info
        lines += [f"Turn {e.round}: {_clip_text(c.label or c.name or 'call', 200)} -> {_clip_text(c.slot_text)}"
                  for c in e.calls]
        if e.decision:
            lines.append(f"Decision: {_clip_text(e.decision)}")
        if e.answer is not None:
            lines.append(f"Answer: {_clip_text(e.answer)}")
            if e.reason:
                lines.append(f"Reason: {_clip_text(e.reason)}")
    return "\n".join(lines)




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
    consensus: list[str] = Field(default_factory=list)  # collaborative cpp: the agents whose agreeing answer this is


class Trace(BaseModel):
    """Everything one question went through: the input, every planner turn with its calls and their slots, the
    final response and what was read from it, what went wrong, and where the time went. JSON-serialisable
    (``model_dump(mode="json")``); :meth:`render` prints it for people."""

    id: str = Field(default_factory=lambda: uuid.uuid4().hex,
                    description="The run's id (a durable run's thread id when it had none of its own).")
    otel_trace_id: str | None = Field(None, description="The OpenTelemetry trace id (32 hex digits) of this "
                                      "question's spans, when tracing is on (paravt_agent/telemetry.py).")
    created: float = Field(default_factory=time.time, description="When the question began (Unix seconds).")
    video: str = Field("", description="The video as the caller named it (a path or a URL).")
    question: str = Field("", description="The question as asked.")
    options: list[str] | None = Field(None, description="The answer options of a multiple-choice question.")
    mode: str = Field("parallel",
                      description="The dispatch mode the run used (parallel, sequential, none or collaborative).")
    duration: float = Field(0.0, description="The video's length in seconds.")
    overview_timestamps: list[float] = Field(default_factory=list,
                                             description="The times (seconds) of the planner's overview frames.")
    turns: list[PlannerTurn] = Field(default_factory=list,
                                     description="Every planner response in order, each with its calls' slots.")
    response: str = Field("", description="The planner's final response, whole (think and answer tags included).")
    answer: str = Field("", description="The answer read from the response (the answer body, else the text "
                        "after </think>, else the last line).")
    choice: str | None = Field(None, description="The option letter the answer names (multiple choice).")
    span: tuple[float, float] | None = Field(None, description="The (start, end) seconds the answer names "
                                             "(grounding questions).")
    errors: list[str] = Field(default_factory=list, description="What went wrong: the run's failures (an endpoint "
                              "down, a timeout), each tool call the runtime could not run (turn, call, tool, cause) "
                              "and notes on the model's output (empty, degenerate). See status.")
    advice: list[str] = Field(default_factory=list, description="What to change when the run ran out of a time "
                              "budget: the setting (subagent_timeout, planner_timeout, request_timeout), what the work "
                              "needed and a value to raise it to (paravt_agent.graph.advice).")
    warnings: list[str] = Field(default_factory=list, description="What the caller should know that is not an "
                                "error (e.g. frames a damaged video could not give).")
    latency: float = Field(0.0, description="Seconds from the question to its answer.")
    overview_latency: float = Field(0.0, description="Seconds spent decoding the overview (0 when the run started "
                                    "from a prepared input).")
    phases: list[Phase] = Field(default_factory=list, description="The run's timed steps (overview, planner, crop, "
                                "subagent, aggregate, answer), relative to its start.")
    memory: list[MemoryEntry] = Field(default_factory=list, description="The collaborative mode's shared memory: "
                                      "every agent's entry per round, in round then pool order.")

    @property
    def ok(self) -> bool:
        """An answer came back and nothing went wrong on the way (``errors`` says what did): ``status == "ok"``."""
        return self.status == "ok"

    @property
    def status(self) -> Literal["ok", "degraded", "failed"]:
        """``ok``: an answer, nothing went wrong. ``degraded``: an answer, but built on failed work: ``failed_calls``
        tool calls (sub-agents, a tool's model calls, collaborating agents) could not be run by the runtime (a
        timeout, an endpoint error, a refused request) and the model answered from their error slots; the failures
        are in ``errors``. ``failed``: no usable answer: the run itself failed (an endpoint down, the
        request_timeout, no final response) or the model's output was empty or degenerate."""
        calls = set(self.runtime_call_errors)
        if not self.answer.strip() or any(e not in calls for e in self.errors):
            return "failed"
        return "degraded" if calls else "ok"

    @property
    def scorable(self) -> bool:
        """Whether the answer is the model's own to score: nothing failed in the runtime (no run error, no tool
        call it could not run). An empty or degenerate answer is the model's doing and stays scorable (it scores
        0); evaluations count the others apart, as errors, and RL does not train on them."""
        return not self.run_errors

    @property
    def failed_calls(self) -> int:
        """Tool calls (and collaborating agents' rounds) the runtime could not run: what makes an answer
        ``degraded``."""
        return len(self.runtime_call_errors)

    @property
    def run_errors(self) -> list[str]:
        """The errors of the run itself (an endpoint down, a timeout, a crash), without the notes about what
        the model wrote (an empty or degenerate answer): those are the model's doing, and RL must learn from
        them rather than drop them."""
        return [e for e in self.errors if not e.startswith(MODEL_OUTPUT_ERRORS)]

    @property
    def runtime_call_errors(self) -> list[str]:
        """Tool-call slots the runtime could not fill (a tool or a sub-agent's model call failed after its
        retries, or timed out), as ``turn N call M: error``; invalid calls the model wrote are not among them."""
        return [f"turn {t.turn + 1} call {c.index + 1} ({c.label or c.name or 'call'}): {c.error}" for t in self.turns
                for c in t.calls if c.error and c.runtime_error] + [
            f"{m.agent} round {m.round + 1} call {k + 1} ({c.label or c.name or 'call'}): {c.error}"
            for m in self.memory for k, c in enumerate(m.calls) if c.error and c.runtime_error] + [
            f"{m.agent} round {m.round + 1}: {m.error}" for m in self.memory if m.error]

    def memory_buffer(self) -> dict[str, list[MemoryEntry]]:
        """The collaborative mode's memory keyed by agent (VideoChat-M1's memory buffer): each agent's entries in
        turn order."""
        out: dict[str, list[MemoryEntry]] = {}
        for m in sorted(self.memory, key=lambda m: m.round):
            out.setdefault(m.agent, []).append(m)
        return out

    def all_calls(self) -> list[SubAgentRecord]:
        """Every tool call of the run: the planner turns' and the collaborating agents'."""
        return [c for t in self.turns for c in t.calls] + [c for m in self.memory for c in m.calls]

    @property
    def tool_calls(self) -> int:
        return len(self.all_calls())

    @property
    def prompt_tokens(self) -> int:
        return (sum(t.prompt_tokens for t in self.turns) + sum(m.prompt_tokens for m in self.memory)
                + sum(c.prompt_tokens for c in self.all_calls()))

    @property
    def completion_tokens(self) -> int:
        return (sum(t.completion_tokens for t in self.turns) + sum(m.completion_tokens for m in self.memory)
                + sum(c.completion_tokens for c in self.all_calls()))

    def breakdown(self) -> dict[str, float]:
        """Where this question's wall time went, in seconds: phases on the critical path (they add up to
        ``latency`` with ``other``) and, for the sub-agents that ran concurrently, their summed work.
        ``planner other`` is a planner call's time outside prefill and decode: queueing and encoding, or the
        whole call where the backend cannot split it (an OpenAI-compatible endpoint)."""
        out = {"decode overview": self.overview_latency}
        planner = [p for p in self.phases if p.name == "planner"]
        out["planner prefill"] = sum(p.detail.get("prefill", 0.0) for p in planner)
        out["planner decode"] = sum(p.detail.get("decode", 0.0) for p in planner)
        out["planner other"] = sum(p.seconds for p in planner) - out["planner prefill"] - out["planner decode"]
        wall = 0.0
        for turn in sorted({p.turn for p in self.phases if p.name in ("crop", "subagent")}):
            ps = [p for p in self.phases if p.name in ("crop", "subagent") and p.turn == turn]
            wall += max(p.start + p.seconds for p in ps) - min(p.start for p in ps)
        out["sub-agents (wall)"] = wall
        out["aggregate"] = sum(p.seconds for p in self.phases if p.name == "aggregate")
        answer = [p for p in self.phases if p.name == "answer"]
        out["answer turn"] = sum(p.seconds for p in answer)
        on_path = (out["decode overview"] + sum(p.seconds for p in planner) + wall + out["aggregate"]
                   + out["answer turn"])
        out["other"] = max(0.0, self.latency - on_path)
        out["crop decode (sum)"] = sum(p.seconds for p in self.phases if p.name == "crop")
        out["sub-agent generation (sum)"] = sum(p.seconds for p in self.phases if p.name == "subagent")
        return {k: round(v, 4) for k, v in out.items()}

    def render_profile(self) -> str:
        """The breakdown as a table, then every timed phase in the order it started."""
        lines = ["phase                         seconds   share"]
        total = self.latency or 1e-9
        for name, sec in self.breakdown().items():
            share = "" if "(sum)" in name else f"{100 * sec / total:5.1f}%"
            lines.append(f"{name:<28} {sec:8.3f}  {share}")
        lines.append(f"{'total':<28} {self.latency:8.3f}")
        lines.append("")
        for p in sorted(self.phases, key=lambda p: p.start):
            where = ("" if p.turn is None
                     else f" turn {p.turn + 1}" + ("" if p.index is None else f" call {p.index + 1}"))
            detail = ", ".join(f"{k} {v:.3f}" for k, v in p.detail.items())
            lines.append(f"  {p.start:7.3f}s +{p.seconds:.3f}s  {p.name}{where}" + (f"  ({detail})" if detail else ""))
        return "\n".join(lines)

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
            lines.append(f"-- planner turn {t.turn + 1}{tag} "
                         f"[{t.latency:.2f}s, {t.prompt_tokens}+{t.completion_tokens} tok]")
            if t.reasoning:
                lines.append(f"   think: {clip(t.reasoning)}")
            if t.consensus:
                lines.append(f"   the consensus of {', '.join(t.consensus)}")
            for c in t.calls:
                label = c.label or c.name or "call"
                span = f"{format_time(c.window[0])}-{format_time(c.window[1])}" if c.window else ""
                where = f" {span}" if span and span not in label else ""
                lines.append(f"   [{c.index + 1}] {label}{where} [{c.latency:.2f}s]")
                via = " (frames to the planner)" if c.evidence == "frames" and not c.error else ""
                lines.append(f"       ->{via} {clip(c.slot_text)}")
                for w in c.warnings:
                    lines.append(f"       warning: {clip(w)}")
        if self.memory:
            lines.append("-- shared memory (collaborating agents)")
            if any(m.replies for m in self.memory):  # the cpp protocol: the memory buffer, agent by agent
                lines += ["   " + line for name, es in self.memory_buffer().items()
                          for line in agent_view(name, es).splitlines()]
            else:
                lines += ["   " + line for m in self.memory for line in m.render(width * 4).splitlines()]
        lines.append(f"Answer: {self.answer}" + (f"  (choice {self.choice})" if self.choice else "")
                     + (f"  (span {self.span[0]:g}-{self.span[1]:g}s)" if self.span else ""))
        if self.warnings:
            lines.append("Warnings: " + "; ".join(self.warnings))
        if self.errors:
            lines.append("Errors: " + "; ".join(self.errors))
        status = self.status
        if status == "degraded":
            lines.append(f"Status: DEGRADED: {self.failed_calls} of {self.tool_calls} tool calls failed in the "
                         "runtime; the answer was given without their evidence")
        elif status == "failed":
            lines.append("Status: FAILED: no usable answer")
        lines += [f"To change: {a}" for a in self.advice]
        lines.append(f"Total {self.latency:.2f}s, {self.tool_calls} tool calls, "
                     f"{self.prompt_tokens}+{self.completion_tokens} tokens")
        return "\n".join(lines)
