"""Videos by URL (:mod:`paravt_agent.video.fetch`): downloaded with limits, every non-public address refused, the
connection pinned to the checked address (TLS name and credentials kept), redirects and prefixes checked hop by hop."""

from pathlib import Path

import pytest


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
        # ... unless opened
        monkeypatch.setenv("PARAVT_ALLOW_URL_PREFIXES", f"http://127.0.0.1:{srv.server_address[1]}/")
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
