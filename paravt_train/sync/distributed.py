"""``sync.via: distributed``: the trained tensors broadcast to SGLang servers on other nodes (no shared disk, as
verl, AReaL and slime do it) over a process group each server joins (``/init_weights_update_group``), one server at
a time (:class:`~paravt_train.sync.streamed.StreamedSync`: pause, session, buckets, continue).

Server ``k`` joins its own group with the trainer's rank 0 (a TCP rendezvous at ``master_address:master_port +
k``, the store prefixed by the group name, as SGLang's ``init_custom_process_group`` does; ``1 + tp_size`` ranks,
the server's TP size read from its ``/server_info``), once; each bucket is announced with
``/update_weights_from_distributed`` {names, dtypes, shapes} and its tensors broadcast from rank 0 (NCCL; gloo on
CPU) on a worker thread, watched from the calling one: a refusal or the deadline aborts the group rather than
leaving the trainer in NCCL's connect. The server's old group of a name is destroyed
(``/destroy_weights_update_group``) before every join and after a failed push: a push after a failure, a
restarted trainer or a resume joins afresh under the same name (a server still holding it would refuse the join,
and the trainer would wait in the rendezvous until its timeout).
"""

from __future__ import annotations

import logging
import threading
import time

from paravt_agent.errors import PolicyError
from paravt_train.sync.base import register
from paravt_train.sync.http import json_of
from paravt_train.sync.streamed import StreamedSync, serving_dtype

log = logging.getLogger(__name__)

__all__ = ["GROUP_TIMEOUT_MARGIN", "SGLANG_PORTS", "SGLangDistributedSync", "abort_group", "destroy_group_on",
           "ephemeral_ports", "init_weight_update_group", "port_clash"]


#: how far a rejoin's rendezvous port moves after a failed push (:meth:`SGLangDistributedSync.port_of`), and after how
#: many failures it comes back: master_port (31000 by default) + k + 100·(n mod 7) stays below 32000
REJOIN_PORT_STRIDE = 100
REJOIN_CYCLE = 7
#: ports a rendezvous must never take (SGLang 0.5.23's own, read from its source): its NCCL port range
#: (``get_free_port_below_ephemeral``: 22000-29999), its HTTP default 30000 and the ports its ZMQ sockets bind at random
#: (49152-65535), besides the OS's ephemeral range (:func:`ephemeral_ports`) and the servers' own HTTP ports
SGLANG_PORTS = ((22000, 29999, "SGLang's NCCL port range"), (30000, 30000, "SGLang's default HTTP port"),
                (49152, 65535, "the ports SGLang's ZMQ sockets bind at random"))
#: the trainer's side of a group outlives its push deadline by this much: the deadline's abort ends a stuck collective
#: first, never the group's own watchdog
GROUP_TIMEOUT_MARGIN = 60.0


def ephemeral_ports() -> tuple[int, int]:
    """The OS's ephemeral port range (``/proc/sys/net/ipv4/ip_local_port_range``; Linux's default elsewhere)."""
    try:
        from pathlib import Path  # only here: the module needs no filesystem otherwise

        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def port_clash(port: int, taken: set[int] = frozenset()) -> str | None:
    """Why ``port`` must not be a rendezvous port (None: it may): a server's HTTP port, a range of SGLang's, the OS's
    ephemeral range (another process may hold it at any moment), or not a port."""
    if not 1024 <= port <= 65535:
        return "not an unprivileged port"
    if port in taken:
        return "a server's HTTP port"
    for lo, hi, what in (*SGLANG_PORTS, (*ephemeral_ports(), "the OS's ephemeral port range")):
        if lo <= port <= hi:
            return f"inside {what} ({lo}-{hi})"
    return None


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str, backend: str = "nccl", timeout_s: float = 600.0):
    """A process group outside the default one (the trainer's rank 0 + the servers' ranks), made the way
    SGLang's ``init_custom_process_group`` makes its side: a TCP rendezvous, the store prefixed by the group
    name. It needs torch's internal group constructor, as SGLang, verl and AReaL use. A group of the same name
    this process still holds (a syncer that was never closed: a notebook's earlier trainer, say) is stale by now
    (the server's side was destroyed before this join) and is destroyed first: torch refuses a name twice."""
    import datetime

    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    stale = [pg for pg, name in list(_world.pg_names.items()) if name == group_name]
    for pg in stale:
        log.warning("weight sync: this process still held a group named %r (a sync not closed): destroyed",
                    group_name)
        abort_group(pg)
        _world.pg_names.pop(pg, None)
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg



