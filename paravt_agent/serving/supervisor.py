"""The pause supervisor ``paravt serve`` runs beside its SGLang servers: a push that dies half-way never leaves
generation paused for more than a bounded time.

A weight push pauses generation (``/pause_generation`` … ``/continue_generation``); a learner killed in between
never sends the continue, and SGLang would stay paused until someone did: every user's question waits. In
production the learner and the server are separate services, so the server protects itself: this supervisor
asks each server every ``poll`` seconds whether it is paused (SGLang 0.5.23: ``GET /ready`` answers 503 while
paused, ``GET /ping`` 200 while healthy, paused or not) and continues generation on one that has been paused for
longer than ``lease`` seconds past the pusher's lease:

* with a lease file (``paravt serve --sync-lease FILE``: the learner's push journal, ``OUTPUT_DIR/push.json``,
  which a live push renews every second, :mod:`paravt_train.sync.lease`): ``lease`` seconds past the file's last
  renewal (or past the pause's start, whichever is later). A live learner's push, however long, keeps its pause;
  a dead one's ends within ``lease`` (+ ``poll``) seconds.
* without one: ``lease`` seconds past the pause's start, for every pause (set it above the longest push).

Why a lease and a supervisor rather than pushes that do not pause: the pause is what keeps a request from being
sampled by half-updated weights (a streamed push's buckets arrive one by one) and what ``retract`` continues on the
new weights; SGLang's own unpaused update waits for every request in flight to finish. The lease keeps those, and
only a pusher that stopped renewing loses its pause. A pusher that lives but hangs keeps renewing: its pause lasts
until it is stopped (its lease then lapses). The file's time is the writer's clock: learner and server hosts must
agree on the time (NTP) within a fraction of ``lease``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["PauseSupervisor", "supervise", "supervised_urls"]


class PauseSupervisor:
    """Continues generation on servers (``urls``, each an SGLang server, never a router: the router forwards no
    pause) left paused past the lease (see the module). ``start()`` runs it in a daemon thread; :meth:`check` is one
    round (what the thread runs every ``poll`` seconds). ``admin_key``: the server's admin key, when it has one."""

    def __init__(self, urls: Iterable[str], lease: float = 60.0, lease_file: str | Path | None = None,
                 poll: float = 1.0, admin_key: str | None = None, log=print):
        if lease <= 0:
            raise ValueError(f"lease {lease}: a positive number of seconds")
        self.urls = [u.rstrip("/") for u in urls]
        self.lease, self.poll, self.log = lease, poll, log
        self.lease_file = None if lease_file is None else Path(lease_file)
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.paused_since: dict[str, float] = {}  # url -> when this supervisor first saw it paused
        self.continued: list[dict] = []  # what it did: {url, paused_s, lease_age_s, at}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsupported: set[str] = set()

    def paused(self, client, url: str) -> bool | None:
        """Whether ``url`` is paused (None: it cannot say: down, starting, or without ``/ready``)."""
        try:
            ready = client.get(f"{url}/ready", timeout=5)
            if ready.status_code == 200:
                return False
            if ready.status_code == 404:
                if url not in self._unsupported:
                    self._unsupported.add(url)
                    self.log(f"pause supervisor: {url} has no /ready (SGLang before 0.5.23?): its pauses are not "
                             "bounded")
                return None
            ping = client.get(f"{url}/ping", timeout=5)
            return ping.status_code == 200  # healthy but not ready: paused
        except Exception:  # noqa: BLE001 (a server that does not answer is not ours to continue)
            return None

    def lease_renewed(self) -> float | None:
        if self.lease_file is None:
            return None
        try:
            return self.lease_file.stat().st_mtime
        except OSError:
            return None

    def check(self, client=None, now: float | None = None) -> list[str]:
        """One round: the servers it continued."""
        import httpx

        own = client is None
        client = client or httpx.Client(headers=self.headers)
        try:
            done = []
            for url in self.urls:
                now_ = time.time() if now is None else now
                state = self.paused(client, url)
                if not state:
                    self.paused_since.pop(url, None)
                    continue
                since = self.paused_since.setdefault(url, now_)
                renewed = self.lease_renewed()
                last = max(since, renewed) if renewed is not None else since
                if now_ - last <= self.lease:
                    continue
                resp = client.post(f"{url}/continue_generation", json={}, timeout=30)
                if resp.status_code != 200:
                    self.log(f"pause supervisor: {url}/continue_generation answered {resp.status_code}: "
                             f"{resp.text[:200]}")
                    continue
                rec = {"url": url, "paused_s": round(now_ - since, 1), "at": now_,
                       "lease_age_s": None if renewed is None else round(now_ - renewed, 1)}
                self.continued.append(rec)
                self.paused_since.pop(url, None)
                why = ("no lease" if renewed is None
                       else f"its lease {self.lease_file} last renewed {rec['lease_age_s']:.0f}s ago")
                self.log(f"pause supervisor: {url} was paused for {rec['paused_s']:.0f}s ({why}; the pusher is "
                         f"gone, lease {self.lease:g}s): generation continued")
                done.append(url)
            return done
        finally:
            if own:
                client.close()

    def _run(self) -> None:
        import httpx

        with httpx.Client(headers=self.headers) as client:
            while not self._stop.wait(self.poll):
                try:
                    self.check(client)
                except Exception as exc:  # noqa: BLE001 (the supervisor outlives one failed round)
                    self.log(f"pause supervisor: {exc}")

    def start(self) -> PauseSupervisor:
        self._thread = threading.Thread(target=self._run, name="paravt-pause-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.poll + 15)


def supervised_urls(host: str, port: int, dp: int = 1) -> list[str]:
    """The servers ``paravt serve --port PORT --dp N`` starts: the one server, or the router's workers (ports
    ``PORT+1 … PORT+N`` on 127.0.0.1; the router itself forwards no pause)."""
    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return [f"http://{local}:{port}"] if dp == 1 else [f"http://127.0.0.1:{port + 1 + i}" for i in range(dp)]


def supervise(host: str, port: int, dp: int, lease: float, lease_file: str | Path | None = None,
              log=print) -> PauseSupervisor | None:
    """``paravt serve``'s supervisor of the servers it started, running (None with ``lease`` 0: off)."""
    if lease <= 0:
        return None
    log(f"pause supervisor: a pause lasts at most {lease:g}s past "
        + (f"the lease {lease_file}" if lease_file else "its start"))
    return PauseSupervisor(supervised_urls(host, port, dp), lease=lease, lease_file=lease_file, log=log).start()
