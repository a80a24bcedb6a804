"""Weight sync: every way weights reach the SGLang servers, behind one interface of two verbs.

* ``push(model, version)``: the trainer's weights after an update (every rank calls it);
* ``serve(path, version)``: a saved model directory, or a LoRA run's adapter, already on disk (one process calls
  it): the online learner's starting and promoted versions, an operator's ``promote`` / ``rollback``, the shadow
  gate's candidate. disk, tensor and distributed load it with ``/update_weights_from_disk``; lora swaps the adapter
  in under the served name;
* ``adapter_name``: what every rollout request names (SGLang's ``lora_path``): the served adapter for lora, None for
  the full-weight syncs.

Every caller gets its sync from :func:`make_weight_sync`: the run's ``sync:`` settings (:mod:`~paravt_train.sync.
config`, this folder's own), the class each name is registered at (:func:`~paravt_train.sync.base.register`, verl's
checkpoint-engine registry), the servers' keys, and the push journal the caller keeps (``journal``); whether the
trainer pushes after its updates is the trainer's own argument (``push_updates``), never a setting of the sync.
Nothing outside this folder compares ``sync.via`` with a name or checks a sync's class (``tests/test_weight_paths.py``),
and every admin call a server gets (pause, update, continue, the repair of a push that never ended) is made here
(:mod:`~paravt_train.sync.http`).

The push, top to bottom (what ``GRPOTrainer.sync`` does after an update, every ``sync.every`` steps)::
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
- :mod:`~paravt_train.sync.config`: ``sync:`` (:class:`~paravt_train.sync.config.SyncSettings`).
- :mod:`~paravt_train.sync.lease`: the push journal and its lease.
- :mod:`~paravt_train.sync.disk`: ``sync.via: disk`` (any server that can read the directory).
- :mod:`~paravt_train.sync.streamed`: ``sync.via: tensor`` (servers that see the trainer's rank-0 GPU), and what
  the streamed syncs share.
- :mod:`~paravt_train.sync.distributed`: ``sync.via: distributed`` (other nodes, over a process group).
- :mod:`~paravt_train.sync.lora`: ``sync.via: lora`` (a LoRA run's adapter alone, swapped in by name).

:func:`make_weight_sync` picks the sync by the config's name; the trainer, the online learner's versions, promotion,
rollback and shadow gate never branch on it.
"""

from __future__ import annotations

from pathlib import Path

from paravt_agent.errors import ConfigError
from paravt_train.sync.base import SYNCS, WeightSync, register
from paravt_train.sync.config import SyncSettings
from paravt_train.sync.disk import SGLangWeightSync
from paravt_train.sync.distributed import SGLangDistributedSync
from paravt_train.sync.http import (
    PAUSE_MODES,
    ServerFacts,
    ServerKeys,
    expand_routers,
    flush_when_idle,
    release_servers,
    server_facts,
)
from paravt_train.sync.lora import SGLangLoraSync
from paravt_train.sync.streamed import SGLangTensorSync, serving_dtype, stream_parameters

__all__ = ["PAUSE_MODES", "SGLangDistributedSync", "SGLangLoraSync", "SGLangTensorSync", "SGLangWeightSync", "SYNCS",
           "ServerFacts", "ServerKeys", "SyncSettings", "WeightSync", "check_weight_sync", "expand_routers",
           "flush_when_idle", "make_weight_sync", "pushes_to", "register", "release_servers", "server_facts",
           "server_keys", "serving_dtype", "stream_parameters", "trains_vision_tower"]


def check_weight_sync(cfg) -> None:
    """What the sync ``cfg.sync.via`` names needs of the rest of the run's config (the config validates with it):
    an adapter sync needs a LoRA run, and a LoRA run that pushes to a server (backend sglang) needs an adapter sync
    (a full-weight sync would be sent the peft model's adapter parameters). A ValueError says what to set."""
    via = cfg.sync.via
    if via not in SYNCS:
        raise ValueError(f"sync.via {via!r}: use one of {', '.join(SYNCS)}")
    adapters = [name for name, cls in SYNCS.items() if cls.serves_adapters]
    if SYNCS[via].serves_adapters and not cfg.lora.enabled:
        raise ValueError(f"sync.via {via} pushes an adapter: set lora.enabled true")
    if cfg.lora.enabled and cfg.backend == "sglang" and not SYNCS[via].serves_adapters:
        raise ValueError(f"a LoRA run pushes adapters to its server: set sync.via {' or '.join(adapters)} "
                         f"(sync.via {via} moves full weights)")


def server_keys(cfg) -> ServerKeys:
    """The keys the rollout servers were started with, from the environment variables a run's ``sync:`` names
    (``api_key_env``, ``admin_api_key_env``; ``cfg`` a GRPO config or its :class:`SyncSettings`): never written in a
    config file."""
    settings = cfg if isinstance(cfg, SyncSettings) else cfg.sync
    return ServerKeys(api_key=settings.api_key(), admin_api_key=settings.admin_api_key())


def trains_vision_tower(model) -> bool:
    """Whether any trained parameter belongs to the vision tower (Qwen-VL's ``visual``), whose features SGLang
    caches across weight updates."""
    return any(p.requires_grad and ".visual." in f".{name}" for name, p in model.named_parameters())


def make_weight_sync(cfg, endpoint: str | None = None, *, folder: Path | None = None, export=None, device=None,
                     model=None, journal: Path | None = None) -> WeightSync:
    """The weight sync ``cfg.sync.via`` names (the class registered under it), for the servers at ``endpoint``
    (default: the config's), with the keys the config names (:func:`server_keys`). ``folder``: where
    :meth:`~WeightSync.push` exports (the disk and LoRA syncs); ``export(model, directory)``: how it writes a model
    directory or an adapter; ``device``: where the model is (a tensor sync from a GPU the server cannot see is refused
    before the first push); ``model``: the trained model (a run that trains the vision tower checks the servers'
    vision-feature cache); ``journal``: where each push journals itself with a lease (None: no journal). A sync made
    from a config alone serves saved directories (:meth:`~WeightSync.serve`)."""
    if cfg.sync.via not in SYNCS:
        raise ConfigError(f"sync.via {cfg.sync.via!r}: use one of {', '.join(SYNCS)}")
    url = endpoint or cfg.endpoint or "http://127.0.0.1:30000"
    return SYNCS[cfg.sync.via].from_settings(
        cfg.sync, url, folder=None if folder is None else Path(folder), export=export, device=device,
        vision=model is not None and trains_vision_tower(model), keys=server_keys(cfg),
        journal=None if journal is None else Path(journal))


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
