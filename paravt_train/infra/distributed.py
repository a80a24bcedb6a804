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

from paravt_agent.errors import ConfigError, PolicyError

__all__ = [
    "shutdown_distributed",
    "end_process",
    "all_reduce_sum",
    "on_rank0",
    "raise_everywhere",
    "clip_grad_norm",
    "barrier",
    "data_order",
    "device",
    "init_distributed",
    "train_device",
    "rank_world",
    "shard_model",
    "with_dummy_image",
    "world_scale",
]


def rank_world() -> tuple[int, int]:
    """``(rank, world size)``; ``(0, 1)`` outside ``torchrun``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed(timeout_minutes: float = 60.0, cuda: bool | None = None) -> None:
    """Join the process group when started by ``torchrun`` (``WORLD_SIZE`` > 1); no-op otherwise.

    ``timeout_minutes`` bounds any collective: other ranks wait in one while rank 0 alone evaluates the
    held-out set or pushes weights (NCCL's own default, 10 minutes, would kill a long evaluation). ``cuda``: whether
    the model trains on GPUs (NCCL beside gloo) or on the CPU (gloo alone, a GPU or not: :func:`train_device`);
    None = whether CUDA is present."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        import datetime

        # NCCL takes CUDA tensors only: the small CPU collectives (counts, object gathers) go over gloo
        if cuda:
            local, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
            if local >= gpus:  # NCCL puts one rank on one GPU; two ranks cannot share one
                raise ConfigError(
                    f"local rank {local} has no GPU of its own: this machine shows {gpus} GPU(s). Start at most "
                    f"{gpus} processes per node (torchrun --nproc_per_node {gpus}), or train on the CPU over gloo "
                    "with CUDA_VISIBLE_DEVICES=\"\"")
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def shutdown_distributed() -> None:
    """Destroy the process group at the end of a run, while the interpreter is whole: left to interpreter
    finalization, Gloo's worker threads may still hold tensors, and freeing them then aborts the process
    (pytorch/pytorch#179291)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def end_process(code: int = 0) -> None:
    """End a torchrun worker now, after :func:`shutdown_distributed`, without interpreter finalization: with the
    group destroyed, a rank of a 4-rank GRPO run was still seen to abort at exit ("terminate called without an
    active exception", exit -6, after its last checkpoint and model were written) while native threads were torn
    down. Everything a run writes is closed before this (checkpoints, metrics, trackers); stdout and stderr are
    flushed here. One process (no torchrun) exits normally."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def device(cuda: bool | None = None) -> torch.device:
    """This rank's device: its GPU when training on GPUs (``cuda``; None = whether CUDA is present), else the CPU."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")


def train_device(requested: str, model_dir) -> bool:
    """Whether a trainer puts ``model_dir``'s model on GPUs: ``cuda`` (asked), ``cpu`` (asked) or ``auto``, the local
    backend's rule (:func:`paravt_agent.policy.placement.resolve_device`): a GPU when one is present and the model
    holds 64 MiB of weights or more. A 1.2 M-parameter toy trains faster on the CPU than one kernel launch at a time
    on a GPU (docs/gpu.md), so on a GPU machine it stays there unless asked."""
    from paravt_agent.policy.placement import resolve_device  # torch is loaded already: no cost

    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda: no GPU is visible to this process (torch.cuda.is_available() is False)")
    return resolve_device(requested, model_dir) == "cuda"


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


def with_dummy_image(batch: dict, chat) -> dict:
    """``batch`` (right-padded ``input_ids`` / ``attention_mask`` / ``loss_mask`` …, no images) with one
    1-token dummy image appended to the end of row 0: ``<|vision_start|><|image_pad|><|vision_end|>``,
    attended but never trained (loss mask 0), pixels zero.

    Under FSDP every rank must run the same collectives in the same order, and the vision tower's blocks
    are FSDP units that all-gather their parameters when they run. A micro-batch without images would
    skip the tower (its all-gathers, and the reduce-scatters of its gradients) while another rank's runs
    it: gloo aborts ("collective mismatch"), NCCL hangs. Running the tower *inside* the model's forward,
    at the place it runs for image batches, keeps the order identical on every rank; the real tokens come
    before the dummy ones, so causal attention keeps their logits exactly what they were, and the tower's
    parameters get (zero) gradients through the attention over the dummy positions."""
    import torch

    ids, att = batch["input_ids"], batch["attention_mask"]
    tok = chat.tokenizer
    extra = [tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", chat.processor.image_token, "<|vision_end|>")]
    n = int(att[0].sum())  # row 0's length (right padding)
    width = max(ids.shape[1], n + len(extra))
    out = {}
    for key, v in batch.items():
        if key in ("pixel_values", "image_grid_thw") or not torch.is_tensor(v) or v.dim() != 2:
            out[key] = v
            continue
        if v.shape[1] < width:
            fill = {"input_ids": chat.pad_id, "labels": -100}.get(key, 0)
            v = torch.cat([v, torch.full((v.shape[0], width - v.shape[1]), fill, dtype=v.dtype, device=v.device)], 1)
        else:
            v = v.clone()
        if key == "input_ids":
            v[0, n:n + len(extra)] = torch.tensor(extra, dtype=v.dtype, device=v.device)
        elif key == "attention_mask":
            v[0, n:n + len(extra)] = 1
        elif key == "labels":
            v[0, n:n + len(extra)] = -100
        out[key] = v  # loss_mask, behaviour logprobs: 0 at the dummy positions
    if chat.uses_mm_token_types:
        out["mm_token_type_ids"] = chat.mm_token_types(out["input_ids"].cpu()).to(ids.device)
    ip = chat.processor.image_processor
    merge, patch, tps = int(ip.merge_size), int(ip.patch_size), int(getattr(ip, "temporal_patch_size", 2))
    out["pixel_values"] = torch.zeros((merge * merge, 3 * tps * patch * patch), device=ids.device)
    out["image_grid_thw"] = torch.tensor([[1, merge, merge]], device=ids.device)
    chat.check_inputs(out, "the dummy image of an image-less rank")
    return out


def data_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order of ``n`` samples in ``epoch``: a function of (seed, epoch) only, so a resumed run (and
    every rank) sees the same order."""
    idx = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(idx)
    return idx


def raise_everywhere(error: Exception | None, what: str) -> None:
    """Raise ``error`` (one rank's) on every rank: the others must not go on into collectives that rank will
    never join. Every rank calls it."""

    if rank_world()[1] > 1 and all_reduce_max(int(error is not None)) and error is None:
        raise PolicyError(f"{what} failed on another rank; see its log", transient=True)
    if error is not None:
        raise error


def on_rank0(fn, what: str):
    """``fn()`` on rank 0 only, its result given to every rank (its error raised on every rank)."""
    world = rank_world()[1]
    if world == 1:
        return fn()

    box: list = [None]
    if rank_world()[0] == 0:
        try:
            box = [fn()]
        except Exception as exc:  # noqa: BLE001 (raised on every rank below)
            box = [exc]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        if rank_world()[0] == 0:
            raise box[0]
        raise PolicyError(f"{what} failed on rank 0: {box[0]}")
    return box[0]
