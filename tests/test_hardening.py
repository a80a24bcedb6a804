"""Model output, video files and endpoint replies that are hostile but fair: nothing crashes, hangs or misleads."""

import time
from pathlib import Path

import pytest

from paravt_agent.protocol import (
    MAX_CALLS,
    CallError,
    extract_answer,
    extract_choice,
    is_degenerate,
    parse_span,
    parse_time,
    parse_tool_calls,
    split_think,
    strip_tool_blocks,
    tag_stats,
)

# adversarial shapes: each builds a text of about n characters
SHAPES = {
    "fence_spaces": lambda n: "<tool_call>```" + " " * n,
    "answer_spaces": lambda n: "<answer>answer" + " " * n + "z</answer>",
    "digits": lambda n: "9" * n,
    "spaced_digits": lambda n: "1 " + " " * n + "- 2",
    "empty_calls": lambda n: "<tool_call></tool_call>" * (n // 23),
    "open_braces": lambda n: "<tool_call>" + "{" * n,
    "open_brackets": lambda n: '<tool_call>{"name": "crop_video", "arguments": ' + "[" * n,
    "nested_json": lambda n: '<tool_call>{"name": "crop_video", "arguments": ' + '{"a": ' * (n // 6) + "1",
    "python_parens": lambda n: "<tool_call>crop_video(" + "(" * n,
    "think_tags": lambda n: "<think>" * (n // 7),
    "unclosed_calls": lambda n: "<tool_call>" * (n // 11),
    "im_start": lambda n: "<|im_start|>" * (n // 12),
    "answer_is": lambda n: "answer is " * (n // 10),
    "colons": lambda n: "1:" * (n // 2),
    "brackets_span": lambda n: "[" + "1, " * (n // 3),
    "words": lambda n: "a " * (n // 2),
}
PARSERS = {
    "parse_tool_calls": parse_tool_calls,
    "extract_answer": extract_answer,
    "extract_choice": lambda t: extract_choice(t, ["a dog", "a cat", "a bird", "z"]),
    "parse_span": parse_span,
    "tag_stats": tag_stats,
    "is_degenerate": is_degenerate,
    "split_think": split_think,
    "strip_tool_blocks": strip_tool_blocks,
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_parser_is_linear_and_never_raises(shape):
    """Every parser over 1k, 10k and 100k characters of each adversarial shape: it returns (no exception on
    model output) within a generous bound, and 10x the input never costs 30x the time
    (each size timed three times, the fastest kept)."""
    for name, parse in PARSERS.items():
        times = []
        for n in (1_000, 10_000, 100_000):
            text = SHAPES[shape](n)
            best = float("inf")
            for _ in range(3):  # the fastest of three: a pause of the (shared, noisy) CI machine is not growth
                t0 = time.perf_counter()
                parse(text)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
        assert times[2] < 2.0, f"{name} on {shape}: {times}"
        assert times[2] < 30 * times[1] + 0.05, f"{name} on {shape} grows faster than linear: {times}"


def test_huge_numbers_and_deep_json_are_call_errors():
    for text in (
        '<tool_call>{"name": "crop_video", "arguments": {"start_time": 1, "end_time": ' + "9" * 401 + "}}</tool_call>",
        '<tool_call>{"name": "crop_video", "arguments": {"start_time": 1, "end_time": ' + "9" * 5001 + "}}</tool_call>",
        '<tool_call>{"name": "crop_video", "arguments": ' + "[" * 1000 + "]" * 1000 + "}</tool_call>",
        "<tool_call>crop_video(1, " + "9" * 5001 + ")</tool_call>",
        "<tool_call>crop_video(" + "(" * 1000 + ")</tool_call>",
    ):
        calls = parse_tool_calls(text)
        assert calls and all(isinstance(c, CallError) or c.ok for c in calls)
    with pytest.raises(ValueError):
        parse_time(10**401)
    with pytest.raises(ValueError):
        parse_time("9" * 500)
    assert parse_time("01:02:03") == 3723.0 and parse_time(" 80.5 s ") == 80.5


def test_a_flood_of_calls_is_bounded():
    calls = parse_tool_calls("<tool_call></tool_call>" * 217_391)
    assert len(calls) == MAX_CALLS + 1 and "not parsed" in calls[-1].message
    many = '<tool_call>[' + ", ".join(['{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 2}}'] *
                                       80_000) + "]</tool_call>"
    [err] = parse_tool_calls(many)  # one block too long to parse: one error slot, never 80,000 calls
    assert isinstance(err, CallError) and "too long" in err.message and len(err.raw) <= 200
    array = "<tool_call>[" + ", ".join(['{"name": "zoom_frame", "arguments": {"time": 1}}'] * 100) + "]</tool_call>"
    calls = parse_tool_calls(array)
    assert len(calls) == MAX_CALLS + 1 and all(c.ok for c in calls[:-1]) and "36 more" in calls[-1].message


# --------------------------------------------------------------------------- videos


def _write(path, frames, rate=4, rotation=None, gop=None):
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=rate)
        s.height, s.width = frames[0].shape[:2]
        s.pix_fmt = "yuv420p"
        if gop:
            s.codec_context.gop_size = gop
        if rotation is not None:
            s.set_display_rotation(rotation)
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return str(path)


def test_rotated_phone_videos_reach_the_model_upright(tmp_path):
    import numpy as np
    from av.video.stream import VideoStream

    if not hasattr(VideoStream, "set_display_rotation"):  # reading the matrix needs PyAV 14.1, writing it 18
        pytest.skip("this PyAV cannot write a display matrix (PyAV >= 18 can); the reader needs >= 14.1")

    from paravt_agent.video import VideoReader

    img = np.zeros((32, 64, 3), np.uint8)
    img[:, :32] = (230, 20, 20)  # left half red, right half blue (as coded)
    img[:, 32:] = (20, 20, 230)
    for rotation, k in ((90, 1), (270, 3), (180, 2)):
        path = _write(tmp_path / f"rot{rotation}.mp4", [img] * 8, rotation=rotation)
        r = VideoReader(path)
        assert r.info.rotation == rotation
        frame = r.overview(n=2, max_pixels=64 * 32, factor=32).frames[0]
        want = np.rot90(img, k)  # displayed: turned counter-clockwise by the display matrix
        assert frame.shape == want.shape
        assert np.abs(frame.astype(int) - want.astype(int)).mean() < 20
    plain = VideoReader(_write(tmp_path / "plain.mp4", [img] * 8))
    assert plain.info.rotation == 0 and (plain.info.width, plain.info.height) == (64, 32)


def test_a_text_file_is_not_a_video(tmp_path, media):
    from paravt_agent.agent import Agent
    from paravt_agent.errors import VideoError
    from paravt_agent.policy.scripted import ScriptedPolicy
    from paravt_agent.video import open_video

    text = tmp_path / "notes.txt"
    text.write_text("hello world this is a longer text file with some content " * 50)
    with pytest.raises(VideoError, match="not a video"):
        open_video(text)
    agent = Agent(policy=ScriptedPolicy(lambda role, m: "<answer>A</answer>"))
    with pytest.raises(VideoError, match="not a video"):
        agent.answer(text, "What is shown?")


def test_keyframe_overview_fills_every_target(tmp_path):
    import numpy as np

    from paravt_agent.video import VideoReader

    frames = [np.full((32, 32, 3), 6 * i, np.uint8) for i in range(40)]
    path = _write(tmp_path / "sparse.mp4", frames, rate=4, gop=250)  # one keyframe in 10 s
    clip = VideoReader(path).overview(n=8, fast_overview=True)
    assert len(clip) == 8 and clip.timestamps == sorted(set(clip.timestamps))  # exactly n, increasing
    assert not clip.warnings


def test_damaged_video_warnings_reach_the_trace(media, tmp_path):
    from pathlib import Path

    from paravt_agent.agent import Agent
    from paravt_agent.policy.scripted import ScriptedPolicy

    data = Path(media["faststart"]).read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: int(len(data) * 0.6)])
    agent = Agent(policy=ScriptedPolicy(lambda role, m: "<think>seen</think><answer>A</answer>"))
    with pytest.warns(RuntimeWarning):
        ans = agent.answer(cut, "What is shown?")
    assert ans.trace.warnings and "truncated" in ans.trace.warnings[0] and "Warnings:" in ans.trace.render()


def test_empty_and_degenerate_answers_are_flagged(media):
    from paravt_agent.agent import Agent
    from paravt_agent.config import AgentConfig
    from paravt_agent.policy.scripted import ScriptedPolicy

    empty = Agent(policy=ScriptedPolicy(lambda role, m: ""), config=AgentConfig(mode="none", think_prefix=""))
    ans = empty.answer(media["video"], "q?")
    assert not ans.ok and "empty answer" in ans.trace.errors[0]
    loop = Agent(policy=ScriptedPolicy(lambda role, m: "<|im_start|>assistant\n" * 8), config=AgentConfig(mode="none"))
    ans = loop.answer(media["video"], "q?")
    assert not ans.ok and "degenerate" in ans.trace.errors[0]
    good = Agent(policy=ScriptedPolicy(lambda role, m: "<think>fine</think><answer>A</answer>"),
                 config=AgentConfig(mode="none"))
    assert good.answer(media["video"], "q?").ok


def test_failed_requests_are_stored_with_their_error(media, tmp_path):
    from paravt_agent.agent import Agent
    from paravt_agent.errors import PolicyError
    from paravt_agent.policy.scripted import ScriptedPolicy
    from paravt_agent.store import TrajectoryStore

    def down(role, messages):
        raise PolicyError("endpoint down")

    store = TrajectoryStore(tmp_path / "t.db")
    agent = Agent(policy=ScriptedPolicy(down), store=store)
    with pytest.raises(PolicyError):
        agent.answer(media["video"], "q?")
    [row] = store.export()
    assert row["errors"] == ["endpoint down"] and row["question"] == "q?"


def test_a_request_deadline(media):
    from paravt_agent.agent import Agent
    from paravt_agent.config import AgentConfig
    from paravt_agent.policy.scripted import ScriptedPolicy

    def script(role, messages):
        if role == "planner" and "<tool_response>" not in str(messages[-1]["content"]):
            return '<think>look</think><tool_call>{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 3}}</tool_call>'
        return "<think>x</think><answer>A</answer>"

    agent = Agent(policy=ScriptedPolicy(script, delay=0.6), config=AgentConfig(request_timeout=1.0, retries=0))
    t0 = time.perf_counter()
    ans = agent.answer(media["video"], "q?")
    assert time.perf_counter() - t0 < 2.5 and not ans.ok and "request_timeout" in ans.trace.errors[0]
    assert ans.trace.turns  # what finished is kept


def test_videos_by_url_are_downloaded_with_limits(media, tmp_path, monkeypatch):
    import functools
    import http.server
    import shutil
    import subprocess
    import sys
    import threading

    from paravt_agent.agent import Agent
    from paravt_agent.errors import VideoError
    from paravt_agent.policy.scripted import ScriptedPolicy
    from paravt_agent.video.fetch import local_video

    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(media["video"], site / "clip.mp4")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/clip.mp4"
    monkeypatch.setenv("PARAVT_HOME", str(tmp_path / "home"))
    try:
        agent = Agent(policy=ScriptedPolicy(lambda role, m: "<think>seen</think><answer>A</answer>"))
        with pytest.raises(VideoError, match="is a loopback address"):  # the operator's own network: refused ...
            agent.answer(url, "What is shown?")
        monkeypatch.setenv("PARAVT_ALLOW_URL_PREFIXES", f"http://127.0.0.1:{srv.server_address[1]}/")  # ... unless opened
        ans = agent.answer(url, "What is shown?")
        assert ans.ok and ans.trace.video == url and ans.trace.duration == pytest.approx(40.0)
        with pytest.raises(VideoError, match="download limit"):
            local_video(url.replace("clip", "clip") + "?again", max_bytes=1000)
        with pytest.raises(VideoError, match="only local files and http"):
            local_video("file:///etc/passwd")
        with pytest.raises(VideoError, match="HTTP 404"):
            local_video(url.replace("clip.mp4", "missing.mp4"))
        # the CLI keeps the URL whole (a path argument would have made it "http:/...")
        res = subprocess.run([sys.executable, "-m", "paravt_agent.cli", "answer", url.replace("clip", "nope"), "q?",
                              "--backend", "openai", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m"],
                             capture_output=True, text=True, env={**__import__("os").environ,
                                                                 "PARAVT_HOME": str(tmp_path / "home")})
        assert res.returncode == 1 and "http://127.0.0.1" in res.stderr and "http:/1" not in res.stderr
    finally:
        srv.shutdown()


@pytest.mark.parametrize("address,why", [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"),
    ("172.16.0.1", "private"), ("192.168.1.20", "private"), ("fc00::1", "private"), ("169.254.169.254", "link-local"),
    ("fe80::1", "link-local"), ("224.0.0.1", "multicast"), ("ff02::1", "multicast"), ("0.0.0.0", "unspecified"),
    ("::", "unspecified"), ("240.0.0.1", "reserved"), ("100.64.0.1", "non-public"), ("192.0.2.1", "private"),
    ("::ffff:127.0.0.1", "loopback"), ("fec0::1", "site-local"),
    ("2002:c0a8:0101::1", "private (embedded"), ("8.8.8.8", None), ("2001:4860:4860::8888", None),
    ("93.184.216.34", None)])
def test_every_non_public_address_class_is_refused(address, why):
    from paravt_agent.video.fetch import address_refusal

    got = address_refusal(address)
    assert (got is None) if why is None else got.startswith(why), got


def test_a_pinned_request_keeps_the_urls_host_tls_name_and_credentials():
    from paravt_agent.video.fetch import _pinned

    url, headers, ext = _pinned("https://user:pw@Bücher.example:8443/a/v.mp4?x=1", "93.184.216.34")
    assert url == "https://user:pw@93.184.216.34:8443/a/v.mp4?x=1"
    assert headers == {"Host": "xn--bcher-kva.example:8443"} and ext == {"sni_hostname": "xn--bcher-kva.example"}
    url, headers, ext = _pinned("https://[2606:4700::1111]/v.mp4", "2606:4700::1111")
    assert url == "https://[2606:4700::1111]/v.mp4" and headers == {"Host": "[2606:4700::1111]"} and ext == {}


def test_url_checks_follow_redirects_and_connect_to_the_checked_address(tmp_path, monkeypatch, media):
    """A client cannot reach the operator's network through a redirect, a prefix look-alike or a second DNS
    answer; an operator's prefix opens exactly what it names."""
    import http.server
    import threading

    from paravt_agent.errors import VideoError
    from paravt_agent.video import fetch

    data = Path(media["video"]).read_bytes()
    hits: list[tuple[str, str]] = []

    class Site(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append((self.server.server_address[1], self.path, self.headers.get("Host")))
            if "/to/" in self.path:  # .../to/<url>: a redirect there
                self.send_response(302)
                self.send_header("Location", self.path.split("/to/", 1)[1])
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Site) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    a, b = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
    pb = servers[1].server_address[1]
    cache = tmp_path / "dl"
    monkeypatch.delenv(fetch.ALLOW_ENV, raising=False)
    try:
        with pytest.raises(VideoError, match="is a loopback address"):
            fetch.local_video(f"{b}/v.mp4", cache=cache)
        with pytest.raises(VideoError, match="is a loopback address"):
            fetch.local_video(f"http://[::1]:{pb}/v.mp4", cache=cache)
        # a prefix opens what it names, not a look-alike host or a sibling path
        assert Path(fetch.local_video(f"{a}/ok/v.mp4", cache=cache, allow_prefixes=[a + "/ok"])).read_bytes() == data
        with pytest.raises(VideoError, match="loopback"):
            fetch.local_video(f"{a}/okay/v.mp4", cache=cache, allow_prefixes=[a + "/ok"])
        for sneaky in (f"{a}/ok/../v.mp4", f"{a}/ok/%2e%2e/v.mp4", f"{a}/ok%2f..%2fv.mp4", f"{a}/OK/v.mp4",
                       f"http://localhost:{servers[0].server_address[1]}/ok/v.mp4"):
            with pytest.raises(VideoError, match="loopback"):
                fetch.local_video(sneaky, cache=cache, allow_prefixes=[a + "/ok"])
        # an allowed site redirecting into the network: the hop is checked, the target never contacted
        n = len(hits)
        with pytest.raises(VideoError, match="is a loopback address"):
            fetch.local_video(f"{a}/ok/to/{b}/secret.mp4", cache=cache, allow_prefixes=[a + "/ok"])
        assert [h[0] for h in hits[n:]] == [servers[0].server_address[1]]
        # a redirect loop ends
        with pytest.raises(VideoError, match="more than 5 redirects"):
            fetch.local_video(f"{a}/to/{a}/to/{a}/to/{a}/to/{a}/to/{a}/to/{a}/v.mp4", cache=cache, allow_prefixes=[a])
        # DNS pinning: the name resolves once, is checked, and the connection goes to that address (the system
        # resolver cannot resolve it; the Host header still names it)
        monkeypatch.setattr(fetch, "address_refusal", lambda address: None)
        monkeypatch.setattr(fetch, "_resolve", lambda host, port: ["127.0.0.1"] if host == "video.example" else [])
        got = fetch.local_video(f"http://video.example:{pb}/pinned.mp4", cache=cache)
        assert Path(got).read_bytes() == data and hits[-1][1:] == ("/pinned.mp4", f"video.example:{pb}")
    finally:
        for s in servers:
            s.shutdown()


@pytest.mark.parametrize("body,ctype", [(b"this is not json", "application/json"),
                                        (b"<html><body>proxy login</body></html>", "text/html")])
def test_an_endpoint_answering_200_with_junk_is_a_policy_error(media, body, ctype):
    import http.server
    import threading

    from paravt_agent.agent import Agent
    from paravt_agent.config import AgentConfig
    from paravt_agent.errors import PolicyError

    class Junk(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Junk)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        agent = Agent(backend="openai", endpoint=f"http://127.0.0.1:{srv.server_address[1]}/v1", model="m",
                      config=AgentConfig(retries=0, mode="none"), policy_kwargs={"max_retries": 0})
        with pytest.raises(PolicyError, match="not a chat completion"):
            agent.answer(media["video"], "q?")
    finally:
        srv.shutdown()
