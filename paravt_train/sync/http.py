"""SGLang's admin HTTP API as the weight syncs use it: server URLs (a router stands for its workers), the pause
around an update, the weight-update session SGLang 0.5.21+ requires around tensor and distributed updates, and the
cache flush that waits for an idle server."""

from __future__ import annotations

import time
from collections.abc import Iterable

from paravt_agent.errors import PolicyError

__all__ = ["PAUSE_MODES", "Paused", "Session", "base_url", "expand_routers", "flush_when_idle", "json_of", "urls_of"]

PAUSE_MODES = ("retract", "in_place", "abort")


def base_url(endpoint: str) -> str:
    url = endpoint.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def urls_of(endpoints: str | Iterable[str]) -> list[str]:
    items = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    return [base_url(e) for e in items]


def json_of(resp) -> dict:
    try:
        data = resp.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def expand_routers(client, urls: list[str]) -> list[str]:
    """Each URL, or the workers behind it when it is an SGLang router (``GET /workers`` lists them): the router
    forwards generation but not weight updates, so every worker is updated directly. Asked at each push, so
    workers added to the router later are updated too."""
    out: list[str] = []
    for url in urls:
        workers = None
        try:
            resp = client.get(f"{url}/workers", timeout=10)
            data = json_of(resp) if resp.status_code == 200 else {}
            listed = data.get("workers")
            if isinstance(listed, list) and listed and all(isinstance(w, dict) and w.get("url") for w in listed):
                workers = [base_url(w["url"]) for w in listed]
        except Exception:  # noqa: BLE001 (a plain server: no /workers)
            workers = None
        for w in workers or [url]:
            if w not in out:
                out.append(w)
    return out


class Paused:
    """``/pause_generation {"mode": mode}`` on enter, ``/continue_generation`` on exit (even after a failure)."""

    def __init__(self, client, url: str, mode: str):
        self.client, self.url, self.mode = client, url, mode

    def __enter__(self):
        self.client.post(f"{self.url}/pause_generation", json={"mode": self.mode}).raise_for_status()
        return self

    def __exit__(self, *exc):
        resp = self.client.post(f"{self.url}/continue_generation", json={})
        if exc[0] is None:  # while another error unwinds, that one is the one to report
            resp.raise_for_status()
        return False


def flush_when_idle(client, url: str, timeout: float = 60.0, log=None) -> bool:
    """Flush the radix cache once the server is idle: after an ``in_place`` update it still holds prefixes computed
    with the old weights. SGLang refuses a flush while requests run or wait; ``POST /flush_cache?timeout=T``
    (0.5.22+) makes the server wait up to ``T`` seconds for idle and flush then. A server that stays busy that
    long keeps the old prefixes: requests that share one reuse its old-weight KV cache until the next flush (the
    next sync's), and this says so and returns False. A release without the parameter answers at once: it is
    asked again every half second until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        t0 = time.monotonic()
        resp = client.post(f"{url}/flush_cache", params={"timeout": round(left, 1)}, timeout=left + 30)
        if resp.status_code == 200:
            return True
        if "already in progress" in resp.text:  # another client's deferred flush will do it (or time out too)
            return True
        waited = time.monotonic() - t0
        if time.monotonic() >= deadline or waited >= left * 0.5:
            (log or print)(f"warning: {url} was never idle for {timeout:g}s after an in_place weight update "
                           f"({resp.text.strip()[:120]}); its cache keeps prefixes computed with the old weights, "
                           "which requests sharing them reuse until the next flush")
            return False
        time.sleep(0.5)  # an SGLang before 0.5.22 ignored the timeout and refused at once


class Session:
    """``/begin_weight_update`` on enter and ``/end_weight_update`` on exit (even after a failure): the session
    SGLang 0.5.21+ requires around tensor and distributed updates. A server without the routes (404: an older
    SGLang) is updated without one; a session left open by a trainer that died is closed and opened again."""

    def __init__(self, client, url: str):
        self.client, self.url, self.open = client, url, False

    def _begin(self):
        return self.client.post(f"{self.url}/begin_weight_update", json={"selector": "all"})

    def __enter__(self):
        resp = self._begin()
        if resp.status_code == 404:
            return self
        if resp.status_code == 400 and "already open" in resp.text:
            self.client.post(f"{self.url}/end_weight_update", json={})
            resp = self._begin()
        data = json_of(resp)
        if resp.status_code != 200 or not data.get("success", False):
            raise PolicyError(f"{self.url}/begin_weight_update refused: {data.get('message') or resp.text[:300]}")
        self.open = True
        return self

    def __exit__(self, *exc):
        if self.open:
            resp = self.client.post(f"{self.url}/end_weight_update", json={})
            data = json_of(resp)
            if exc[0] is None and (resp.status_code != 200 or not data.get("success", False)):
                raise PolicyError(f"{self.url}/end_weight_update refused: {data.get('message') or resp.text[:300]}")
        return False