@register("distributed")
class SGLangDistributedSync(StreamedSync):
    """Pushes tensors to SGLang servers anywhere on the network over process groups (see the module docstring):
    server ``k`` (of a router's workers, or of the endpoints given) joins its own group with this process as rank
    0, named ``group_name`` (``group_name-k`` from the second server on), its rendezvous at ``master_address``,
    port ``master_port + k`` (moved on after a failed push: :meth:`port_of`): so each server can be updated on its
    own. ``master_address`` must be reachable from the servers (this node's address); each server joins with
    ``tp_size`` ranks."""

    kind = "distributed"

    def __init__(self, endpoint, master_address: str = "127.0.0.1", master_port: int = 31000,
                 backend: str = "nccl", group_name: str = "paravt_weight_sync", **kw):
        super().__init__(endpoint, **kw)
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.group_name = group_name
        self.groups: dict[str, object] = {}  # server URL -> this process's side of its group
        self.names: dict[str, str] = {}
        self.rejoins: dict[str, int] = {}  # server URL -> pushes that failed: each rejoin takes a port of its own

    @classmethod
    def from_settings(cls, settings, url: str, *, folder, export, device, vision: bool, keys, journal):
        return cls(url, master_address=settings.master_address, master_port=settings.master_port,
                   backend=settings.group_backend, tp_size=settings.tp_size, pause_mode=settings.pause_mode,
                   bucket_bytes=settings.bucket_mb << 20, dtype=serving_dtype(settings.dtype, device),
                   device="cpu" if settings.group_backend == "gloo" else None, keys=keys, vision_trained=vision,
                   journal=journal)

    def port_of(self, url: str, k: int) -> int:
        """Server ``k``'s rendezvous port: ``master_port + k``, then ``+ 100·n`` after its ``n``-th failed push
        (n mod 7), moved on past any port that clashes (:func:`port_clash`: a server's HTTP port, SGLang's ranges,
        the OS's ephemeral ports). A group left blocked in NCCL's connect (an abort cannot reach a communicator still
        being created) keeps its store's port, so the next join must not need it."""
        from urllib.parse import urlsplit

        taken = {urlsplit(u).port or 80 for u in [*self.urls, *self.groups, *self.names]}
        port = self.master_port + k + REJOIN_PORT_STRIDE * (self.rejoins.get(url, 0) % REJOIN_CYCLE)
        while port_clash(port, taken):
            if port > 65535:
                raise PolicyError(f"no rendezvous port for {url} from sync.master_port {self.master_port}: use one in "
                                  "1024-21999 or 30001-32767")
            port += 1
        return port

    def name_of(self, url: str, k: int) -> str:
        return self.names.setdefault(url, self.group_name if k == 0 else f"{self.group_name}-{k}")

    def prepare(self, client, url: str, k: int) -> None:
        """Join server ``k``'s group once: its ``/init_weights_update_group`` (in a thread: it blocks until the
        rendezvous completes) while this process joins as rank 0. The server's old group of this name (a trainer
        that died or restarted, a failed push) is destroyed first: joining again under a name a server still holds
        fails there, and the trainer would wait in the rendezvous until its timeout."""
        if url in self.groups:
            return
        name = self.name_of(url, k)
        destroy_group_on(client, url, name)
        world = 1 + self.tp_of(url)  # this process, then the server's ranks rank_offset + tp_rank
        reply: dict[str, object] = {}

        def join() -> None:
            try:
                reply["r"] = client.post(f"{url}/init_weights_update_group", json={
                    "master_address": self.master_address, "master_port": self.port_of(url, k), "rank_offset": 1,
                    "world_size": world, "group_name": name, "backend": self.backend})
            except Exception as exc:  # noqa: BLE001 (reported below)
                reply["r"] = exc

        def refused() -> str | None:
            r = reply.get("r")
            if r is None:
                return None
            if isinstance(r, Exception) or r.status_code != 200 or not json_of(r).get("success"):
                return f"{url}/init_weights_update_group failed: " + (
                    str(r) if isinstance(r, Exception) else (json_of(r).get("message") or r.text[:300]))
            return None

        mine: dict[str, object] = {}

        def own_side() -> None:  # a server that refuses never connects: watched below rather than waited on
            try:
                mine["group"] = init_weight_update_group(self.master_address, self.port_of(url, k), 0, world, name,
                                                         self.backend, timeout_s=self.timeout + GROUP_TIMEOUT_MARGIN)
            except Exception as exc:  # noqa: BLE001 (reported below)
                mine["error"] = exc

        threads = [threading.Thread(target=join, daemon=True), threading.Thread(target=own_side, daemon=True)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout
        while any(t.is_alive() for t in threads):
            problem = refused()
            if problem:
                raise PolicyError(problem)  # send_tensors() cleans up
            if "error" in mine:
                raise PolicyError(f"joining {url}'s weight-update group failed: {mine['error']}", transient=True)
            if time.monotonic() > deadline:
                raise PolicyError(f"{url} did not join its weight-update group within {self.timeout:g}s",
                                  transient=True)
            time.sleep(0.01)
        if "error" in mine:
            raise PolicyError(f"joining {url}'s weight-update group failed: {mine['error']}", transient=True)
        self.groups[url] = mine["group"]
        problem = refused()
        if problem:
            raise PolicyError(problem)

    def failed(self, url: str) -> None:
        """After a failed push the server may be out of step (a bucket half received): both sides leave its group,
        and the next push joins afresh."""
        group = self.groups.pop(url, None)
        self.rejoins[url] = self.rejoins.get(url, 0) + 1
        if group is not None:
            abort_group(group)
        if url in self.names:
            with self.keys.client(60) as client:
                destroy_group_on(client, url, self.names[url])

    def close(self) -> None:
        """Leave every group (both sides): a later trainer joins under the same names."""
        for url in list(self.groups):
            self.failed(url)

    def send(self, client, url, bucket, i, last, version) -> None:
        """Announce one bucket and broadcast its tensors. The broadcasts run on a worker thread and this one
        watches: NCCL connects a group at its first collective and blocks there until every rank has joined, with
        no timeout of its own, so a server that refuses the bucket (its out-of-memory allocating the receive
        buffers, say) never joins and a broadcast on this thread would wait forever. A refusal, a failed
        broadcast or the deadline aborts the group (:func:`abort_group`, which ends a blocked NCCL call) and
        raises; ``send_tensors`` then leaves the group on the server's side too."""
        import torch.distributed as dist

        body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": self.names[url],
                **self._body(last, version)}
        reply: dict[str, object] = {}
        sent: dict[str, object] = {}
        group = self.groups[url]
        stop = threading.Event()

        def announce() -> None:
            try:
                reply["r"] = client.post(f"{url}/update_weights_from_distributed", json=body)
            except Exception as exc:  # noqa: BLE001 (reported below)
                reply["r"] = exc

        def broadcast() -> None:  # the server receives in the announced order
            try:
                if any(t.is_cuda for _, t in bucket):
                    import torch

                    torch.cuda.set_device(next(t.device for _, t in bucket if t.is_cuda))
                works = [dist.broadcast(t, group=group, group_src=0, async_op=True) for _, t in bucket]
                while not all(w.is_completed() for w in works):
                    if stop.wait(0.005):
                        return
                for w in works:
                    w.wait()
                sent["done"] = True
            except Exception as exc:  # noqa: BLE001 (reported below)
                sent["error"] = exc

        def refusal() -> str | None:
            r = reply.get("r")
            if r is None:
                return None
            if isinstance(r, Exception) or r.status_code != 200 or not json_of(r).get("success"):
                return str(r) if isinstance(r, Exception) else (json_of(r).get("message") or r.text[:300])
            return None

        announcer = threading.Thread(target=announce, daemon=True)
        sender = threading.Thread(target=broadcast, daemon=True, name=f"paravt-broadcast-{i + 1}")
        announcer.start()
        sender.start()
        deadline = time.monotonic() + self.timeout
        problem = None
        while sender.is_alive() and problem is None:
            if refusal():
                problem = PolicyError(f"{url}/update_weights_from_distributed refused bucket {i + 1}: {refusal()}")
            elif time.monotonic() > deadline:
                problem = PolicyError(f"bucket {i + 1} was not received by {url} within {self.timeout:g}s",
                                      transient=True)
            else:
                sender.join(0.01)
        if problem is None and "error" in sent:
            problem = PolicyError(f"broadcasting bucket {i + 1} to {url} failed: {sent['error']}", transient=True)
        if problem is not None:
            stop.set()
            self.groups.pop(url, None)
            abort_group(group)  # ends a broadcast blocked in NCCL's connect; send_tensors() leaves the server's side
            raise problem
        announcer.join(max(0.0, deadline - time.monotonic()))
        if reply.get("r") is None or refusal():
            raise PolicyError(f"{url}/update_weights_from_distributed refused bucket {i + 1}: "
                              f"{refusal() or 'no answer'}")


def abort_group(group) -> None:
    """End this process's side of a weight-update group, even one blocked in a collective: ``abort()`` (NCCL
    aborts its communicators, which makes a blocked call return with an error), then destroy it."""
    import torch.distributed as dist

    try:
        group.abort()
    except Exception:  # noqa: BLE001 (a backend without abort, or already broken)
        pass
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 (already destroyed, or broken)
        pass


def destroy_group_on(client, url: str, name: str) -> None:
    """``/destroy_weights_update_group`` on one server (HTTP 400 "does not exist" when it holds none)."""
    try:
        client.post(f"{url}/destroy_weights_update_group", json={"group_name": name}, timeout=60)
    except Exception:  # noqa: BLE001 (a server that cannot answer is reported by the join that follows)
        pass
