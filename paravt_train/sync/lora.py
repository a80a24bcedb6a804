"""``sync.via: lora``: a LoRA run pushes its adapter alone (megabytes, not the model).

SGLang serves LoRA adapters by name (``--enable-lora``; a request names its adapter in ``lora_path``):
``POST /load_lora_adapter {"lora_name", "lora_path"}`` loads a peft adapter directory and
``POST /unload_lora_adapter {"lora_name"}`` drops one. A name is loaded once, so a new version of the served
adapter goes in as: unload the name → load the new version under it. Two behaviours of SGLang 0.5.23 shape how:

* its unload stops new requests from taking the adapter and waits until every request in flight on it has
  finished (on the old version: a request is never served by two). Generation is therefore not paused,
  whatever the pause mode: a paused request never finishes, and the unload waited out the client's timeout;
* a request that names an unloaded adapter loads it again, from the path it was last loaded from (its
  "evicted adapter" reload), and the sync's own load then fails as "already loaded".

So the server always loads the served adapter from one path per name, a symbolic link beside the versions
(``.served-NAME``) that is switched to the new version *before* the unload: whichever load comes first, the
sync's or a request's, it reads the new version. A load answered "already loaded" from that path is the new
version; from another path (an older run's), the swap is done again.

SGLang's adapter loads name no weight version, so after the swap the sync records it with
``POST /update_weight_version {"new_version", "abort_all_requests": false}`` (0.5.23: the version every reply's
``meta_info.weight_version`` then reports; requests in flight are not aborted). Without it every rollout reported
``"default"`` (version 0): with ``max_staleness`` η > 0 every group after update η was dropped as too stale, and
at η = 0 every row was flagged stale. The version goes in *after* the swap: a request the old adapter served
never reports the new version (one the new adapter serves before the call reports the old one: counted staler
than it is, never fresher). A server without the route (an older SGLang, HTTP 404) is refused with a
ConfigError: its rollouts could not say which adapter sampled them. The version is the server's, not the
adapter's: a request that names no adapter (the base model) reports it too.
:meth:`SGLangLoraSync.load_beside` loads a candidate under a name of its own, beside the
served one, for a gate that evaluates it on the same server by naming it per request.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from paravt_agent.errors import ConfigError, PolicyError
from paravt_train.infra.lora import is_adapter_dir
from paravt_train.sync.base import WeightSync, register, renamed
from paravt_train.sync.http import PAUSE_MODES, ServerKeys, expand_routers, json_of, refused_key, urls_of
from paravt_train.sync.lease import journal_push

__all__ = ["SGLangLoraSync"]


def serve_from(adapter_dir: Path, name: str) -> Path:
    """Point the served link of ``name`` (``.served-NAME`` beside ``adapter_dir``) at ``adapter_dir``, atomically:
    the one path the server ever loads ``name`` from."""
    link = adapter_dir.parent / f".served-{name}"
    tmp = link.with_name(f"{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(adapter_dir, target_is_directory=True)
    os.replace(tmp, link)
    return link


@register("lora", serves_adapters=True)
class SGLangLoraSync(WeightSync):
    """The served adapter ``name`` (:attr:`adapter_name`, which every rollout request names): :meth:`push` exports
    the trained adapter into ``folder/adapter-VERSION`` and swaps it in; :meth:`serve` swaps in an adapter directory
    already saved (a kept version, a rollback)."""

    def __init__(self, endpoint: str | Iterable[str], folder: Path | None = None, name: str = "paravt",
                 timeout: float = 600.0, pause_mode: str = "retract", export=None, keys: ServerKeys | None = None,
                 journal: Path | None = None):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {pause_mode!r}; use one of {', '.join(PAUSE_MODES)}")
        self.urls, self.folder, self.name = urls_of(endpoint), None if folder is None else Path(folder), name
        self.timeout, self.pause_mode, self.export = timeout, pause_mode, export
        self.keys = keys or ServerKeys()  # the load routes are admin routes
        self.bytes = 0  # what the last push sent (the adapter's files)
        self.journal = None if journal is None else Path(journal)

    @classmethod
    def from_settings(cls, settings, url: str, *, folder, export, device, vision: bool, keys, journal):
        return cls(url, folder, name=settings.lora_name, pause_mode=settings.pause_mode, export=export, keys=keys,
                   journal=journal)

    @property
    def adapter_name(self) -> str:
        return self.name

    def push(self, model, version: str, rank: int = 0) -> dict | None:
        """Every rank exports the adapter (gathered from the shards); rank 0 swaps it in on every server."""
        if self.export is None or self.folder is None:
            raise TypeError("this LoRA sync was made without an export function and a folder: use "
                            "serve(adapter_dir)")
        path = self.export(model, self.folder / f"adapter-{version}")
        return self.serve(path, version) if rank == 0 else None

    def load(self, adapter_dir: str | Path) -> dict:
        """Deprecated: :meth:`serve`."""
        renamed("SGLangLoraSync.load", "serve")
        return self.serve(adapter_dir)

    def serve(self, adapter_dir: str | Path, version: str | None = None) -> dict:
        """The adapter in ``adapter_dir`` becomes the served name on every server; ``version`` (when given)
        becomes each server's ``weight_version`` once its swap is done (``/update_weight_version``), which its
        replies then report."""
        name = self.name
        adapter_dir = Path(adapter_dir).resolve()
        if not is_adapter_dir(adapter_dir):
            raise ConfigError(f"{adapter_dir} is not a LoRA adapter (no adapter_config.json): sync.via lora serves "
                              "the adapters a `lora.enabled` run saves; a model directory goes with sync.via disk")
        self.bytes = sum(f.stat().st_size for f in adapter_dir.iterdir() if f.is_file())
        served = serve_from(adapter_dir, name)
        results = []
        with self.keys.client(self.timeout) as client, journal_push(self.journal, self.urls, version, "lora"):
            for url in expand_routers(client, self.urls, self.keys):
                out = self._swap(client, url, name, served)
                if version is not None:
                    out = {**out, "weight_version": self._record_version(client, url, str(version))}
                results.append(out)
        return results[0] if len(results) == 1 else {"success": True, "servers": results}

    def _record_version(self, client, url: str, version: str) -> str:
        """``POST /update_weight_version`` on one server, after its swap: the version its replies report."""
        import httpx

        try:
            resp = client.post(f"{url}/update_weight_version",
                               json={"new_version": version, "abort_all_requests": False})
        except httpx.HTTPError as exc:
            raise PolicyError(f"recording weight version {version} on {url} failed: {exc}", transient=True) from exc
        refused_key(resp, url, "/update_weight_version")
        if resp.status_code == 404:
            raise ConfigError(f"{url} has no /update_weight_version (SGLang older than the pinned 0.5.23?): the "
                              f"adapter is swapped in, but the server cannot record its version {version}, so its "
                              "rollouts would all report version 0 (too stale for max_staleness > 0, flagged stale at "
                              "0). "
                              "Serve with the pinned SGLang (`paravt serve --lora-rank R`)")
        data = json_of(resp)
        if resp.status_code != 200 or data.get("success") is False:
            raise PolicyError(f"{url}/update_weight_version refused {version}: "
                              f"{data.get('message') or resp.text[:300]}")
        return version

    def _swap(self, client, url: str, name: str, served: Path, tries: int = 3) -> dict:
        """Unload ``name`` on one server (draining its requests; no pause) and load it from ``served``."""
        import httpx

        for _ in range(tries):
            try:
                refused_key(client.post(f"{url}/unload_lora_adapter", json={"lora_name": name}),  # absent: fine
                            url, "/unload_lora_adapter")
                resp = client.post(f"{url}/load_lora_adapter", json={"lora_name": name, "lora_path": str(served)})
            except httpx.HTTPError as exc:
                raise PolicyError(f"adapter sync to {url} failed: {exc}", transient=True) from exc
            data = json_of(resp)
            if resp.status_code == 200 and data.get("success") is not False:
                return data
            why = data.get("message") or data.get("error_message") or resp.text[:300]
            if "already loaded" not in why:
                raise PolicyError(f"{url}/load_lora_adapter refused {served}: {why}")
            if (data.get("loaded_adapters") or {}).get(name) == str(served):
                return {**data, "success": True}  # a request loaded it first, from the link: the new version
        raise PolicyError(f"{url} kept reloading another copy of adapter {name!r} while it was swapped ({why})")

    def load_beside(self, adapter_dir: str | Path, name: str) -> dict:
        """A candidate under its own name, beside the served adapter (no pause needed: nobody names it yet)."""
        with self.keys.client(self.timeout) as client:
            for url in expand_routers(client, self.urls, self.keys):
                refused_key(client.post(f"{url}/unload_lora_adapter", json={"lora_name": name}), url,
                            "/unload_lora_adapter")
                resp = client.post(f"{url}/load_lora_adapter", json={"lora_name": name,
                                                                      "lora_path": str(Path(adapter_dir).resolve())})
                if resp.status_code != 200 or json_of(resp).get("success") is False:
                    raise PolicyError(f"{url}/load_lora_adapter refused {adapter_dir}: {resp.text[:300]}")
        return {"success": True, "name": name}
