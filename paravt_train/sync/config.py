"""The weight sync's settings, defined in its own room: ``sync:`` of a GRPO run (:class:`SyncSettings`) — how weights
reach the rollout servers, how often, in what dtype and buckets, the process group of the distributed sync, and the
keys the servers were started with (by the names of the environment variables holding them, never the keys).

Earlier releases had these as flat GRPOConfig fields (``weight_sync``, ``sync_every``, ``sync_pause_mode``,
``sync_dtype``, ``sync_bucket_mb``, ``sync_master_address``, ``sync_master_port``, ``sync_backend``,
``sglang_tp_size``, ``lora_name``, ``sglang_api_key_env``, ``sync_admin_api_key_env``): they still load, with a
FutureWarning naming the key here (:data:`FLAT_KEYS`), until 0.6.0.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from paravt_agent.errors import ConfigError

__all__ = ["FLAT_KEYS", "SyncSettings"]

#: the flat GRPOConfig keys of 0.5.1 and the ``sync:`` key each became
FLAT_KEYS = {"weight_sync": "sync.via", "sync_every": "sync.every", "sync_pause_mode": "sync.pause_mode",
             "sync_dtype": "sync.dtype", "sync_bucket_mb": "sync.bucket_mb",
             "sync_master_address": "sync.master_address", "sync_master_port": "sync.master_port",
             "sync_backend": "sync.group_backend", "sglang_tp_size": "sync.tp_size", "lora_name": "sync.lora_name",
             "sglang_api_key_env": "sync.api_key_env", "sync_admin_api_key_env": "sync.admin_api_key_env"}


class SyncSettings(BaseModel):
    """How the trainer's weights reach its SGLang rollout servers (``paravt_train/sync/``)."""

    model_config = ConfigDict(extra="forbid")

    via: Literal["disk", "tensor", "distributed", "lora"] = Field(
        "disk", description="How updated weights reach the SGLang server: disk = /update_weights_from_disk (the "
                            "server reads a directory rank 0 writes); tensor = /update_weights_from_tensor (a server "
                            "on this machine that sees the trainer's rank-0 GPU: CUDA tensors pass as IPC handles, "
                            "refused before the first push otherwise; nothing is written); distributed = "
                            "/init_weights_update_group + /update_weights_from_distributed (a server on another "
                            "node: tensors broadcast over a process group, no shared disk); lora = the adapter "
                            "alone (`lora.enabled`): /load_lora_adapter under `lora_name`, the previous adapter of "
                            "that name unloaded.")
    every: int = Field(1, ge=1, description="Steps between weight syncs to the rollout server. Rollouts sampled "
                       "between syncs come from an older version than the one being updated (the server reports "
                       "which): their tokens are weighted by decoupled PPO's π_prox / π_behav (behaviour_weight_cap), "
                       "never trained as on-policy.")
    pause_mode: Literal["retract", "in_place", "abort"] = Field(
        "retract", description="/pause_generation mode around a weight swap: retract (running requests go back to "
                               "the queue keeping their tokens and continue on the new weights; the cache is "
                               "flushed) is safe while serving; in_place holds them where they are and skips the "
                               "flush SGLang refuses then (old-weight prefixes stay cached until a flush once idle); "
                               "abort ends them (the client retries). A LoRA swap (via: lora) never pauses: SGLang "
                               "drains the adapter's running requests on the old version.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="dtype the tensor and distributed syncs send (the serving dtype): auto = bfloat16 on "
                            "GPUs, float32 on CPU.")
    bucket_mb: int = Field(512, ge=1, description="Bucket size of the tensor and distributed syncs (MB): the sending "
                           "rank holds at most two buckets.")
    master_address: str = Field("127.0.0.1", description="via distributed: this trainer node's address, as the "
                                "servers reach it.")
    master_port: int = Field(31000, ge=1024, le=65535, description="via distributed: the rendezvous port on that "
                             "address (server k of a router's workers: + k; after n failed pushes: + 100·(n mod 7)). "
                             "Never inside SGLang's NCCL range (22000-29999), its HTTP port 30000, the OS's ephemeral "
                             "range (32768+) or a server's HTTP port: the sync moves past those.")
    group_backend: Literal["nccl", "gloo"] = Field("nccl", description="via distributed: the process group's "
                                                   "backend (gloo for CPU tests).")
    tp_size: int | None = Field(None, ge=1, description="Tensor-parallel size assumed for an SGLang server that does "
                                "not report its own: the tensor and distributed syncs read each server's tp_size "
                                "(and dp_size) from GET /server_info before the first push (a wrong count of tensor "
                                "payloads kills the server).")
    lora_name: str = Field("paravt", description="via lora: the adapter's name on the server (the served agents "
                           "name it per request: SGLang's `lora_path`).")
    api_key_env: str | None = Field(None, description="Environment variable holding the rollout servers' --api-key "
                                    "(SGLang then answers 401 without it): sent as Authorization: Bearer on "
                                    "generation and by the weight syncs. Never the key itself in a config file.")
    admin_api_key_env: str | None = Field(None, description="Environment variable holding the servers' "
                                          "--admin-api-key, which SGLang requires on its admin routes (pause, "
                                          "weight updates, flush, LoRA loads) when set; None = the API key.")

    @field_validator("master_port")
    @classmethod
    def _outside_sglangs_ports(cls, port: int) -> int:
        if 22000 <= port <= 30000:
            raise ValueError(f"master_port {port} is inside SGLang's own ports (its NCCL range 22000-29999, its HTTP "
                             "port 30000), which its servers take at random: use one in 1024-21999 or 30001-32767 "
                             "(default 31000)")
        return port

    def api_key(self) -> str | None:
        """The rollout servers' API key, from ``api_key_env``."""
        return _key_from_env(self.api_key_env, "sync.api_key_env")

    def admin_api_key(self) -> str | None:
        """The rollout servers' admin API key, from ``admin_api_key_env``."""
        return _key_from_env(self.admin_api_key_env, "sync.admin_api_key_env")


def _key_from_env(name: str | None, field: str) -> str | None:
    if not name:
        return None
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"{field} names the environment variable {name}, which is not set: export the key there")
    return value
