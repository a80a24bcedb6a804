"""Streamed weight syncs: the trained tensors themselves go to SGLang servers, bucket by bucket.

* :class:`SGLangTensorSync` (``weight_sync: tensor``): co-located servers. Each bucket is a
  ``/update_weights_from_tensor`` call carrying SGLang's serialised named tensors (a ``ForkingPickler``
  payload, base64, one copy per tensor-parallel rank): CUDA tensors travel as IPC handles tagged with
  their device's UUID (as SGLang's own helper does), CPU tensors as shared-memory files.
* :class:`SGLangDistributedSync` (``weight_sync: distributed``): servers on other nodes. The trainer's
  rank 0 and every server rank form a process group once (``/init_weights_update_group``: a TCP
  rendezvous at ``master_address:master_port``, the store prefixed by the group name, as SGLang's
  ``init_custom_process_group`` does); each bucket is announced with ``/update_weights_from_distributed``
  {names, dtypes, shapes} and its tensors broadcast from rank 0 over that group (NCCL; gloo on CPU).

Both run inside ``/pause_generation`` … ``/continue_generation`` and a weight-update session
(``/begin_weight_update`` … ``/end_weight_update``, which SGLang 0.5.21+ requires) on every target at
once, so each bucket reaches every server before the next one is gathered; the last bucket flushes the
cache (not with ``in_place``) and names the ``weight_version``. Feed them :func:`stream_parameters`: one
parameter at a time, gathered onto the sending rank in the serving dtype, so the sending GPU holds at
most two buckets and no rank ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator

from paravt_agent.errors import PolicyError
from paravt_train.sync.base import WeightSync
from paravt_train.sync.http import (
    PAUSE_MODES,
    Paused,
    Session,
    expand_routers,
    flush_when_idle,
    json_of,
    urls_of,
)

__all__ = ["SGLangDistributedSync", "SGLangTensorSync", "device_uuid", "init_weight_update_group",
           "serialize_named_tensors", "serving_dtype", "stream_parameters", "tag_device_uuid"]


def serving_dtype(name: str, device):
    """The dtype weights are sent in: ``auto`` = bfloat16 on GPUs, float32 on CPU."""
    import torch

    if name == "auto":
        return torch.bfloat16 if getattr(device, "type", str(device)) == "cuda" else torch.float32
    return getattr(torch, name)


def stream_parameters(model, dtype=None, keep: bool = True, device=None) -> Iterator[tuple[str, object]]:
    """``(name, full tensor)`` for every entry of ``model``'s state dict, one at a time. Under FSDP2 each is
    gathered from the shards (a collective: every rank must iterate to the end); ``keep=False`` ranks take
    part and drop them. Kept tensors are converted to ``dtype`` (the serving dtype) and moved to ``device``;
    a conversion that fails (out of memory) stops the yielding but not the gathering, and is raised once
    every gather has run, so no rank is left waiting in one."""
    error = None
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if keep and error is None:
            try:
                out = full.detach()
                if dtype is not None:
                    out = out.to(dtype)
                if device is not None:
                    out = out.to(device)
                out = out.contiguous()
            except Exception as exc:  # noqa: BLE001 (raised after the last gather)
                error = exc
            else:
                yield name, out
        del full
    if error is not None:
        raise error


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` (the same GPU has the same UUID in every process)."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def tag_device_uuid(reduced: tuple, uuid_of=None) -> tuple:
    """``torch.multiprocessing`` reduces a CUDA tensor to ``(rebuild_cuda_tensor, args)`` with the device
    ordinal at ``args[6]``; SGLang's server maps a device UUID there back to its own ordinal."""
    fn, args = reduced
    if len(args) > 6 and isinstance(args[6], int):
        args = (*args[:6], (uuid_of or device_uuid)(args[6]), *args[7:])
    return fn, args


