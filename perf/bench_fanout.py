"""Fan-out benchmark: planner + K sub-agents + aggregator against an endpoint with a fixed delay.

An OpenAI-compatible server on 127.0.0.1 (a benchmark harness, not a test
double) answers every chat request after ``--delay`` seconds: the planner's
first turn with K ``crop_video`` calls (one per turn in sequential mode), each
sub-agent with a summary, the planner's last turn with an answer. The agent runs
for real (LangGraph graph, ``openai`` backend, frames decoded from an mp4).

Prints wall time per K and mode, the ratio to the ideal (parallel: 3 delays;
sequential: 2K+1 delays), and the runtime overhead per sub-agent, both as
(wall - ideal) / K and as the marginal cost of one more sub-agent relative to
the smallest K (the fixed cost of the planner turns and the overview excluded).
The harness server shares the machine's cores, so its own work is counted too.
Then the planner's context in tokens (summed over its
requests) for both dispatch modes and both evidence modes (sub-agent summaries,
or the crops' frames returned to the planner) at K = 1..8, counted with the tiny
model's processor on a 64-frame 640x360 overview: parallel mode encodes the
overview twice whatever K is, sequential K+1 times; frames evidence adds each
crop's frames to every later planner request.

    python perf/bench_fanout.py [--delay 0.25] [--repeat 3] [--ks 1 2 4 8 16 32]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from paravt_agent.agent import Agent
from paravt_agent.config import AgentConfig
from paravt_agent.policy.base import Policy, Sampling
from paravt_agent.policy.scripted import ScriptedPolicy


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def planner_reply(k: int, mode: str, messages: list[dict], role: str = "planner") -> str:
    """What a model would answer at this point of the conversation."""
    if role == "subagent":
        head = _text(messages[1]["content"])
        return "The window shows a red square moving right. " + head.split(",")[0]
    done = sum(_text(m["content"]).startswith("<tool_response>") for m in messages if m["role"] == "user")
    want = k - done if mode == "parallel" else (1 if done < k else 0)
    if done and (mode == "parallel" or want == 0):
        return "<think>The evidence agrees.</think>\n<answer>B</answer>"
    calls = "\n".join(
        f'<tool_call>{{"name": "crop_video", "arguments": {{"start_time": {2 * i + 0.5}, "end_time": {2 * i + 2}}}}}'
        "</tool_call>"
        for i in range(done, done + want)
    )
    return f"<think>Inspect {want} windows.</think>\n{calls}"


def make_server(delay: float):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms Nagle stall

        def do_GET(self):  # noqa: N802 - /v1/models
            self._send({"object": "list", "data": [{"id": "fanout", "object": "model"}]})

        def do_POST(self):  # noqa: N802 - /v1/chat/completions
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            k, mode = re.match(r"fanout-(\d+)-(\w+)", body["model"]).groups()
            time.sleep(delay)
            text = planner_reply(int(k), mode, body["messages"])
            self._send({
                "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": len(text.split()), "total_tokens": 1},
            })

        def _send(self, obj):
            raw = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *a):
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # the listen backlog: K new connections at once (socketserver's default is 5)
        daemon_threads = True

    srv = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def bare_burst(url: str, k: int, repeat: int) -> float:
    """K concurrent sub-agent-sized requests from a bare client (the SDK call our backend makes, no agent):
    what the harness server and HTTP on this machine cost for a wave of K, whatever the agent does."""
    import asyncio

    import numpy as np
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletion

    from paravt_agent.policy.openai_backend import to_openai_messages

    frames = [np.full((64, 64, 3), 40 * i, np.uint8) for i in range(4)]
    msgs = to_openai_messages([{"role": "system", "content": "You are a video inspection sub-agent."},
                               {"role": "user", "content": [{"type": "text", "text": "Window 0.5-2.0, "}]
                                + [{"type": "image", "image": f} for f in frames]}])
    body = {"model": f"fanout-{k}-parallel", "messages": msgs, "max_tokens": 64}

    async def run() -> float:
        client = AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
        wave = [client.post("/chat/completions", cast_to=ChatCompletion, body=body) for _ in range(k)]
        await asyncio.gather(*wave)  # connections open
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            await asyncio.gather(*(client.post("/chat/completions", cast_to=ChatCompletion, body=body)
                                   for _ in range(k)))
            times.append(time.perf_counter() - t0)
        await client.close()
        return statistics.median(times)

    return asyncio.run(run())


def bench_wall(video: str, url: str, delay: float, ks: list[int], repeat: int) -> None:
    print(f"\nwall time, endpoint delay {delay:.3f}s (median of {repeat}); 'x floor' divides by the ideal with the")
    print("sub-agent wave replaced by a bare client's wave of K requests to the same server (HTTP + harness cost)")
    print(f"{'K':>3s} {'mode':>10s} {'wall s':>8s} {'ideal s':>8s} {'x ideal':>8s} {'(wall-ideal)/K ms':>18s} "
          f"{'marginal ms/sub-agent':>22s} {'bare wave s':>11s} {'x floor':>8s}")
    for mode in ("parallel", "sequential"):
        base = None
        for k in ks:
            cfg = AgentConfig(mode=mode, max_calls_per_turn=max(ks), max_turns=k + 1, max_concurrency=64,
                              frames={"n_frames": 8, "crop_max_frames": 4})
            agent = Agent(backend="openai", endpoint=url, model=f"fanout-{k}-{mode}", config=cfg,
                          policy_kwargs={"concurrency": 64})
            agent.answer(video, "warm-up")
            walls = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                ans = agent.answer(video, "Which colour?")
                walls.append(time.perf_counter() - t0)
                assert ans.trace.tool_calls == k and ans.text == "B", ans.trace.render()
            wall = statistics.median(walls)
            ideal = (3 if mode == "parallel" else 2 * k + 1) * delay
            if base is None:
                base = (k, wall - ideal)
            marginal = ((wall - ideal) - base[1]) / (k - base[0]) * 1000 if k > base[0] else float("nan")
            floor_txt = ""
            if mode == "parallel":
                wave = bare_burst(url, k, repeat)
                floor_txt = f" {wave:11.3f} {wall / (2 * delay + wave):8.3f}"
            print(f"{k:3d} {mode:>10s} {wall:8.3f} {ideal:8.3f} {wall / ideal:8.3f} {(wall - ideal) / k * 1000:18.1f} "
                  f"{marginal:22.1f}" + floor_txt)


class Counting(Policy):
    """Scripted replies; counts each planner request's prompt with a real processor."""

    def __init__(self, k: int, mode: str, counter: Policy):
        self.inner = ScriptedPolicy(lambda role, msgs: planner_reply(k, mode, msgs, role))
        self.counter = counter
        self.planner_tokens: list[int] = []

    async def generate(self, messages, sampling, prefix="", continuation=None, role="planner"):
        if role == "planner":
            self.planner_tokens.append(self.counter.count_tokens(messages))
        return await self.inner.generate(messages, sampling, prefix, role=role)


