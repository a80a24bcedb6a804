"""ParaVT web demo (Gradio): upload a video (or make a toy one), ask, watch the sub-agents work.

    python gradio_app.py [--host 127.0.0.1] [--port 7860] [--model DIR] [--store runs/traces.db]
                         [--allow-endpoint http://127.0.0.1:30000]

Binds 127.0.0.1 unless told otherwise (``--host``/``--port``, or Gradio's own
``GRADIO_SERVER_NAME``/``GRADIO_SERVER_PORT``). The embedded tiny toy policy is
the default backend. Switching to an OpenAI-compatible endpoint from the page is
off unless the operator allows it with ``--allow-endpoint PREFIX`` (repeatable):
otherwise anyone who can open the page could make the server post frames to any
URL. Everything updates live as sub-agents finish; errors show as messages in
the page, never with the server's file paths.
"""

from __future__ import annotations

import argparse
import html
import os
import random
import tempfile
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from paravt_agent.agent import Agent  # noqa: E402
from paravt_agent.config import AgentConfig  # noqa: E402
from paravt_agent.errors import ParaVTError  # noqa: E402
from paravt_agent.protocol import format_time  # noqa: E402
from paravt_agent.store import TrajectoryStore  # noqa: E402
from paravt_agent.store.principals import WEB  # noqa: E402
from paravt_agent.types import (  # noqa: E402
    AnswerEvent,
    MemoryEvent,
    OverviewEvent,
    PlannerEvent,
    ReviewEvent,
    SubAgentEvent,
)
from paravt_agent.video import VideoReader  # noqa: E402

MAX_UPLOAD_MB = 500
CSS = """
.pvt-timeline {position: relative; height: 46px; background: #eef1f5; border-radius: 6px; margin: 6px 0;}
.pvt-tick {position: absolute; top: 0; width: 1px; height: 10px; background: #8a94a6;}
.pvt-window {position: absolute; top: 14px; height: 28px; background: rgba(37, 99, 235, .55);
             border: 1px solid #1d4ed8; border-radius: 4px; color: white; font-size: 12px; text-align: center;
             overflow: hidden; white-space: nowrap;}
.pvt-window.pvt-error {background: rgba(220, 38, 38, .6); border-color: #b91c1c;}
"""


def timeline_html(duration: float, overview: list[float], windows: list[dict]) -> str:
    """A bar of the video: overview frames as ticks, crop windows as blocks (red when their slot failed)."""
    if duration <= 0:
        return ""
    parts = ['<div class="pvt-timeline" id="pvt-timeline">']
    for t in overview:
        parts.append(f'<div class="pvt-tick" style="left:{100 * t / duration:.2f}%"></div>')
    for w in windows:
        a, b = w["window"]
        cls = "pvt-window pvt-error" if w.get("error") else "pvt-window"
        title = html.escape(w.get("summary") or w.get("error") or "")
        parts.append(f'<div class="{cls}" title="{title}" style="left:{100 * a / duration:.2f}%;'
                     f'width:{max(0.8, 100 * (b - a) / duration):.2f}%">[{w["index"] + 1}]</div>')
    parts.append("</div>")
    parts.append(f'<div style="font-size:12px;color:#555">0:00 – {format_time(duration)}; '
                 f"{len(overview)} overview frames, {len(windows)} windows</div>")
    return "".join(parts)


def lanes_html(entries: list, order: list[str] | None = None) -> str:
    """The collaborative mode's shared memory: one lane per agent (in the pool's ``order``), one card per round
    (plan, tool outputs, key info; a dashed card is an entry the agent did not share)."""
    if not entries:
        return ""
    agents = list(dict.fromkeys([*(order or []), *(e.agent for e in entries)]))
    cols = []
    for name in agents:
        cards = []
        for e in (e for e in entries if e.agent == name):
            body = [f"<b>round {e.round + 1}</b>" + ("" if e.share else " <i>(not shared)</i>")]
            body += [f"{html.escape(name)}: {html.escape(text[:300])}" for name, text in e.items()]
            style = "border:1px dashed #999" if not e.share else "border:1px solid #2563eb"
            cards.append(f'<div class="pvt-card" style="{style};border-radius:6px;padding:6px;margin:4px 0;'
                         f'font-size:12px">' + "<br>".join(body) + "</div>")
        cols.append(f'<div class="pvt-lane" style="flex:1;min-width:180px"><div style="font-weight:bold">'
                    f'{html.escape(name)}</div>{"".join(cards)}</div>')
    return f'<div id="pvt-lanes" style="display:flex;gap:8px">{"".join(cols)}</div>'


