"""Streamed weight syncs: the trained tensors themselves go to SGLang servers, bucket by bucket.

* :class:`SGLangTensorSync` (``sync.via: tensor``): servers on this machine that see the trainer's rank-0 GPU
  (others are refused before the first push). Each bucket is a ``/update_weights_from_tensor`` call carrying
  SGLang's serialised named tensors (base64, serialised once per tensor-parallel rank of that server, as SGLang's
  ``Engine`` does): CUDA tensors travel as IPC handles tagged with their device's UUID (as SGLang's own helper
  does), CPU tensors by value (:func:`serialize_named_tensors`).
* :class:`~paravt_train.sync.distributed.SGLangDistributedSync` (``sync.via: distributed``, in
  :mod:`paravt_train.sync.distributed`): servers on other nodes. The trainer's
  rank 0 and each server's ranks form a process group once (``/init_weights_update_group``: a TCP
  rendezvous at ``master_address:master_port`` (+ k for server k), the store prefixed by the group name, as
  SGLang's ``init_custom_process_group`` does); each bucket is announced with ``/update_weights_from_distributed``
  {names, dtypes, shapes} and its tensors broadcast from rank 0 over that group (NCCL; gloo on CPU). The
  servers' side of a group is destroyed (``/destroy_weights_update_group``) before every join and after a
  failed push, so a push after a failure, a trainer restart or a resume joins afresh under the same name.

Before the first server is paused, each is checked (:mod:`~paravt_train.sync.checks`: its own TP size and DP from
``GET /server_info``, its GPUs for ``tensor``, its vision-feature cache when the vision tower trains). Both update
**one server at a time**: ``/pause_generation`` → a weight-update session
(``/begin_weight_update`` … ``/end_weight_update``, which SGLang 0.5.21+ requires) → every bucket (the last one
flushes the cache, not with ``in_place``, and names the ``weight_version``) → ``/continue_generation``, then the
next server. A paused SGLang answers ``/health`` with 503 after 20 s (its health check generates a token), so
pausing every worker of a router at once for a long stream could make the router mark them all unhealthy and
refuse requests until its checks pass again; one at a time, the router always has workers that answer (they serve
the previous version meanwhile, which each reply's ``weight_version`` says). :meth:`StreamedSync.push` streams
the parameters once per server (:func:`stream_parameters`: one parameter at a time, gathered onto the sending rank
in the serving dtype), so the sending GPU holds at most two buckets and no rank ever holds the whole model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from paravt_agent.errors import PolicyError
from paravt_train.infra.checkpoint import as_saved
from paravt_train.sync.base import WeightSync, register
from paravt_train.sync.checks import refuse_dp, refuse_unreachable_ipc, tp_size_of, warn_vision_cache
from paravt_train.sync.disk import SGLangWeightSync
from paravt_train.sync.http import (
    PAUSE_MODES,
    UNFLUSHED,
    Paused,
    ServerKeys,
    Session,
    expand_routers,
    finish_unflushed,
    flush_when_idle,
    json_of,
    served_version,
    server_facts,
    still_paused,
    urls_of,
)
from paravt_train.sync.lease import journal_push

__all__ = ["SGLangTensorSync", "StreamedSync", "device_uuid", "serialize_named_tensors", "serving_dtype",
           "stream_parameters", "tag_device_uuid"]


def serving_dtype(name: str, device):
    """The dtype weights are sent in: ``auto`` = bfloat16 on GPUs, float32 on CPU."""
    import torch

    if name == "auto":
        return torch.bfloat16 if getattr(device, "type", str(device)) == "cuda" else torch.float32
    return getattr(torch, name)


def stream_parameters(model, dtype=None, keep: bool = True, device=None) -> Iterator[tuple[str, object]]:
    """``(name, full tensor)`` for every entry of ``model``'s state dict, one at a time, under the name (and in the
    layout) the model's checkpoint has it (:func:`~paravt_train.infra.checkpoint.as_saved`: what SGLang's
    ``load_weights`` reads). Under FSDP2 each is
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
                yield from as_saved(model, {name: out}).items()
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
    """SGLang's wire format for ``/update_weights_from_tensor`` (what its ``MultiprocessingSerializer`` reads), one
    rank's copy, base64:

    * CUDA tensors: a ``ForkingPickler`` pickle of CUDA IPC handles, each device tagged by its UUID (as SGLang's own
      helper does). Each copy holds its own references to the sender's memory, which the rank that opens it
      releases: serialize once per tensor-parallel rank, never one payload for all.
    * CPU tensors: by value (a plain pickle; their bytes travel in the payload, which SGLang's safe unpickler
      loads). Never as shared-memory handles: torch's default ``file_descriptor`` sharing hands them over through
      ``multiprocessing``'s fd passing, authenticated with the sender's authkey, which only a child of the sender
      has (SGLang's own ``Engine`` spawns its scheduler; a trainer does not): the scheduler dies with
      "AuthenticationError: digest sent was rejected". ``file_system`` sharing would work on one machine but
      leaves a ``torch_shm_manager`` behind the sender.
    """
    import base64
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch
    from torch.multiprocessing import reductions

    if not any(getattr(t, "is_cuda", False) for _, t in named_tensors):
        def own(t):  # a view would carry its whole storage: send a tensor that owns exactly its bytes
            return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()

        return base64.b64encode(pickle.dumps([(n, own(t.detach())) for n, t in named_tensors])).decode("ascii")

    def reduce_tensor(t):
        if not t.is_cuda:
            raise ValueError("a bucket mixes CPU and CUDA tensors: send them in the serving device's buckets")
        return tag_device_uuid(reductions.reduce_tensor(t))

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    table = dict(pickler.dispatch_table)  # copyreg's table + torch's reductions
    table[torch.Tensor] = reduce_tensor
    table[torch.nn.Parameter] = reduce_tensor
    pickler.dispatch_table = table
    pickler.dump(named_tensors)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class StreamedSync(WeightSync):
    """One server at a time (a router's workers found at each push): pause, session, the buckets, the last one
    flushing and naming the version, continue. Subclasses send one bucket to one server (:meth:`send`). A saved
    directory (:meth:`serve`) is loaded from disk.

    Before the first server is paused, every server is checked (:meth:`check`, :mod:`~paravt_train.sync.checks`):
    its own TP size (``GET /server_info``; ``tp_size`` only for a server that does not report one), no DP,
    and, when ``vision_trained``, its vision-feature cache. ``keys``: the keys the servers were started with."""

    kind = "streamed"  # the sync.via name, in messages

    def __init__(self, endpoint: str | Iterable[str], tp_size: int | None = None, bucket_bytes: int = 512 << 20,
                 timeout: float = 600.0, pause_mode: str = "retract", dtype=None, device=None,
                 keys: ServerKeys | None = None, vision_trained: bool = False, log=print, journal: Path | None = None):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {pause_mode!r}; use one of {', '.join(PAUSE_MODES)}")
        self.urls = urls_of(endpoint)
        self.tp_size, self.bucket_bytes, self.timeout, self.pause_mode = tp_size, bucket_bytes, timeout, pause_mode
        self.dtype, self.device = dtype, device  # what the tensors are sent as (the serving dtype), and from where
        self.keys, self.vision_trained, self.log = keys or ServerKeys(), vision_trained, log
        self.tp_sizes: dict[str, int] = {}  # each server's TP size, as it said at the last push
        self.warned: set = set()
        self.journal = None if journal is None else Path(journal)
        self.resumed = False  # the server's pause was ended by someone else during the current push
        self.unflushed: dict[str, dict] = {}  # server URL -> how a push its pause did not cover was finished

    def targets(self) -> list[str]:
        with self.keys.client(self.timeout) as client:
            return expand_routers(client, self.urls, self.keys)

    def tp_of(self, url: str) -> int:
        return self.tp_sizes.get(url) or self.tp_size or 1

    def check(self, client, url: str) -> None:
        """Before any server is paused: what this server says about itself allows the push (see the class)."""
        facts = server_facts(client, url, self.keys)
        refuse_dp(facts, self.kind)
        self.tp_sizes[url] = tp_size_of(facts, self.tp_size, self.warned, self.log)
        if self.vision_trained:
            warn_vision_cache(facts, self.warned, self.log)

    def push(self, model, version: str, rank: int = 0) -> dict | None:
        """Every rank gathers the parameters one at a time (a collective under FSDP2), once per server (rank 0
        finds the servers and tells the other ranks how many); rank 0 streams them to that server. The gathers the
        send did not reach (a failure, the other ranks) still run, so no rank is left waiting in one."""
        targets, error = [], None
        if rank == 0:
            try:
                targets = self.targets()
            except Exception as exc:  # noqa: BLE001 (raised once the other ranks know there is nothing to gather)
                error = exc
        passes = _share_from_rank0(len(targets), rank)
        if error is not None:
            raise PolicyError(f"weight sync to {self.urls} failed: {error}", transient=True) from error
        made: list = []

        def fresh():
            made.append(stream_parameters(model, self.dtype, keep=rank == 0, device=self.device))
            return made[-1]

        try:
            return self.send_tensors(fresh, version, targets=targets) if rank == 0 else None
        finally:
            for it in made:  # a pass left half way by a failure
                for _ in it:
                    pass
            for _ in range(passes - len(made)):  # the passes rank 0 ran (the other ranks), or never reached
                for _ in stream_parameters(model, self.dtype, keep=False):
                    pass

    def serve(self, path, version: str | None = None) -> dict:
        """A saved model directory (a kept version, a rollback) goes on the servers from disk
        (``/update_weights_from_disk``, :class:`~paravt_train.sync.disk.SGLangWeightSync`, with this sync's pause
        mode and keys): there are no trained tensors to stream, and the servers must be able to read ``path``."""
        disk = SGLangWeightSync(self.urls, timeout=self.timeout, pause_mode=self.pause_mode, keys=self.keys,
                                vision_trained=self.vision_trained, log=self.log, journal=self.journal)
        disk.warned = self.warned  # one warning per server, whichever verb met it first
        return disk.serve(path, version)

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

    def prepare(self, client, url: str, k: int) -> None:
        """Before server ``k``'s pause (the distributed sync joins its group here)."""

    def failed(self, url: str) -> None:
        """After a failed update of ``url`` (the distributed sync leaves its group: the server may be out of
        step)."""

    def send(self, client, url: str, bucket: list, i: int, last: bool, version: str | None) -> None:
        raise NotImplementedError

    def _body(self, last: bool, version: str | None) -> dict:
        """The bucket's flags: the last one flushes the cache and names the version, unless generation runs (an
        ``in_place`` pause, or a pause ended by someone else: :attr:`resumed`), when both wait for an idle server
        (:func:`~paravt_train.sync.http.finish_unflushed`)."""
        flush = last and self.pause_mode != "in_place" and not self.resumed
        body = {"flush_cache": flush}
        if last and version is not None and not self.resumed:
            body["weight_version"] = str(version)
        return body

    def send_tensors(self, named_tensors, version: str | None = None, targets: list[str] | None = None) -> dict:
        """Send the tensors to every server, one server at a time, bucket by bucket in one weight-update session;
        ``version`` (named with the last bucket, when every weight is in) becomes its ``weight_version``.
        ``named_tensors``: ``(name, tensor)`` pairs, or a function that gives them afresh (a stream read once per
        server); a one-shot stream sent to several servers is kept in memory after the first."""
        import httpx

        if callable(named_tensors):
            stream = named_tensors
        else:
            kept = named_tensors if isinstance(named_tensors, (list, tuple)) else None
            source = iter(named_tensors)

            def stream():
                nonlocal kept
                if kept is None:
                    kept = list(source)
                return iter(kept)
        sent = n_buckets = 0
        url = None
        try:
            with self.keys.client(self.timeout) as client, journal_push(self.journal, self.urls, version, self.kind):
                targets = expand_routers(client, self.urls, self.keys) if targets is None else targets
                for u in targets:  # every server, before the first is paused
                    self.check(client, u)
                for k, url in enumerate(targets):
                    sent, n_buckets = self._update_one(client, url, k, stream(), version)
        except httpx.HTTPError as exc:
            self.failed(url)
            raise PolicyError(f"weight sync to {url} failed: {exc}", transient=True) from exc
        except Exception:
            if url is not None:
                self.failed(url)
            raise
        out = {"success": True, "tensors": sent, "buckets": n_buckets, "servers": len(targets)}
        if self.unflushed:  # applied while generation ran: flushed late, the version named after, per server
            out.update(unflushed=self.unflushed)
            self.unflushed = {}
        return out

    def _update_one(self, client, url: str, k: int, named_tensors, version: str | None) -> tuple[int, int]:
        sent = n_buckets = 0
        self.prepare(client, url, k)
        self.resumed = False
        with Paused(client, url, self.pause_mode), Session(client, url):
            # whether this server's /ready tells a pause (SGLang 0.5.23: 503 while paused; a server that answers
            # 200 under our own pause cannot tell us later that someone else ended it)
            tells = self.pause_mode != "in_place" and still_paused(client, url, self.keys)
            pending = None  # one bucket of look-ahead: the last one is known only at the end
            for bucket in self.buckets(named_tensors):
                if pending is not None:
                    self.send(client, url, pending, n_buckets, False, version)
                    sent, n_buckets = sent + len(pending), n_buckets + 1
                pending = bucket
            if pending is not None:
                self.resumed = tells and not still_paused(client, url, self.keys)
                if self.resumed:
                    self._say_mixed(client, url, n_buckets + 1, version)
                try:
                    self.send(client, url, pending, n_buckets, True, version)
                except PolicyError as exc:
                    if UNFLUSHED not in str(exc):
                        raise
                    self.resumed = True  # applied; its flush refused: requests ran (a pause ended meanwhile)
                sent, n_buckets = sent + len(pending), n_buckets + 1
        if self.resumed:  # the weights are in; flush once idle, then name the version (not before)
            self.unflushed[url] = finish_unflushed(client, url, version, self.log)
        elif self.pause_mode == "in_place":  # the old weights' prefixes: flushed once the server is idle
            flush_when_idle(client, url)
        return sent, n_buckets

    def _say_mixed(self, client, url: str, buckets: int, version: str | None) -> None:
        """Generation on ``url`` was continued by someone else (the pause supervisor's ``--max-pause``) before the
        push's last bucket: requests since ran on a mix of the served version and ``version``. Said with both."""
        old = served_version(client, url, self.keys)
        self.log(f"warning: generation on {url} was continued during the push of version {version} (before its last "
                 f"bucket, {buckets} of {buckets}): the requests it served since ran on a mix of version {old} and "
                 f"{version}; the cache is flushed once the server is idle, then the version becomes {version}")