def bench_context(video: str, model_dir: str) -> None:
    """Eq. 4: the planner's context, with sub-agent summaries (ParaVT) and with the crops' frames returned to
    the planner (``layout.evidence: frames``, the paper's "returning original frames" comparison)."""
    from paravt_agent.policy.local import LocalPolicy

    counter = LocalPolicy(model_dir)
    print("\nplanner context in tokens (64-frame overview, tiny model's processor), summed over planner requests;")
    print("evidence: summary = sub-agents' text (ParaVT), frames = each crop's frames go to the planner")
    cols = [(m, e) for m in ("parallel", "sequential") for e in ("summary", "frames")]
    print(f"{'K':>3s} " + " ".join(f"{m[:3] + '/' + e:>14s}" for m, e in cols) + f" {'frames/summary (par)':>21s}")
    for k in range(1, 9):
        row = {}
        for mode, evidence in cols:
            pol = Counting(k, mode, counter)
            cfg = AgentConfig(mode=mode, max_turns=k + 1, frames={"max_frames": 64},
                              layout={"evidence": evidence}, planner_sampling=Sampling(max_new_tokens=8))
            Agent(policy=pol, config=cfg).answer(video, "Which colour?")
            row[(mode, evidence)] = sum(pol.planner_tokens)
        ratio = row[("parallel", "frames")] / row[("parallel", "summary")]
        print(f"{k:3d} " + " ".join(f"{row[c]:14d}" for c in cols) + f" {ratio:21.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay", type=float, default=0.25)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--skip-context", action="store_true")
    args = ap.parse_args()
    from paravt_train.toy.render import write_segments

    with tempfile.TemporaryDirectory() as tmp:
        small = write_segments(Path(tmp) / "small.mp4", [((200, 40, 40), 2.0), ((40, 200, 40), 2.0)] * 20,
                               fps=10, width=64, height=64)
        srv = make_server(args.delay)
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
        bench_wall(small, url, args.delay, args.ks, args.repeat)
        srv.shutdown()
        if not args.skip_context:
            from paravt_train.toy.tiny import build_tiny_model

            wide = write_segments(Path(tmp) / "wide.mp4", [((200, 40, 40), 5.0), ((40, 200, 40), 5.0)] * 10,
                                  fps=10, width=640, height=360)
            model = build_tiny_model(Path(tmp) / "tiny", size="test")
            bench_context(wide, str(model))


if __name__ == "__main__":
    main()