def serialize_named_tensors(named_tensors: list[tuple[str, object]]) -> str:
    """SGLang's wire format for ``/update_weights_from_tensor``: a ``ForkingPickler`` pickle (tensors as
    shared-memory / CUDA IPC handles, CUDA devices tagged by UUID), base64."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch
    from torch.multiprocessing import reductions

    def reduce_tensor(t):
        out = reductions.reduce_tensor(t)
        return tag_device_uuid(out) if t.is_cuda else out

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    table = dict(pickler.dispatch_table)  # copyreg's table + torch's reductions
    table[torch.Tensor] = reduce_tensor
    table[torch.nn.Parameter] = reduce_tensor
    pickler.dispatch_table = table
    # CPU storages by shared-memory file name: a file descriptor would need the receiver to be this process's
    # child (multiprocessing's authenticated fd passing); a name opens from any process on the machine
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        pickler.dump(named_tensors)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str, backend: str = "nccl", timeout_s: float = 600.0):
    """A process group outside the default one (the trainer's rank 0 + the servers' ranks), made the way
    SGLang's ``init_custom_process_group`` makes its side: a TCP rendezvous, the store prefixed by the group
    name. It needs torch's internal group constructor, as SGLang, verl and AReaL use."""
    import datetime

    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class _StreamedSync(WeightSync):
    """Pause and session on every target, buckets streamed to all of them, the last one flushing and naming
    the version. Subclasses send one bucket (:meth:`send`)."""

    def __init__(self, endpoint: str | Iterable[str], tp_size: int = 1, bucket_bytes: int = 512 << 20,
                 timeout: float = 600.0, pause_mode: str = "retract", dtype=None, device=None):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {pause_mode!r}; use one of {', '.join(PAUSE_MODES)}")
        self.urls = urls_of(endpoint)
        self.tp_size, self.bucket_bytes, self.timeout, self.pause_mode = tp_size, bucket_bytes, timeout, pause_mode
        self.dtype, self.device = dtype, device  # what the tensors are sent as (the serving dtype), and from where

    def push(self, model, version: str, rank: int = 0) -> dict | None:
        """Every rank gathers the parameters one at a time (a collective under FSDP2); rank 0 streams them to the
        servers. The gathers the send did not reach (a failure, the other ranks) still run, so no rank is left
        waiting in one."""
        params = stream_parameters(model, self.dtype, keep=rank == 0, device=self.device)
        try:
            return self.send_tensors(params, version) if rank == 0 else None
        finally:
            for _ in params:
                pass

    def buckets(self, named_tensors: Iterable[tuple[str, object]]):
        bucket, size = [], 0
        for name, t in named_tensors:
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            bucket.append((name, t.detach().contiguous()))
            size += t.numel() * t.element_size()
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def prepare(self, client, targets: list[str]) -> None:
        """Before the pause (the distributed sync joins its group here)."""

    def failed(self) -> None:
        """After a failed push (the distributed sync leaves its group: the servers may be out of step)."""

    def send(self, client, targets: list[str], bucket: list, i: int, last: bool, version: str | None) -> None:
        raise NotImplementedError

    def _body(self, last: bool, version: str | None) -> dict:
        body = {"flush_cache": last and self.pause_mode != "in_place"}
        if last and version is not None:
            body["weight_version"] = str(version)
        return body

    def send_tensors(self, named_tensors: Iterable[tuple[str, object]], version: str | None = None) -> dict:
        """Send the tensors to every server, bucket by bucket, in one weight-update session per server;
        ``version`` (named with the last bucket, when every weight is in) becomes its ``weight_version``."""
        import httpx

        sent = n_buckets = 0
        try:
            with httpx.Client(timeout=self.timeout) as client:
                targets = expand_routers(client, self.urls)
                self.prepare(client, targets)
                with contextlib.ExitStack() as stack:
                    for url in targets:
                        stack.enter_context(Paused(client, url, self.pause_mode))
                        stack.enter_context(Session(client, url))
                    pending = None  # one bucket of look-ahead: the last one is known only at the end
                    for bucket in self.buckets(named_tensors):
                        if pending is not None:
                            self.send(client, targets, pending, n_buckets, False, version)
                            sent, n_buckets = sent + len(pending), n_buckets + 1
                        pending = bucket
                    if pending is not None:
                        self.send(client, targets, pending, n_buckets, True, version)
                        sent, n_buckets = sent + len(pending), n_buckets + 1
                if self.pause_mode == "in_place":  # the old weights' prefixes: flushed once the server is idle
                    for url in targets:
                        flush_when_idle(client, url)
        except httpx.HTTPError as exc:
            self.failed()
            raise PolicyError(f"weight sync to {self.urls} failed: {exc}", transient=True) from exc
        except Exception:
            self.failed()
            raise
        return {"success": True, "tensors": sent, "buckets": n_buckets, "servers": len(targets)}


class SGLangTensorSync(_StreamedSync):
    """Pushes tensors to co-located SGLang servers: ``POST /update_weights_from_tensor
    {"serialized_named_tensors": [payload] * tp_size, "flush_cache", "weight_version"}`` per bucket of about
    ``bucket_bytes``. Parameter names are the Hugging Face checkpoint names (what SGLang's ``load_weights``
    maps)."""

    def send(self, client, targets, bucket, i, last, version) -> None:
        payload = serialize_named_tensors(bucket)
        for url in targets:
            resp = client.post(f"{url}/update_weights_from_tensor", json={
                "serialized_named_tensors": [payload] * self.tp_size, **self._body(last, version)})
            data = json_of(resp)
            if resp.status_code != 200 or not data.get("success", False):
                raise PolicyError(f"{url}/update_weights_from_tensor refused bucket {i + 1}: "
                                  f"{data.get('message') or resp.text[:300]}")


