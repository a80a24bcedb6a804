"""Weight sync: every way weights reach the SGLang servers, behind one interface of two verbs.

* ``push(model, version)``: the trainer's weights after an update (every rank calls it);
* ``serve(path, version)``: a saved model directory, or a LoRA run's adapter, already on disk (one process calls
  it): the online learner's starting and promoted versions, an operator's ``promote`` / ``rollback``, the shadow
  gate's candidate. disk, tensor and distributed load it with ``/update_weights_from_disk``; lora swaps the adapter
  in under the served name;
* ``adapter_name``: what every rollout request names (SGLang's ``lora_path``): the served adapter for lora, None for
  the full-weight syncs.

Every caller gets its sync from :func:`make_weight_sync` (the name in ``weight_sync``, the servers' keys from the
config); whether the trainer pushes after its updates is the trainer's own argument (``push_updates``), never a
setting of the sync. Nothing outside this folder compares ``weight_sync`` with a name or checks a sync's class
(``tests/test_weight_paths.py``).

The push, top to bottom (what ``GRPOTrainer.sync`` does after an update, every ``sync_every`` steps)::
    every rank:  sync.push(model, version=str(step))          # a sharded model is gathered collectively
       disk         export the model directory (every rank takes part), rank 0: /update_weights_from_disk
       tensor       parameters one at a time in the serving dtype, rank 0: /update_weights_from_tensor buckets
       distributed  the same, broadcast over a process group the servers joined (/init_weights_update_group)
    before the first pause, every server is checked (sync/checks.py: GET /server_info for its TP size and DP,
    where its GPUs are for tensor, its vision-feature cache when the vision tower trains): refused, not killed
    around each update, on each server in turn (a router's workers found at each push; never all paused at once,
    so a router always has workers that answer its health checks):
       /pause_generation {mode} → [/begin_weight_update … /end_weight_update] → /continue_generation
    the last bucket names the weight_version; the servers report it in every reply (and per-token spans
    for a request that spanned the update), which is how the asynchronous loop bounds staleness.
    barrier; a failure on rank 0 is raised on every rank.

- :mod:`~paravt_train.sync.base`: the interface (:class:`WeightSync`: ``push``, ``serve``, ``adapter_name``).
- :mod:`~paravt_train.sync.http`: SGLang's admin routes (keys, ``/server_info``, pause modes, sessions, routers,
  the idle flush).
- :mod:`~paravt_train.sync.checks`: what every server must allow before the first push (its own TP size, no DP,
  CUDA-IPC reach for ``tensor``, the vision-feature cache off when the vision tower trains).
- :mod:`~paravt_train.sync.disk`: ``weight_sync: disk`` (any server that can read the directory).
- :mod:`~paravt_train.sync.streamed`: ``weight_sync: tensor`` (servers that see the trainer's rank-0 GPU), and what
  the streamed syncs share.
- :mod:`~paravt_train.sync.distributed`: ``weight_sync: distributed`` (other nodes, over a process group).
- :mod:`~paravt_train.sync.lora`: ``weight_sync: lora`` (a LoRA run's adapter alone, swapped in by name).

:func:`make_weight_sync` picks the sync by the config's name; the trainer, the online learner's versions, promotion,
rollback and shadow gate never branch on it.
"""

from __future__ import annotations

from pathlib import Path

from paravt_agent.errors import ConfigError
from paravt_train.sync.base import WeightSync
from paravt_train.sync.disk import SGLangWeightSync
from paravt_train.sync.distributed import SGLangDistributedSync
from paravt_train.sync.http import (
    PAUSE_MODES,
    ServerFacts,
    ServerKeys,
    expand_routers,
    flush_when_idle,
    server_facts,
)
from paravt_train.sync.lora import SGLangLoraSync
from paravt_train.sync.streamed import SGLangTensorSync, serving_dtype, stream_parameters

__all__ = ["ADAPTER_SYNCS", "PAUSE_MODES", "SGLangDistributedSync", "SGLangLoraSync", "SGLangTensorSync",
           "SGLangWeightSync", "ServerFacts", "ServerKeys", "WeightSync", "check_weight_sync", "expand_routers",
           "flush_when_idle", "make_weight_sync", "pushes_to", "server_facts", "server_keys", "serving_dtype",
           "stream_parameters", "trains_vision_tower"]


def _disk(cfg, url: str, folder: Path | None, export, device, vision: bool) -> WeightSync:
    return SGLangWeightSync(url, folder, pause_mode=cfg.sync_pause_mode, export=export, keys=server_keys(cfg),
                            vision_trained=vision)


