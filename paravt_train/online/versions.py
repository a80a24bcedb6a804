"""The versions an online learner made: every promoted one kept (its weights, its weight version, the feedback
rows trained into it, its gate scores), refused candidates recorded, and which version serves.

::

    OUTPUT_DIR/versions/
        index.json        [{id, step, weight_version, status, created, promoted_at, feedback, gate, reason, path}, ...]
        serving.json      {"id": "v12", "since": <unix time>}     the version the server holds
        v12/              a model directory (what the server loads; the agent config it was trained with)

Statuses: ``serving`` (exactly one), ``promoted`` (served before), ``refused`` (a candidate the gate kept aside),
``rolled-back`` (served, then taken back). Writes are atomic (temporary file, rename). :func:`push_version` puts
a version on the servers with the run's weight sync (its ``serve``), as ``paravt-train online promote|rollback``
and the learner do — one path for every push: journaled with a lease, one at a time per output directory
(:mod:`paravt_train.sync.lease`), and a push that died half-way repaired by whoever pushes next
(:func:`repair_push`).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from paravt_agent.errors import ConfigError

__all__ = ["VersionRegistry", "push_version", "repair_push", "write_event"]


class VersionRegistry:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    # ------------------------------------------------------------------ reading

    @property
    def index_file(self) -> Path:
        return self.root / "index.json"

    def versions(self) -> list[dict]:
        return json.loads(self.index_file.read_text()) if self.index_file.is_file() else []

    def get(self, vid: str) -> dict:
        for v in self.versions():
            if v["id"] == vid:
                return v
        raise ConfigError(f"no version {vid!r} under {self.root} (see `paravt-train online versions`)")

    def serving(self) -> dict | None:
        f = self.root / "serving.json"
        if not f.is_file():
            return None
        return self.get(json.loads(f.read_text())["id"])

    def promoted(self) -> list[dict]:
        """Versions that were served, oldest first."""
        return sorted((v for v in self.versions() if v.get("promoted_at") is not None), key=lambda v: v["promoted_at"])

    def served_at(self, t: float) -> str | None:
        """The id of the version that served at Unix time ``t`` (by promotion times)."""
        current = None
        for v in self.promoted():
            for at in v.get("served_from", [v["promoted_at"]]):
                if at <= t and (current is None or at >= current[1]):
                    current = (v["id"], at)
        return current[0] if current else None

    def served_before(self, vid: str) -> dict | None:
        """The version that served immediately before ``vid``'s current serving period (by the times each version
        began serving), or None: ``vid`` never served, nothing served before it, or ``vid`` serves again because a
        rollback (the learner's or the operator's) put it back — the version it replaced was taken back, and a
        rolled-back version is never the baseline of a rollback."""
        rec = self.get(vid)
        if not rec.get("served_from") or str(rec.get("reason", "")).startswith("rollback"):
            return None
        periods = sorted((at, v["id"]) for v in self.versions() for at in v.get("served_from", []))
        mine = max(rec["served_from"])
        earlier = [v for at, v in periods if at < mine and v != vid]
        if not earlier:
            return None
        prev = self.get(earlier[-1])
        return None if prev["status"] == "rolled-back" else prev

    def rollback_target(self) -> dict | None:
        """The version ``paravt-train online rollback`` puts back when it is given none: the newest one that served
        before the serving version's current period and was never taken back (status ``rolled-back``: a version an
        automatic or operator rollback removed is never restored by default; the operator can name it)."""
        serving = self.serving()
        if serving is None:
            return None
        mine = max(_periods(serving) or [0.0])
        earlier = sorted((at, v["id"]) for v in self.versions() for at in _periods(v) if at < mine)
        for _, vid in reversed(earlier):
            v = self.get(vid)
            if vid != serving["id"] and v["status"] != "rolled-back":
                return v
        return None

    # ------------------------------------------------------------------ writing

    def _write(self, name: str, obj) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{name}.tmp"
        tmp.write_text(json.dumps(obj, indent=1))
        tmp.replace(self.root / name)

    def add(self, vid: str, step: int, path: str | Path, status: str, feedback: list[int] | None = None,
            gate: dict | None = None, reason: str = "") -> dict:
        rec = {"id": vid, "step": step, "weight_version": str(step), "status": status, "created": time.time(),
               "promoted_at": None, "served_from": [], "path": str(path), "feedback": list(feedback or []),
               "gate": gate or {}, "reason": reason}
        self._write("index.json", [v for v in self.versions() if v["id"] != vid] + [rec])
        return rec

    def update(self, vid: str, **changes) -> dict:
        out, rec = [], None
        for v in self.versions():
            if v["id"] == vid:
                v = {**v, **changes}
                rec = v
            out.append(v)
        if rec is None:
            raise ConfigError(f"no version {vid!r} under {self.root}")
        self._write("index.json", out)
        return rec

    def set_serving(self, vid: str, reason: str = "") -> dict:
        """Mark ``vid`` as the served version (the one before it becomes ``promoted`` or, when ``reason`` says it
        was taken back, ``rolled-back``)."""
        now = time.time()
        before = self.serving()
        if before is not None and before["id"] != vid:
            self.update(before["id"], status="rolled-back" if reason.startswith("rollback") else "promoted")
        rec = self.get(vid)
        self.update(vid, status="serving", promoted_at=rec.get("promoted_at") or now,
                    served_from=[*rec.get("served_from", []), now], reason=reason or rec.get("reason", ""))
        self._write("serving.json", {"id": vid, "since": now})
        return self.get(vid)

    def prune_refused(self, keep: int) -> None:
        """Delete the weights of all but the newest ``keep`` refused candidates (their records stay)."""
        refused = sorted((v for v in self.versions() if v["status"] == "refused" and Path(v["path"]).exists()),
                         key=lambda v: v["created"])
        for v in refused[: max(0, len(refused) - keep)]:
            if Path(v["path"]).resolve().is_relative_to(self.root.resolve()):
                shutil.rmtree(v["path"], ignore_errors=True)


def _periods(v: dict) -> list[float]:
    """When ``v`` began serving, each time (a record of 0.5.0 has only its first promotion)."""
    return list(v.get("served_from") or ([v["promoted_at"]] if v.get("promoted_at") is not None else []))


def write_event(out: str | Path, rec: dict) -> dict:
    """One line of ``OUTPUT_DIR/online_events.jsonl`` (the learner's and the operator's decisions, repairs)."""
    rec = {"time": time.time(), **rec}
    Path(out).mkdir(parents=True, exist_ok=True)
    with (Path(out) / "online_events.jsonl").open("a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def repair_push(cfg, journal: Path, log=print, restore=None) -> dict | None:
    """A push the journal at ``journal`` says never ended, repaired — or None: there is none (or it ended while
    watched). Under the push lock, once its lease is known dead (:func:`~paravt_train.sync.lease.settle_unfinished`:
    a live pusher is waited for, or refused with its name): generation continued on the servers it names and a
    weight-update session it left open closed (:func:`~paravt_train.sync.release_servers`), then ``restore()``
    (the version the registry serves pushed back: the half-applied push is never taken for a version), then the
    journal removed — kept (``kept``) when a server could not be released and nothing was pushed back, so the pause
    supervisor still sees its dead lease and the next pusher tries again. Returns what was found, with
    ``continued`` and ``errors``."""
    # lazy: a command that only lists versions loads no sync (nor the HTTP client)
    from paravt_train.sync import release_servers, server_keys
    from paravt_train.sync.lease import settle_unfinished, unfinished_push

    if unfinished_push(journal) is None:  # the common case: no lock taken
        return None
    with settle_unfinished(journal, log=log) as left:
        if left is None:
            return None
        done, errors = release_servers(left["urls"], server_keys(cfg))
        if restore is not None:
            restore()  # the serving version pushed to every server again: whatever release missed, this reaches
        elif errors:
            left["keep"] = True  # a server not released: the journal stays for the supervisor and the next pusher
    return {**{k: v for k, v in left.items() if k != "keep"}, "continued": done, "errors": errors,
            "kept": bool(left.get("keep"))}


def push_version(cfg, version: dict, log=print, journal: Path | None = None) -> dict | None:
    """Put a kept version on the config's servers as its weight version, with the run's own sync
    (:func:`~paravt_train.sync.make_weight_sync`: the sync ``sync.via`` names, the servers' keys;
    :meth:`~paravt_train.sync.WeightSync.serve`: a model directory from disk, a LoRA run's adapter by name), the push
    journaled with a lease at ``journal`` (the learner's and the operator's ``OUTPUT_DIR/push.json``). A config
    without a server (backend local) has nothing to push."""
    if not cfg.endpoint or cfg.backend != "sglang":
        log(f"no server to push {version['id']} to (backend {cfg.backend}); recorded as serving")
        return None
    path = Path(version["path"])
    if not any((path / f).is_file() for f in ("config.json", "adapter_config.json")):
        raise ConfigError(f"the weights of {version['id']} are not at {path} (pruned?)")
    # lazy: a command that only lists versions needs no HTTP client
    from paravt_train.sync import make_weight_sync

    return make_weight_sync(cfg, journal=journal).serve(path, version["weight_version"])
