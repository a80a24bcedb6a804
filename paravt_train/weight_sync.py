"""Weight sync from the trainer to SGLang rollout servers, with SGLang's documented HTTP API (0.5.21+).

* :class:`SGLangWeightSync` (``weight_sync: disk``): rank 0 writes a plain model
  directory; each server reloads it with ``/update_weights_from_disk``. Works
  whenever the server can read the directory (same machine or shared storage).
* :class:`SGLangTensorSync` (``weight_sync: tensor``): the tensors themselves go to
  ``/update_weights_from_tensor`` as SGLang's serialised named tensors (a
  ``ForkingPickler`` payload, base64, one copy per tensor-parallel rank), in
  buckets, inside a weight-update session (``/begin_weight_update`` …
  ``/end_weight_update``: SGLang 0.5.21+ refuses tensor updates outside one; a
  server without the routes, HTTP 404, is updated without). Pickled tensors travel
  as shared-memory / CUDA IPC handles, so this path needs the server on the same
  machine (co-located rollouts); CUDA tensors are tagged with their device's UUID
  (as SGLang's own helper does), so they open on the right GPU whatever order
  ``CUDA_VISIBLE_DEVICES`` gives each side; CPU tensors are shared by file name,
  which any process on the machine can open.
* :class:`SGLangDistributedSync` (``weight_sync: distributed``): a server on another
  node, no shared disk (how verl, AReaL and slime push weights): the trainer's rank 0
  and the server's ranks form a process group (``/init_weights_update_group``), and
  each bucket is announced with ``/update_weights_from_distributed`` and broadcast
  over it (NCCL on GPUs, gloo on CPU), inside a weight-update session.

The streamed syncs (:mod:`paravt_train.tensor_sync`) take the parameters one at a
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

from paravt_agent.errors import PolicyError

__all__ = ["PAUSE_MODES", "SGLangWeightSync", "expand_routers", "flush_when_idle", "make_weight_sync"]

PAUSE_MODES = ("retract", "in_place", "abort")


def _base_url(endpoint: str) -> str:
    url = endpoint.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _urls(endpoints: str | Iterable[str]) -> list[str]:
    items = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    return [_base_url(e) for e in items]


def _json(resp) -> dict:
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
            data = _json(resp) if resp.status_code == 200 else {}
            listed = data.get("workers")
            if isinstance(listed, list) and listed and all(isinstance(w, dict) and w.get("url") for w in listed):
                workers = [_base_url(w["url"]) for w in listed]
        except Exception:  # noqa: BLE001 (a plain server: no /workers)
            workers = None
        for w in workers or [url]:
            if w not in out:
                out.append(w)
    return out


class _Paused:
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
    """``POST /flush_cache`` until the server takes it (it refuses while requests run): after an ``in_place``
    update, the radix cache still holds prefixes computed with the old weights. Gives up after ``timeout``
    (a server that is never idle), saying so."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        if client.post(f"{url}/flush_cache").status_code == 200:
            return True
        if time.monotonic() > deadline:
            (log or print)(f"warning: {url} was never idle for {timeout:g}s after an in_place weight update; its "
                           "cache keeps prefixes computed with the old weights until the next flush")
            return False
        time.sleep(0.5)


class _Session:
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
        data = _json(resp)
        if resp.status_code != 200 or not data.get("success", False):
            raise PolicyError(f"{self.url}/begin_weight_update refused: {data.get('message') or resp.text[:300]}")
        self.open = True
        return self

    def __exit__(self, *exc):
        if self.open:
            resp = self.client.post(f"{self.url}/end_weight_update", json={})
            data = _json(resp)
            if exc[0] is None and (resp.status_code != 200 or not data.get("success", False)):
                raise PolicyError(f"{self.url}/end_weight_update refused: {data.get('message') or resp.text[:300]}")
        return False


class SGLangWeightSync:
    """Pushes weights to SGLang servers with their documented HTTP API:

    ``POST /pause_generation {"mode"}`` → ``POST /update_weights_from_disk {"model_path": DIR, "flush_cache"}``
    (answer ``{"success", "message", ...}``) → ``POST /continue_generation``, per server. The directory must
    be readable by every server (same machine or a shared filesystem).
    """

    def __init__(self, endpoint: str | Iterable[str], folder: Path, timeout: float = 600.0,
                 pause_mode: str = "retract"):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {pause_mode!r}; use one of {', '.join(PAUSE_MODES)}")
        self.urls = _urls(endpoint)
        self.folder = Path(folder)
        self.timeout = timeout
        self.pause_mode = pause_mode

    @property
    def url(self) -> str:
        return self.urls[0]

    def push(self, model_dir: Path, version: str | None = None) -> dict:
        """Load ``model_dir`` on every server; ``version`` becomes the servers' ``weight_version``."""
        import httpx

        results = []
        with httpx.Client(timeout=self.timeout) as client:
            for url in expand_routers(client, self.urls):
                try:
                    with _Paused(client, url, self.pause_mode):
                        body = {"model_path": str(Path(model_dir).resolve()),
                                "flush_cache": self.pause_mode != "in_place"}
                        if version is not None:
                            body["weight_version"] = str(version)
                        resp = client.post(f"{url}/update_weights_from_disk", json=body)
                    if self.pause_mode == "in_place" and resp.status_code == 200:
                        flush_when_idle(client, url)
                except httpx.HTTPError as exc:
                    raise PolicyError(f"weight sync to {url} failed: {exc}", transient=True) from exc
                data = _json(resp)
                if resp.status_code != 200 or not data.get("success", False):
                    raise PolicyError(f"{url}/update_weights_from_disk refused {model_dir}: "
                                      f"{data.get('message') or resp.text[:300]}")
                results.append(data)
        return results[0] if len(results) == 1 else {"success": True, "servers": results}


def make_weight_sync(cfg, folder: Path):
    """The weight sync of a GRPO config, by its ``weight_sync`` name (``folder``: where ``disk`` writes)."""
    from paravt_train.tensor_sync import SGLangDistributedSync, SGLangTensorSync

    url = cfg.endpoint or "http://127.0.0.1:30000"
    if cfg.weight_sync == "tensor":
        return SGLangTensorSync(url, tp_size=cfg.sglang_tp_size, pause_mode=cfg.sync_pause_mode,
                                bucket_bytes=cfg.sync_bucket_mb << 20)
    if cfg.weight_sync == "distributed":
        return SGLangDistributedSync(url, master_address=cfg.sync_master_address, master_port=cfg.sync_master_port,
                                     backend=cfg.sync_backend, tp_size=cfg.sglang_tp_size,
                                     pause_mode=cfg.sync_pause_mode, bucket_bytes=cfg.sync_bucket_mb << 20)
    return SGLangWeightSync(url, folder, pause_mode=cfg.sync_pause_mode)
