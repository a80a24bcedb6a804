"""Distributed helpers shared by the SFT and GRPO trainers (torchrun + FSDP2; gloo on CPU, NCCL on GPUs).

Under ``torchrun`` the model is sharded with FSDP2 (``fully_shard`` per decoder
layer and per vision block, then the root). Gradients are AVERAGED over ranks by
FSDP, so a loss normalised by a global count must be multiplied by the world size
on each rank to give the single-process gradient (:func:`world_scale`).
"""

from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_sum",
    "clip_grad_norm",
    "barrier",
    "data_order",
    "device",
    "init_distributed",
    "rank_world",
    "shard_model",
    "vision_keepalive",
    "world_scale",
]


def rank_world() -> tuple[int, int]:
    """``(rank, world size)``; ``(0, 1)`` outside ``torchrun``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed() -> None:
    """Join the process group when started by ``torchrun`` (``WORLD_SIZE`` > 1); no-op otherwise."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def device() -> torch.device:
    return torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def world_scale() -> int:
    """What a rank multiplies its share of a globally normalised loss by: FSDP averages gradients over
    ranks, so the single-process gradient needs the sum."""
    return rank_world()[1]


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over ranks (float64); the values themselves outside ``torchrun``."""
    if rank_world()[1] == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(value: int) -> int:
    if rank_world()[1] == 1:
        return value
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def clip_grad_norm(params, max_norm: float) -> float:
    """Clip gradients to a global L2 norm and return that norm (under FSDP2 the norm is a DTensor over the
    shards; its full value is what a single process would report)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def shard_model(model):
    """FSDP2: shard each decoder layer and vision block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = rank_world()[1]
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world,))
    for name, module in model.named_modules():
        if name.endswith("language_model.layers") or name.endswith("visual.blocks"):
            for layer in module:
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def vision_keepalive(model, dev):
    """0 × a dummy vision forward, for micro-batches without images: every rank's vision parameters then
    take part in the backward (FSDP collectives must match across ranks)."""
    visual = next((m for n, m in model.named_modules() if n.endswith("visual")), None)
    if visual is None:
        return 0.0
    cfg = visual.config if hasattr(visual, "config") else None
    patch = getattr(cfg, "patch_size", 16)
    tps = getattr(cfg, "temporal_patch_size", 2)
    merge = getattr(cfg, "spatial_merge_size", 2)
    pix = torch.zeros((merge * merge, 3 * tps * patch * patch), device=dev)
    grid = torch.tensor([[1, merge, merge]], device=dev)
    out = visual(pix, grid_thw=grid)
    first = out[0] if isinstance(out, tuple | list) else getattr(out, "last_hidden_state", out)
    if hasattr(out, "pooler_output") and out.pooler_output is not None:
        first = out.pooler_output
    return 0.0 * first.float().sum()


def data_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order of ``n`` samples in ``epoch``: a function of (seed, epoch) only, so a resumed run (and
    every rank) sees the same order."""
    idx = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(idx)
    return idx
