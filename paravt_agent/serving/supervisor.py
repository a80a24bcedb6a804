"""The pause supervisor ``paravt serve`` runs beside its SGLang servers: a push that dies half-way never leaves
generation paused for more than a bounded time.

A weight push pauses generation (``/pause_generation`` … ``/continue_generation``); a learner killed in between
never sends the continue, and SGLang would stay paused until someone did: every user's question waits. In
production the learner and the server are separate services, so the server protects itself: this supervisor
asks each server every ``poll`` seconds whether it is paused (SGLang 0.5.23: ``GET /ready`` answers 503 while
paused, ``GET /ping`` 200 while healthy, paused or not) and continues generation on one that has been paused for
longer than ``lease`` seconds past the pusher's lease:

* with a lease file (``paravt serve --sync-lease FILE``: the learner's push journal, ``OUTPUT_DIR/push.json``,
  which a live push renews every second, :mod:`paravt_train.sync.lease`): ``lease`` seconds after the supervisor
  last saw the lease renewed (or the pause begin, whichever is later). A live learner's push, however long, keeps
  its pause; a dead one's ends within ``lease`` (+ ``poll``) seconds.
* whatever the lease says: ``max_pause`` seconds past the pause's start (``paravt serve --max-pause``, default
  600 s; 0: no cap). That bounds a pusher that lives but hangs (its lease thread renews while the push makes no
  progress), and, without a lease file, it is the only bound, so set it above the longest push: a cap that cuts
  a live push short continues generation on half-updated weights.

What users get after a pause ended this way: the weights the server holds. A disk push is loaded by SGLang in
one call (the old or the new version); a tensor or distributed push cut between buckets leaves a mix of the two
until the learner's next start puts its serving version back (:meth:`~paravt_train.online.learner.
OnlineLearner.repair_push`). The supervisor logs each continue it makes with the lease's age, so an operator can
tell which requests that window served.

**No clock agreement.** A renewal is a change of the journal's renewal counter (:class:`LeaseWatch`: a journal of
0.5.1, which renewed by its file time, by a change of that time), never a time the writer wrote: the supervisor
times how long the counter has stood still with its own monotonic clock. A writer whose clock is 90 s behind or
ahead of the server's (or a shared disk that stamps its own) has its live push kept and its dead one's pause ended
within ``lease`` + ``poll``, as one on the same host (``tests/test_online_ops.py`` runs both skews).

Why a lease and a supervisor rather than pushes that do not pause: the pause is what keeps a request from being
sampled by half-updated weights (a streamed push's buckets arrive one by one) and what ``retract`` continues on the
new weights; SGLang's own unpaused update waits for every request in flight to finish. The lease keeps those, and
only a pusher that stopped renewing loses its pause (or one past ``max_pause``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["LeaseWatch", "PauseSupervisor", "lease_token", "supervise", "supervised_urls"]


def lease_token(path: str | Path) -> tuple | None:
    """What changes each time the pusher renews the lease at ``path`` (None: no journal there): the journal's
    ``(token, renewals)`` (its pusher's id and renewal counter, :mod:`paravt_train.sync.lease`); a journal without a
    counter (0.5.1's, renewed by its file time; or one cut short while written) by its file time, compared only with
    itself, never with a clock."""
    try:
        with open(path, "rb") as f:
            stat, text = os.fstat(f.fileno()), f.read()
    except FileNotFoundError:
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        rec = None
    if isinstance(rec, dict) and "renewals" in rec:
        return ("counter", rec.get("token"), rec["renewals"])
    return ("file time", stat.st_mtime_ns)


class LeaseWatch:
    """A push lease as one observer sees it: how long its renewal (:func:`lease_token`) has stood still, timed by
    the observer's own monotonic clock from the first time it looked. Neither the writer's clock nor the disk's is
    ever compared with the observer's."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._token: tuple | None = None
        self._since = 0.0

    def age(self, now: float | None = None) -> float | None:
        """Seconds of this observer's clock (``time.monotonic()``, or ``now`` on the same clock) since it saw the
        lease renewed, or first saw the journal; None: no journal."""
        now = time.monotonic() if now is None else now
        token = lease_token(self.path)
        if token is None:
            self._token = None
            return None
        if token != self._token:
            self._token, self._since = token, now
        return now - self._since


class PauseSupervisor:
    """Continues generation on servers (``urls``, each an SGLang server, never a router: the router forwards no
    pause) left paused past the lease (see the module). ``start()`` runs it in a daemon thread; :meth:`check` is one
    round (what the thread runs every ``poll`` seconds). ``admin_key``: the server's admin key, when it has one."""

    def __init__(self, urls: Iterable[str], lease: float = 60.0, lease_file: str | Path | None = None,
                 poll: float = 1.0, admin_key: str | None = None, max_pause: float = 600.0, log=print,
                 api_key: str | None = None):
        if lease <= 0:
            raise ValueError(f"lease {lease}: a positive number of seconds")
        if max_pause < 0:
            raise ValueError(f"max_pause {max_pause}: seconds, or 0 for no cap")
        self.max_pause = max_pause
        self.urls = [u.rstrip("/") for u in urls]
        self.lease, self.poll, self.log = lease, poll, log
        self.lease_file = None if lease_file is None else Path(lease_file)
        self.watch = None if lease_file is None else LeaseWatch(lease_file)
        # SGLang 0.5.23's keys by route: /ping takes the API key (never the admin key alone), /continue_generation
        # the admin key when the server has one, else the API key; /ready asks for none
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        admin = admin_key or api_key
        self.admin_headers = {"Authorization": f"Bearer {admin}"} if admin else {}
        self.paused_since: dict[str, float] = {}  # url -> when this supervisor first saw it paused (monotonic)
        self.continued: list[dict] = []  # what it did: {url, paused_s, lease_age_s, at (Unix time), why}
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
            ping = client.get(f"{url}/ping", timeout=5, headers=self.headers)
            return ping.status_code == 200  # healthy but not ready: paused
        except Exception:  # noqa: BLE001 (a server that does not answer is not ours to continue)
            return None

    def check(self, client=None, now: float | None = None) -> list[str]:
        """One round: the servers it continued (``now``: this supervisor's clock, ``time.monotonic()``)."""
        import httpx

        own = client is None
        client = client or httpx.Client()
        try:
            done = []
            for url in self.urls:
                now_ = time.monotonic() if now is None else now
                state = self.paused(client, url)
                age = None if self.watch is None else self.watch.age(now_)  # seen every round, paused or not
                if not state:
                    self.paused_since.pop(url, None)
                    continue
                since = self.paused_since.setdefault(url, now_)
                lapsed = age is not None and min(age, now_ - since) > self.lease
                capped = self.max_pause > 0 and now_ - since > self.max_pause
                if not (lapsed or capped):
                    continue
                resp = client.post(f"{url}/continue_generation", json={}, timeout=30, headers=self.admin_headers)
                if resp.status_code != 200:
                    self.log(f"pause supervisor: {url}/continue_generation answered {resp.status_code}: "
                             f"{resp.text[:200]}")
                    continue
                rec = {"url": url, "paused_s": round(now_ - since, 1), "at": time.time(),
                       "lease_age_s": None if age is None else round(age, 1)}
                self.continued.append(rec)
                self.paused_since.pop(url, None)
                rec["why"] = "lease" if lapsed else "max-pause"
                why = (f"its lease {self.lease_file} not renewed for {rec['lease_age_s']:.0f}s, lease "
                       f"{self.lease:g}s: the pusher is gone" if lapsed else
                       f"past --max-pause {self.max_pause:g}s" + ("" if age is None else
                                                                  " although its lease is renewed: a hung pusher?"))
                self.log(f"pause supervisor: {url} was paused for {rec['paused_s']:.0f}s ({why}): generation "
                         "continued on the weights it holds")
                done.append(url)
            return done
        finally:
            if own:
                client.close()

    def _run(self) -> None:
        import httpx

        with httpx.Client() as client:
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


def supervised_urls(host: str, port: int, dp: int = 1, worker_host: str | None = None) -> list[str]:
    """The servers ``paravt serve --port PORT --dp N`` starts: the one server, or the router's workers (ports
    ``PORT+1 … PORT+N`` at the address they were registered under; the router itself forwards no pause)."""
    from paravt_agent.serving.fleet import worker_address  # the one rule of where workers listen

    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if dp == 1:
        return [f"http://{local}:{port}"]
    advertised = worker_address(host, worker_host)[1]
    return [f"http://{advertised}:{port + 1 + i}" for i in range(dp)]


def supervise(host: str, port: int, dp: int, lease: float, lease_file: str | Path | None = None,
              max_pause: float = 600.0, log=print, api_key: str | None = None, admin_key: str | None = None,
              worker_host: str | None = None) -> PauseSupervisor | None:
    """``paravt serve``'s supervisor of the servers it started, running (None with ``lease`` 0, or without a lease
    file and with ``max_pause`` 0: off), with the servers' keys (each route asked with the one it takes)."""
    if lease <= 0 or (lease_file is None and max_pause <= 0):
        return None
    cap = f"{max_pause:g}s past its start" if max_pause > 0 else ""
    log("pause supervisor: a pause lasts at most "
        + (f"{lease:g}s past the last renewal of the lease {lease_file} (seen by this process's clock)"
           + (f", and {cap}" if cap else "")
           if lease_file else cap))
    return PauseSupervisor(supervised_urls(host, port, dp, worker_host), lease=lease, lease_file=lease_file,
                           max_pause=max_pause, log=log, api_key=api_key, admin_key=admin_key).start()
