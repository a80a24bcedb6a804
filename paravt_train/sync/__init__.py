"""Weight sync: the trainer's weights onto the SGLang servers that roll out for it, behind one interface.

The loop, top to bottom (what ``GRPOTrainer.sync`` does after an update, every ``sync_every`` steps)::
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

- :mod:`~paravt_train.sync.base`: the interface (:class:`WeightSync`).
- :mod:`~paravt_train.sync.http`: SGLang's admin routes (keys, ``/server_info``, pause modes, sessions, routers,
  the idle flush).
- :mod:`~paravt_train.sync.checks`: what every server must allow before the first push (its own TP size, no DP,
  CUDA-IPC reach for ``tensor``, the vision-feature cache off when the vision tower trains).
- :mod:`~paravt_train.sync.disk`: ``weight_sync: disk`` (any server that can read the directory).
- :mod:`~paravt_train.sync.streamed`: ``weight_sync: tensor`` (servers that see the trainer's rank-0 GPU), and what
  the streamed syncs share.
- :mod:`~paravt_train.sync.distributed`: ``weight_sync: distributed`` (other nodes, over a process group).
- :mod:`~paravt_train.sync.lora`: ``weight_sync: lora`` (a LoRA run's adapter alone, swapped in by name).

:func:`make_weight_sync` picks the sync by the config's name; the trainer never branches on it.
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

__all__ = ["PAUSE_MODES", "SGLangDistributedSync", "SGLangLoraSync", "SGLangTensorSync", "SGLangWeightSync",
           "ServerFacts", "ServerKeys", "WeightSync", "expand_routers", "flush_when_idle", "make_weight_sync",
           "server_facts", "server_keys", "serving_dtype", "stream_parameters", "trains_vision_tower"]


def _disk(cfg, url: str, folder: Path, export, device, vision: bool) -> WeightSync:
    return SGLangWeightSync(url, folder, pause_mode=cfg.sync_pause_mode, export=export, keys=server_keys(cfg),
                            vision_trained=vision)


def _tensor(cfg, url: str, folder: Path, export, device, vision: bool) -> WeightSync:
    return SGLangTensorSync(url, tp_size=cfg.sglang_tp_size, pause_mode=cfg.sync_pause_mode,
                            bucket_bytes=cfg.sync_bucket_mb << 20, dtype=serving_dtype(cfg.sync_dtype, device),
                            keys=server_keys(cfg), vision_trained=vision, source_device=device)


def _distributed(cfg, url: str, folder: Path, export, device, vision: bool) -> WeightSync:
    return SGLangDistributedSync(url, master_address=cfg.sync_master_address, master_port=cfg.sync_master_port,
                                 backend=cfg.sync_backend, tp_size=cfg.sglang_tp_size,
                                 pause_mode=cfg.sync_pause_mode, bucket_bytes=cfg.sync_bucket_mb << 20,
                                 dtype=serving_dtype(cfg.sync_dtype, device),
                                 device="cpu" if cfg.sync_backend == "gloo" else None, keys=server_keys(cfg),
                                 vision_trained=vision)


def _lora(cfg, url: str, folder: Path, export, device, vision: bool) -> WeightSync:
    return SGLangLoraSync(url, folder, name=cfg.lora_name, pause_mode=cfg.sync_pause_mode, export=export,
                          keys=server_keys(cfg))


#: the syncs by their ``weight_sync`` name
SYNCS = {"disk": _disk, "tensor": _tensor, "distributed": _distributed, "lora": _lora}


def server_keys(cfg) -> ServerKeys:
    """The keys the rollout servers were started with, from the environment variables the config names
    (``sglang_api_key_env``, ``sync_admin_api_key_env``): never written in a config file."""
    return ServerKeys(api_key=cfg.sglang_api_key(), admin_api_key=cfg.sync_admin_api_key())


def trains_vision_tower(model) -> bool:
    """Whether any trained parameter belongs to the vision tower (Qwen-VL's ``visual``), whose features SGLang
    caches across weight updates."""
    return any(p.requires_grad and ".visual." in f".{name}" for name, p in model.named_parameters())


def make_weight_sync(cfg, policy, model, folder: Path, export=None, device=None) -> WeightSync | None:
    """The weight sync of a GRPO config for the rollout ``policy``: None when the policy generates with the
    trained ``model`` itself (nothing to push); the sync named by ``cfg.weight_sync`` when the policy's endpoint
    takes pushed weights (SGLang's admin API); otherwise a ConfigError saying what to use. ``folder``: where the
    disk sync writes; ``export(model, directory)``: how it writes a model directory; ``device``: where the model
    is (a tensor sync from a GPU the server cannot see is refused before the first push)."""
    if policy.generates_with(model):
        return None
    if not getattr(policy, "receives_weights", False):
        raise ConfigError(f"the {policy.name} backend generates outside this process and the trainer can push "
                          "weights only to an SGLang server (backend: sglang)")
    if cfg.weight_sync not in SYNCS:
        raise ConfigError(f"weight_sync {cfg.weight_sync!r}: use one of {', '.join(SYNCS)}")
    return SYNCS[cfg.weight_sync](cfg, cfg.endpoint or "http://127.0.0.1:30000", Path(folder), export, device,
                                  trains_vision_tower(model))