class SGLangDistributedSync(_StreamedSync):
    """Pushes tensors to SGLang servers anywhere on the network over a process group (see the module
    docstring). ``master_address`` must be reachable from the servers (this node's address); each server
    joins with ``tp_size`` ranks."""

    def __init__(self, endpoint, master_address: str = "127.0.0.1", master_port: int = 29600,
                 backend: str = "nccl", group_name: str = "paravt_weight_sync", **kw):
        super().__init__(endpoint, **kw)
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.group_name = group_name
        self.group = None
        self.joined: list[str] = []

    def prepare(self, client, targets: list[str]) -> None:
        """Join the group once: every server's ``/init_weights_update_group`` (in threads: each blocks until
        the rendezvous completes) while this process joins as rank 0."""
        if self.group is not None:
            if targets != self.joined:
                raise PolicyError(f"the servers changed ({self.joined} -> {targets}); a weight-update group is made "
                                  "once: restart the trainer to join the new ones")
            return
        world = 1 + self.tp_size * len(targets)
        replies: dict[str, object] = {}

        def join(url: str, offset: int) -> None:
            try:
                replies[url] = client.post(f"{url}/init_weights_update_group", json={
                    "master_address": self.master_address, "master_port": self.master_port, "rank_offset": offset,
                    "world_size": world, "group_name": self.group_name, "backend": self.backend})
            except Exception as exc:  # noqa: BLE001 (reported below)
                replies[url] = exc

        threads = [threading.Thread(target=join, args=(url, 1 + k * self.tp_size), daemon=True)
                   for k, url in enumerate(targets)]
        for t in threads:
            t.start()
        self.group = init_weight_update_group(self.master_address, self.master_port, 0, world, self.group_name,
                                              self.backend, timeout_s=self.timeout)
        for t in threads:
            t.join(self.timeout)
        for url in targets:
            r = replies.get(url)
            if r is None or isinstance(r, Exception) or r.status_code != 200 or not json_of(r).get("success"):
                detail = r if isinstance(r, Exception) or r is None else (json_of(r).get("message") or r.text[:300])
                raise PolicyError(f"{url}/init_weights_update_group failed: {detail}")  # push() leaves the group
        self.joined = list(targets)

    def failed(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 (already broken)
                pass
            self.group, self.joined = None, []

    def send(self, client, targets, bucket, i, last, version) -> None:
        import torch.distributed as dist

        body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                **self._body(last, version)}
        replies: dict[str, object] = {}

        def announce(url: str) -> None:
            try:
                replies[url] = client.post(f"{url}/update_weights_from_distributed", json=body)
            except Exception as exc:  # noqa: BLE001 (reported below)
                replies[url] = exc

        def refusal(url: str) -> str | None:
            r = replies.get(url)
            if r is None:
                return None
            if isinstance(r, Exception) or r.status_code != 200 or not json_of(r).get("success"):
                return str(r) if isinstance(r, Exception) else (json_of(r).get("message") or r.text[:300])
            return None

        threads = [threading.Thread(target=announce, args=(url,), daemon=True) for url in targets]
        for t in threads:
            t.start()
        # the servers receive in the announced order; a server that refuses the announcement never receives, so
        # the broadcasts are watched rather than waited on (the group is left by push() on any failure)
        works = [dist.broadcast(t, group=self.group, group_src=0, async_op=True) for _, t in bucket]
        deadline = time.monotonic() + self.timeout
        while not all(w.is_completed() for w in works):
            bad = next(((u, refusal(u)) for u in targets if refusal(u)), None)
            if bad is not None:
                raise PolicyError(f"{bad[0]}/update_weights_from_distributed refused bucket {i + 1}: {bad[1]}")
            if time.monotonic() > deadline:
                raise PolicyError(f"bucket {i + 1} was not received within {self.timeout:g}s", transient=True)
            time.sleep(0.01)
        for w in works:
            w.wait()
        for t in threads:
            t.join(self.timeout)
        for url in targets:
            if replies.get(url) is None or refusal(url):
                raise PolicyError(f"{url}/update_weights_from_distributed refused bucket {i + 1}: "
                                  f"{refusal(url) or 'no answer'}")