class Demo:
    def __init__(self, model_dir: str | None = None, store: str | None = None, max_upload_mb: int = MAX_UPLOAD_MB,
                 seed: int | None = None, allow_endpoints: list[str] | None = None, preset: str = "paravt"):
        self.model_dir = model_dir
        self.preset = preset
        self.allow_endpoints = [a.rstrip("/") for a in allow_endpoints or []]
        self._rng = random.Random(seed)
        self.store = TrajectoryStore(store) if store else None
        self.max_upload_mb = max_upload_mb
        self._agents: dict[tuple, Agent] = {}
        self._paused: dict[str, dict] = {}  # thread id -> a run waiting for its windows to be approved
        self.workdir = Path(tempfile.mkdtemp(prefix="paravt-demo-"))

    def agent(self, backend: str, endpoint: str, model_name: str, mode: str, review: bool = False) -> Agent:
        key = (backend, endpoint, model_name, mode, review)
        if key not in self._agents:
            if backend == "endpoint":
                if not self.allow_endpoints:
                    raise ParaVTError("endpoint switching is off on this server; the operator can allow endpoints "
                                      "with --allow-endpoint URL")
                if not endpoint:
                    raise ParaVTError("enter the endpoint URL (e.g. http://127.0.0.1:30000/v1)")
                if not any(endpoint.rstrip("/").startswith(a) for a in self.allow_endpoints):
                    raise ParaVTError(f"endpoint {endpoint} is not allowed on this server (allowed: "
                                      f"{', '.join(self.allow_endpoints)})")
                agent = Agent(backend="openai", endpoint=endpoint, model=model_name or None,
                              config=AgentConfig(preset=self.preset, mode=mode, retries=0, review_windows=review),
                              store=self.store,
                              policy_kwargs={"max_retries": 1, "timeout": 120})
            else:
                from paravt_agent.defaults import default_model_dir
                from paravt_train.toy.build import toy_agent_config

                model = self.model_dir or default_model_dir()
                agent = Agent(model=model, config=toy_agent_config(mode=mode, review_windows=review), store=self.store)
            self._agents[key] = agent
        return self._agents[key]

    def toy_video(self):
        """A fresh toy world: its video and its grounding question (the planner scans the whole video with
        4-8 parallel windows, so the page shows the fan-out; colour-at-t questions need one window)."""
        from paravt_train.toy.world import make_world

        w = make_world(self._rng.randrange(10**6, 2 * 10**6), mcq=1, oe=0, tvg=1)
        w.write(self.workdir / f"{w.wid}.mp4")
        q = next(q for q in w.questions if q.task == "tvg")
        t = next(q for q in w.questions if q.task == "mcq")
        return w.video, q.question, "", (f"Toy video {w.wid}: {w.duration} s. Ground truth: {q.answer}. Also try "
                                         f"\"{t.question}\" (answer: {t.colour}).")

    OUTPUTS = ("status", "think", "timeline", "gallery", "summaries", "answer", "stats", "trace_id", "windows",
               "pending", "lanes")

    async def ask(self, video, question, options_text, backend, endpoint, model_name, n_frames, mode,
                  review: bool = False):
        """Stream one question into the page's outputs. With ``review`` the run pauses after the planner: the
        planned windows fill ``windows`` (editable) and ``pending`` names the paused run for :meth:`resume`."""
        view = {k: "" for k in self.OUTPUTS} | {"gallery": []}
        if not video:
            view["status"] = "**error:** upload a video or click *Generate a toy video* first."
        elif not question or not question.strip():
            view["status"] = "**error:** type a question."
        elif os.path.getsize(video) / 2**20 > self.max_upload_mb:
            size_mb = os.path.getsize(video) / 2**20
            view["status"] = f"**error:** the video is {size_mb:.0f} MB; the limit is {self.max_upload_mb} MB."
        if view["status"]:
            yield self._emit(view)
            return
        options = [o.strip() for o in (options_text or "").splitlines() if o.strip()] or None
        run = {"video": video, "duration": 0.0, "overview": [], "windows": {}, "thumbs": {}, "reader": None,
               "agent": (backend, (endpoint or "").strip(), (model_name or "").strip(), mode, bool(review))}
        view["status"] = "decoding the overview ..."
        yield self._emit(view)
        try:
            agent = self.agent(*run["agent"])
            run["pool"] = [a.name for a in agent.config.collab.agents]
            events = agent.astream(video, question, options, n_frames=int(n_frames) if n_frames else None)
            async for out in self._render(events, view, run):
                yield out
        except Exception as exc:  # every failure is a message in the page; the server keeps serving
            view["status"] = f"**error:** {html.escape(self._public(exc, video))}"
            yield self._emit(view)

    async def resume(self, windows_text: str, pending: str):
        """Run the paused question's sub-agents on the reviewed windows (one ``start-end`` per line, seconds)."""
        run = self._paused.pop(pending, None) if pending else None
        view = {k: "" for k in self.OUTPUTS} | {"gallery": []}
        if run is None:
            view["status"] = "**error:** no question is waiting for its windows; ask one with *Approve windows* on."
            yield self._emit(view)
            return
        view.update(run["view"], windows="", pending="")
        try:
            calls = [{"start_time": float(a), "end_time": float(b)} for a, b in
                     (line.replace(" ", "").split("-", 1) for line in (windows_text or "").splitlines()
                      if line.strip())]
        except ValueError:
            self._paused[pending] = run
            view.update(windows=windows_text, pending=pending,
                        status="**error:** write one window per line as start-end in seconds, e.g. 16-31")
            yield self._emit(view)
            return
        view["status"] = f"running {len(calls)} sub-agents ..."
        yield self._emit(view)
        try:
            agent = self.agent(*run["agent"])
            async for out in self._render(agent.astream_resume(pending, calls), view, run):
                yield out
        except Exception as exc:
            view["status"] = f"**error:** {html.escape(self._public(exc, run['video']))}"
            yield self._emit(view)

    def _emit(self, view: dict) -> tuple:
        return tuple(view[k] for k in self.OUTPUTS)

    async def _render(self, events, view: dict, run: dict):
        """The page's outputs after each event of a run (``run`` keeps what the timeline has drawn so far)."""
        windows = run["windows"]
        async for ev in events:
            if isinstance(ev, OverviewEvent):
                run["duration"], run["overview"] = ev.duration, ev.timestamps
                run["reader"] = VideoReader(run["video"])
                view["status"] = f"planner is thinking over {len(ev.timestamps)} overview frames ..."
            elif isinstance(ev, PlannerEvent):
                view["think"] = ev.text
                for c in ev.calls:
                    if c.window:
                        windows[(ev.turn, "", c.index)] = {"index": c.index, "window": c.window, "error": c.error,
                                                           "summary": ""}
                n = sum(1 for c in ev.calls if not c.error)
                view["status"] = f"{n} sub-agents dispatched ..." if ev.calls else "answering ..."
            elif isinstance(ev, ReviewEvent):
                for key in [k for k in windows if k[0] == ev.turn]:  # the reviewed windows replace the planned
                    del windows[key]
                view["windows"] = "\n".join(f"{c.window[0]:g}-{c.window[1]:g}" for c in ev.calls if c.window)
                view["pending"] = ev.thread_id
                view["status"] = (f"{len(ev.calls)} windows planned: edit them (one start-end per line, seconds) "
                                  "and click *Run sub-agents*.")
                self._paused[ev.thread_id] = {**run, "view": dict(view)}
            elif isinstance(ev, SubAgentEvent):
                self._show_subagent(ev, view, run)
            elif isinstance(ev, MemoryEvent):
                run.setdefault("memory", []).append(ev.entry)
                view["lanes"] = lanes_html(sorted(run["memory"], key=lambda e: e.round), run.get("pool"))
                view["status"] = f"{ev.entry.agent} finished round {ev.round + 1} ..."
            elif isinstance(ev, AnswerEvent):
                t = ev.answer.trace
                view["answer"] = ev.answer.choice or ev.answer.text or "(no answer)"
                view["think"] = "\n\n".join(turn.text for turn in t.turns)
                view["stats"] = (f"latency {t.latency:.2f} s · {t.tool_calls} tool calls · "
                                 f"{t.prompt_tokens} prompt + {t.completion_tokens} completion tokens"
                                 + (f" · errors: {'; '.join(t.errors)}" if t.errors else ""))
                view["trace_id"] = t.id
                if t.status == "degraded":  # an answer from the error slots of calls that never ran: said plainly
                    view["status"] = (f"**degraded answer:** {t.failed_calls} of {t.tool_calls} tool calls failed "
                                      "(timed out or the model call failed); the answer was given without their "
                                      "evidence.")
                elif t.status == "failed":
                    view["status"] = "**failed:** no usable answer (see the errors below the answer)."
                else:
                    view["status"] = "done."
            view["timeline"] = timeline_html(run["duration"], run["overview"],
                                             [v for _, v in sorted(windows.items()) if v.get("window")])
            yield self._emit(view)

    def _show_subagent(self, ev: SubAgentEvent, view: dict, run: dict) -> None:
        rec, windows, thumbs = ev.record, run["windows"], run["thumbs"]
        key = (ev.turn, rec.agent or "", rec.index)  # a collaborating agent's calls: their own slots
        w = windows.setdefault(key, {"index": rec.index, "window": rec.window, "error": None, "summary": "",
                                     "agent": rec.agent})
        w.update(summary=rec.summary, error=rec.error, window=rec.window or w["window"],
                 frames=rec.evidence == "frames")
        if rec.frame_timestamps and run["reader"] is not None and key not in thumbs:
            mid = rec.frame_timestamps[len(rec.frame_timestamps) // 2]
            img = run["reader"].sample([mid], max_pixels=96 * 96, factor=8).frames[0]
            thumbs[key] = (img, f"[{rec.index + 1}] {rec.label}")
        view["summaries"] = "\n\n".join(
            f"**[{(v['agent'] + ' ') if v.get('agent') else ''}{v['index'] + 1}]** "
            f"{format_time(v['window'][0])}-{format_time(v['window'][1])}: "
            + (f"*error: {html.escape(v['error'])}*" if v["error"] else
               ("*frames to the planner:* " if v.get("frames") else "") + html.escape(v["summary"] or "…"))
            for _, v in sorted(windows.items()) if v.get("window"))
        view["gallery"] = [thumbs[k] for k in sorted(thumbs)]
        done = sum(1 for v in windows.values() if v["summary"] or v["error"])
        view["status"] = f"{done} of {len(windows)} sub-agents done ..."

    def _public(self, exc: Exception, video) -> str:
        """An error as the page shows it: its message, with the server's temporary paths hidden."""
        msg = str(exc) if isinstance(exc, ParaVTError) else f"{exc.__class__.__name__}: {exc}"
        if video:
            msg = msg.replace(str(video), os.path.basename(str(video)))
        for folder in {str(self.workdir), tempfile.gettempdir()}:
            msg = msg.replace(folder + os.sep, "").replace(folder, "")
        return msg

    def feedback(self, trace_id, correct, thumbs, request: gr.Request | None = None):
        if self.store is None:
            return "No trajectory store is configured (start the demo with --store PATH)."
        if not trace_id:
            return "Ask a question first."
        session = getattr(request, "session_hash", None) or "local"
        try:  # an answer the question cannot have is refused with the store's message
            # every session of the page is one principal (a session is a name anyone gets by reloading): one
            # voter for the online learner, the session a sub-label (paravt_agent/store/principals.py)
            self.store.feedback(trace_id, answer=(correct or "").strip() or None,
                                thumbs=None if thumbs is None else thumbs == "up", user=f"gradio:{session}",
                                principal=WEB)
        except Exception as exc:  # a message, never a crash
            return f"error: {self._public(exc, None)}"
        return f"Thanks, feedback stored for trace {trace_id[:8]}."


def build_demo(model_dir: str | None = None, store: str | None = None, max_upload_mb: int = MAX_UPLOAD_MB,
               seed: int | None = None, allow_endpoints: list[str] | None = None, preset: str = "paravt"):
    AgentConfig(preset=preset)  # an unknown preset fails here, at start-up
    d = Demo(model_dir, store, max_upload_mb, seed, allow_endpoints, preset)
    with gr.Blocks(title="ParaVT") as demo:
        gr.Markdown("# ParaVT — parallel video tool calling\nA planner looks at an overview, sends K sub-agents "
                    "to crop windows in parallel, and answers from their summaries.")
        with gr.Row():
            with gr.Column(scale=1):
                video = gr.Video(sources=["upload"], label="Video", elem_id="pvt-video")
                toy = gr.Button("Generate a toy video", elem_id="pvt-toy")
                toy_info = gr.Markdown(elem_id="pvt-toy-info")
                question = gr.Textbox(label="Question", elem_id="pvt-question")
                options = gr.Textbox(label="Options (one per line, optional)", lines=4, elem_id="pvt-options")
                with gr.Accordion("Model", open=False):
                    backend = gr.Radio(["embedded tiny policy", "endpoint"], value="embedded tiny policy",
                                       label="Backend")
                    endpoint = gr.Textbox(label="Endpoint URL", placeholder="http://127.0.0.1:30000/v1")
                    model_name = gr.Textbox(label="Model name (endpoint)")
                    mode = gr.Radio(["parallel", "sequential", "none", "collaborative"], value="parallel",
                                    label="Dispatch mode")
                    n_frames = gr.Slider(2, 64, value=8, step=1, label="Overview frames (n)")
                review = gr.Checkbox(False, label="Approve windows before the sub-agents run", elem_id="pvt-review")
                ask = gr.Button("Ask", variant="primary", elem_id="pvt-ask")
                windows = gr.Textbox(label="Planned windows (start-end, one per line; edit, then run)", lines=4,
                                     elem_id="pvt-windows")
                approve = gr.Button("Run sub-agents", elem_id="pvt-approve")
                pending = gr.State("")
            with gr.Column(scale=2):
                status = gr.Markdown(elem_id="pvt-status")
                answer = gr.Textbox(label="Answer", elem_id="pvt-answer")
                timeline = gr.HTML(elem_id="pvt-timeline-box")
                gallery = gr.Gallery(label="Windows", columns=8, height=140, elem_id="pvt-gallery")
                summaries = gr.Markdown(label="Sub-agent summaries", elem_id="pvt-summaries")
                lanes = gr.HTML(elem_id="pvt-lanes-box")  # the collaborative mode: one lane per agent
                with gr.Accordion("Planner reasoning", open=True):
                    think = gr.Code(label="Planner", language=None, elem_id="pvt-think")
                stats = gr.Markdown(elem_id="pvt-stats")
                trace_id = gr.State("")
                with gr.Accordion("Feedback", open=False):
                    correct = gr.Textbox(label="Correct answer (optional)")
                    thumbs = gr.Radio(["up", "down"], label="Was it right?")
                    send = gr.Button("Send feedback")
                    sent = gr.Markdown()
        toy.click(d.toy_video, outputs=[video, question, options, toy_info])

        async def run(video, question, options, backend, endpoint, model_name, n_frames, mode, review):
            b = "endpoint" if backend == "endpoint" else "embedded"
            async for out in d.ask(video, question, options, b, endpoint, model_name, n_frames, mode, review):
                yield out

        async def go_on(windows_text, pending_id):
            async for out in d.resume(windows_text, pending_id):
                yield out

        shown = [status, think, timeline, gallery, summaries, answer, stats, trace_id, windows, pending, lanes]
        ask.click(run, inputs=[video, question, options, backend, endpoint, model_name, n_frames, mode, review],
                  outputs=shown)
        approve.click(go_on, inputs=[windows, pending], outputs=shown)
        send.click(d.feedback, inputs=[trace_id, correct, thumbs], outputs=[sent])
    demo.paravt = d
    return demo


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                    help="Bind address (default $GRADIO_SERVER_NAME or 127.0.0.1).")
    ap.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
                    help="Port (default $GRADIO_SERVER_PORT or 7860).")
    ap.add_argument("--allow-endpoint", action="append", default=[], metavar="PREFIX",
                    help="Let page users switch to an endpoint whose URL starts with PREFIX (repeatable); off by "
                         "default.")
    ap.add_argument("--model", default=None, help="Toy/local model directory (default: the shipped toy policy).")
    ap.add_argument("--preset", default="paravt", help="Protocol preset of endpoint models: paravt, paravt-rl, "
                    "paravt-eval or longvt (a released checkpoint: the protocol it was trained with).")
    ap.add_argument("--store", default=None, help="Trajectory store for traces and feedback: a SQLite path or "
                    "postgresql://user:pass@host/db.")
    ap.add_argument("--max-upload-mb", type=int, default=MAX_UPLOAD_MB)
    ap.add_argument("--seed", type=int, default=None, help="Seed of the generated toy videos.")
    args = ap.parse_args(argv)
    demo = build_demo(args.model, args.store, args.max_upload_mb, args.seed, args.allow_endpoint, args.preset)
    demo.queue().launch(server_name=args.host, server_port=args.port, max_file_size=f"{args.max_upload_mb}mb",
                        css=CSS, show_error=True)


if __name__ == "__main__":
    main()