def _share_from_rank0(n: int, rank: int) -> int:
    """Rank 0's ``n`` on every rank of the default process group (the number of passes over a sharded model)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return n
    box = [n if rank == 0 else 0]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


@register("tensor")
class SGLangTensorSync(StreamedSync):
    """Pushes tensors to co-located SGLang servers: ``POST /update_weights_from_tensor
    {"serialized_named_tensors": [one payload per TP rank], "flush_cache", "weight_version"}`` per bucket of about
    ``bucket_bytes``. Parameter names are the Hugging Face checkpoint names (what SGLang's ``load_weights``
    maps). ``source_device``: where the parameters are (the trainer's rank-0 GPU); a server that cannot open
    CUDA-IPC handles from it is refused before the first push
    (:func:`~paravt_train.sync.checks.refuse_unreachable_ipc`)."""

    kind = "tensor"

    def __init__(self, endpoint, source_device=None, **kw):
        super().__init__(endpoint, **kw)
        self.source_device = source_device

    @classmethod
    def from_settings(cls, settings, url: str, *, folder, export, device, vision: bool, keys, journal):
        return cls(url, tp_size=settings.tp_size, pause_mode=settings.pause_mode, bucket_bytes=settings.bucket_mb << 20,
                   dtype=serving_dtype(settings.dtype, device), keys=keys, vision_trained=vision, source_device=device,
                   journal=journal)

    def check(self, client, url: str) -> None:
        super().check(client, url)
        refuse_unreachable_ipc(url, self.device or self.source_device, self.warned, self.log)

    def send(self, client, url, bucket, i, last, version) -> None:
        # one copy per rank (the server's own TP size), each serialised on its own: a rank's rebuild releases the
        # references of its copy, and SGLang's tp_worker opens payloads[tp_rank]
        payloads = [serialize_named_tensors(bucket) for _ in range(self.tp_of(url))]
        resp = client.post(f"{url}/update_weights_from_tensor", json={
            "serialized_named_tensors": payloads, **self._body(last, version)})
        data = json_of(resp)
        if resp.status_code != 200 or not data.get("success", False):
            raise PolicyError(f"{url}/update_weights_from_tensor refused bucket {i + 1}: "
                              f"{data.get('message') or resp.text[:300]}")
