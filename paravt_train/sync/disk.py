"""Weight sync from the trainer to SGLang rollout servers, with SGLang's documented HTTP API (0.5.21+).

* :class:`SGLangWeightSync` (``sync.via: disk``, this module): rank 0 writes a plain model
  directory; each server reloads it with ``/update_weights_from_disk``. Works
  whenever the server can read the directory (same machine or shared storage).
* :class:`SGLangTensorSync` (``sync.via: tensor``): the tensors themselves go to
  ``/update_weights_from_tensor`` as SGLang's serialised named tensors (a
  ``ForkingPickler`` payload, base64, one copy per tensor-parallel rank), in
  buckets, inside a weight-update session (``/begin_weight_update`` …
  ``/end_weight_update``: SGLang 0.5.21+ refuses tensor updates outside one; a
  server without the routes, HTTP 404, is updated without). CUDA tensors travel as
  IPC handles tagged with their device's UUID (as SGLang's own helper does), so this
  path needs a server on the same machine that sees the trainer's rank-0 GPU (any
  order ``CUDA_VISIBLE_DEVICES`` gives each side); another server is refused before
  the first push (:mod:`~paravt_train.sync.checks`). CPU tensors go by value.
* :class:`SGLangDistributedSync` (``sync.via: distributed``): a server on another
  node, no shared disk (how verl, AReaL and slime push weights): the trainer's rank 0
  and the server's ranks form a process group (``/init_weights_update_group``), and
  each bucket is announced with ``/update_weights_from_distributed`` and broadcast
  over it (NCCL on GPUs, gloo on CPU), inside a weight-update session.

The streamed syncs (:mod:`paravt_train.sync.streamed`) take the parameters one at a
time, gathered onto the sending rank in the serving dtype, and send them bucket
by bucket: no rank ever holds the whole model for a sync.

Every update names its ``weight_version`` (the trainer's step, as a string): the
server reports it in each reply's ``meta_info.weight_version`` and, for a request
that spanned the update, in ``weight_versions`` spans over its output tokens.

Every sync pauses generation around the swap (``/pause_generation`` → update →
``/continue_generation``, which runs even when the update fails). The pause
mode matters on a server that is answering users while it learns
(``paravt-train online``): ``retract`` (the default) sends running requests back
to the queue keeping the tokens generated so far and flushes the cache with the
update, so they continue on the new weights (their earlier tokens were sampled
by the old ones: ``weight_versions`` says which); ``in_place`` keeps them where
they are, cache included, and must not flush with the update (SGLang 0.5.22+
answers a flush while requests run with HTTP 400; 0.5.21 asserts in its
scheduler): the cache is flushed after ``/continue_generation``, as soon as the
server is idle (:func:`flush_when_idle`; until then it serves prefixes computed
with the old weights); ``abort`` ends them (the ``sglang`` policy retries aborted
replies). Several servers are updated one after the other; an endpoint that is
an SGLang router (``paravt serve --dp N``) stands for the workers its
``GET /workers`` lists, since the router forwards generation, not weight updates.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from paravt_agent.errors import ConfigError, PolicyError
from paravt_train.infra.lora import is_adapter_dir
from paravt_train.sync.base import WeightSync, register, renamed
from paravt_train.sync.checks import warn_vision_cache
from paravt_train.sync.http import (
    PAUSE_MODES,
    Paused,
    ServerKeys,
    applied_unflushed,
    expand_routers,
    finish_unflushed,
    flush_when_idle,
    json_of,
    server_facts,
    urls_of,
)
from paravt_train.sync.lease import journal_push

__all__ = ["SGLangWeightSync"]


@register("disk")
class SGLangWeightSync(WeightSync):
    """Pushes weights to SGLang servers with their documented HTTP API:

    ``POST /pause_generation {"mode"}`` → ``POST /update_weights_from_disk {"model_path": DIR, "flush_cache"}``
    (answer ``{"success", "message", ...}``) → ``POST /continue_generation``, per server: :meth:`push` exports the
    model into ``folder`` first, :meth:`serve` loads a directory already saved (the streamed syncs' :meth:`serve`
    too). The directory must be readable by every server (same machine or a shared filesystem). ``keys``: the keys
    the servers were started with; ``vision_trained``: the run trains the vision tower (a server that does not
    report its vision-feature cache off is warned about, :func:`~paravt_train.sync.checks.warn_vision_cache`).
    """

    def __init__(self, endpoint: str | Iterable[str], folder: Path | None = None, timeout: float = 600.0,
                 pause_mode: str = "retract", export=None, keys: ServerKeys | None = None,
                 vision_trained: bool = False, log=print, journal: Path | None = None):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {pause_mode!r}; use one of {', '.join(PAUSE_MODES)}")
        self.urls = urls_of(endpoint)
        self.folder = None if folder is None else Path(folder)  # where push exports (serve needs none)
        self.timeout = timeout
        self.pause_mode = pause_mode
        self.export = export  # model, directory -> the model directory the servers load (the trainer's export)
        self.keys, self.vision_trained, self.log = keys or ServerKeys(), vision_trained, log
        self.journal = None if journal is None else Path(journal)
        self.warned: set = set()

    @classmethod
    def from_settings(cls, settings, url: str, *, folder, export, device, vision: bool, keys, journal):
        return cls(url, folder, pause_mode=settings.pause_mode, export=export, keys=keys, vision_trained=vision,
                   journal=journal)

    def push(self, model, version: str, rank: int = 0) -> dict | None:
        """Every rank exports ``model`` (gathered from its shards) into ``folder/current``; rank 0 has the
        servers load it."""
        if self.export is None or self.folder is None:
            raise TypeError("this disk sync was made without an export function and a folder: use serve(model_dir)")
        path = self.export(model, self.folder / "current")
        return self.serve(path, version) if rank == 0 else None

    def load(self, model_dir: str | Path, version: str | None = None) -> dict:
        """Deprecated: :meth:`serve`."""
        renamed("SGLangWeightSync.load", "serve")
        return self.serve(model_dir, version)

    def serve(self, model_dir: str | Path, version: str | None = None) -> dict:
        """Load ``model_dir`` on every server; ``version`` becomes the servers' ``weight_version``."""
        import httpx

        if is_adapter_dir(model_dir):
            raise ConfigError(f"{model_dir} is a LoRA adapter, which a server loads by name: serve it with "
                              "sync.via lora (a server started with `paravt serve --lora-rank`)")
        results = []
        with self.keys.client(self.timeout) as client, journal_push(self.journal, self.urls, version, "disk"):
            targets = expand_routers(client, self.urls, self.keys)
            if self.vision_trained:
                for url in targets:
                    warn_vision_cache(server_facts(client, url, self.keys), self.warned, self.log)
            for url in targets:
                try:
                    with Paused(client, url, self.pause_mode):
                        body = {"model_path": str(Path(model_dir).resolve()),
                                "flush_cache": self.pause_mode != "in_place"}
                        if version is not None:
                            body["weight_version"] = str(version)
                        resp = client.post(f"{url}/update_weights_from_disk", json=body)
                        if applied_unflushed(resp):  # a pause someone else ended during the load (--max-pause)
                            self.log(f"warning: generation on {url} was continued during the load of version "
                                     f"{version}: requests ran with the new weights beside the old cache until it "
                                     "is flushed, once the server is idle; the version is named after the flush")
                            # SGLang names no version when it refuses the flush: named here, after it
                            results.append(finish_unflushed(client, url, version, self.log))
                            continue
                    if self.pause_mode == "in_place" and resp.status_code == 200:
                        flush_when_idle(client, url)
                except httpx.HTTPError as exc:
                    raise PolicyError(f"weight sync to {url} failed: {exc}", transient=True) from exc
                data = json_of(resp)
                if resp.status_code != 200 or not data.get("success", False):
                    raise PolicyError(f"{url}/update_weights_from_disk refused {model_dir}: "
                                      f"{data.get('message') or resp.text[:300]}")
                results.append(data)
        return results[0] if len(results) == 1 else {"success": True, "servers": results}
