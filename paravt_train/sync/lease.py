"""The push journal, which is also the pause lease: what a learner killed during a push leaves behind.

A push pauses generation on a server (``/pause_generation`` … ``/continue_generation``, :class:`~paravt_train.sync.
http.Paused`); a pusher killed in between (``kill -9``, a lost node) never sends the continue, and SGLang stays
paused: every user's request waits. Two things bound and repair that:

* **the lease** (while the pusher lives): :func:`journal_push` writes the journal file *before* the first pause
  and renews it (its modification time, every second, from a thread of the pushing process) until the push has
  ended, finished or failed (a failed push has continued generation already); then it removes the file. The
  server's supervisor (``paravt serve --sync-lease FILE``, :mod:`paravt_agent.serving.supervisor`) continues
  generation on a server paused for longer than ``--pause-lease`` seconds past the lease's last renewal: a dead
  pusher stops renewing, so its pause ends within that bound, while a live one's long push (a big model from a
  slow disk) is never cut short. Without a lease file the supervisor bounds every pause by the same seconds.
* **the journal** (at the next start): a journal file left behind is a push that never ended. The online learner
  (:meth:`~paravt_train.online.learner.OnlineLearner.run`) reads it before anything else
  (:func:`unfinished_push`), continues generation on the servers it names, closes a weight-update session left
  open, and puts the version its registry says serves back on them (the half-applied push is never taken for a
  version), then records the repair in ``online_events.jsonl``.

The journal is the sync's own (``WeightSync.journal``, given by whoever makes it: :func:`~paravt_train.sync.
make_weight_sync`'s ``journal``): the GRPO trainer and the online learner journal at ``OUTPUT_DIR/push.json``, and so
do an operator's ``paravt-train online promote|rollback`` on that directory; a sync made without one (a shadow
gate's server, a test) writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["RENEW_SECONDS", "journal_push", "unfinished_push"]

#: how often a live push renews its lease (the file's modification time)
RENEW_SECONDS = 1.0

def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


@contextlib.contextmanager
def journal_push(path: str | Path | None, urls: Iterable[str], version: str | None, sync: str,
                 renew_every: float = RENEW_SECONDS) -> Iterator[dict | None]:
    """Around one push: the journal at ``path`` written before it starts, its lease renewed while it runs, removed
    when it ends (however: an exception has already continued generation). Nothing when ``path`` is None."""
    if path is None:
        yield None
        return
    path = Path(path)
    record = {"version": None if version is None else str(version), "sync": sync, "urls": list(urls),
              "pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    _write(path, record)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(renew_every):
            with contextlib.suppress(OSError):
                os.utime(path)

    thread = threading.Thread(target=renew, name="paravt-push-lease", daemon=True)
    thread.start()
    try:
        yield record
    finally:
        stop.set()
        thread.join()
        path.unlink(missing_ok=True)


def unfinished_push(path: str | Path) -> dict | None:
    """The push a journal at ``path`` says never ended (None: no journal), with ``renewed``: its lease's last
    renewal (Unix time). An unreadable journal (the process died while writing it, before any pause) is
    reported with what is known."""
    path = Path(path)
    try:
        text, renewed = path.read_text(), path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = {}
    return {"version": None, "sync": None, "urls": [], **(record if isinstance(record, dict) else {}),
            "renewed": renewed}