def _tensor(cfg, url: str, folder: Path | None, export, device, vision: bool) -> WeightSync:
    return SGLangTensorSync(url, tp_size=cfg.sglang_tp_size, pause_mode=cfg.sync_pause_mode,
                            bucket_bytes=cfg.sync_bucket_mb << 20, dtype=serving_dtype(cfg.sync_dtype, device),
                            keys=server_keys(cfg), vision_trained=vision, source_device=device)


def _distributed(cfg, url: str, folder: Path | None, export, device, vision: bool) -> WeightSync:
    return SGLangDistributedSync(url, master_address=cfg.sync_master_address, master_port=cfg.sync_master_port,
                                 backend=cfg.sync_backend, tp_size=cfg.sglang_tp_size,
                                 pause_mode=cfg.sync_pause_mode, bucket_bytes=cfg.sync_bucket_mb << 20,
                                 dtype=serving_dtype(cfg.sync_dtype, device),
                                 device="cpu" if cfg.sync_backend == "gloo" else None, keys=server_keys(cfg),
                                 vision_trained=vision)


def _lora(cfg, url: str, folder: Path | None, export, device, vision: bool) -> WeightSync:
    return SGLangLoraSync(url, folder, name=cfg.lora_name, pause_mode=cfg.sync_pause_mode, export=export,
                          keys=server_keys(cfg))


#: the syncs by their ``weight_sync`` name
SYNCS = {"disk": _disk, "tensor": _tensor, "distributed": _distributed, "lora": _lora}
#: the syncs that serve a LoRA run's adapter (by name) rather than the model's own weights
ADAPTER_SYNCS = ("lora",)


def check_weight_sync(cfg) -> None:
    """What the sync ``cfg.weight_sync`` names needs of the rest of the run's config (the config validates with it):
    an adapter sync needs a LoRA run, and a LoRA run that pushes to a server (backend sglang) needs an adapter sync
    (a full-weight sync would be sent the peft model's adapter parameters). A ValueError says what to set."""
    if cfg.weight_sync in ADAPTER_SYNCS and not cfg.lora.enabled:
        raise ValueError(f"weight_sync {cfg.weight_sync} pushes an adapter: set lora.enabled true")
    if cfg.lora.enabled and cfg.backend == "sglang" and cfg.weight_sync not in ADAPTER_SYNCS:
        raise ValueError(f"a LoRA run pushes adapters to its server: set weight_sync {' or '.join(ADAPTER_SYNCS)} "
                         f"(weight_sync {cfg.weight_sync} moves full weights)")


def server_keys(cfg) -> ServerKeys:
    """The keys the rollout servers were started with, from the environment variables the config names
    (``sglang_api_key_env``, ``sync_admin_api_key_env``): never written in a config file."""
    return ServerKeys(api_key=cfg.sglang_api_key(), admin_api_key=cfg.sync_admin_api_key())


def trains_vision_tower(model) -> bool:
    """Whether any trained parameter belongs to the vision tower (Qwen-VL's ``visual``), whose features SGLang
    caches across weight updates."""
    return any(p.requires_grad and ".visual." in f".{name}" for name, p in model.named_parameters())


def make_weight_sync(cfg, endpoint: str | None = None, *, folder: Path | None = None, export=None, device=None,
                     model=None) -> WeightSync:
    """The weight sync ``cfg.weight_sync`` names, for the servers at ``endpoint`` (default: the config's), with the
    keys the config names (:func:`server_keys`). ``folder``: where :meth:`~WeightSync.push` exports (the disk and
    LoRA syncs); ``export(model, directory)``: how it writes a model directory or an adapter; ``device``: where the
    model is (a tensor sync from a GPU the server cannot see is refused before the first push); ``model``: the
    trained model (a run that trains the vision tower checks the servers' vision-feature cache). A sync made from a
    config alone serves saved directories (:meth:`~WeightSync.serve`)."""
    if cfg.weight_sync not in SYNCS:
        raise ConfigError(f"weight_sync {cfg.weight_sync!r}: use one of {', '.join(SYNCS)}")
    url = endpoint or cfg.endpoint or "http://127.0.0.1:30000"
    return SYNCS[cfg.weight_sync](cfg, url, None if folder is None else Path(folder), export, device,
                                  model is not None and trains_vision_tower(model))


def pushes_to(policy, model) -> bool:
    """Whether weights must be pushed for the rollout ``policy``: False when it generates with the trained ``model``
    itself (nothing to push), True when its endpoint takes pushed weights (SGLang's admin API); otherwise a
    ConfigError saying what to use."""
    if policy.generates_with(model):
        return False
    if not getattr(policy, "receives_weights", False):
        raise ConfigError(f"the {policy.name} backend generates outside this process and the trainer can push "
                          "weights only to an SGLang server (backend: sglang)")
    return True
