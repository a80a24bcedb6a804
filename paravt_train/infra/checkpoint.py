"""Training checkpoints shared by the SFT and GRPO trainers.

A checkpoint folder ``OUTPUT_DIR/checkpoint-<step>`` holds the model and
optimizer (``torch.distributed.checkpoint``, sharded under FSDP2), the
scheduler, the RNG state, the step, JSON ``extra``, pickled ``blobs`` (state
every rank shares: the online learner's cursor and queue) and one ``rank-<r>.pt``
per rank (what each rank keeps for itself: its replay buffer, its RNG). It is written under a temporary
name and renamed, so a crash mid-save leaves the previous checkpoint whole;
:func:`latest_checkpoint` only returns complete ones.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from paravt_agent.config import AGENT_CONFIG_FILE
from paravt_agent.errors import ConfigError
from paravt_train.infra.distributed import all_reduce_max, barrier, on_rank0, rank_world

__all__ = ["CheckpointError", "complete_checkpoints", "export_model", "latest_checkpoint", "load_blobs",
           "load_checkpoint", "load_rank_blobs", "prune_checkpoints", "resume_latest", "save_checkpoint"]

STATE_FILE = "trainer_state.json"
T = TypeVar("T")


class CheckpointError(ConfigError):
    """Checkpoints exist under the output directory but none of them can be loaded."""


def complete_checkpoints(out: str | Path) -> list[Path]:
    """The complete ``checkpoint-<step>`` folders under ``out``, oldest first."""
    ckpts = sorted((p for p in Path(out).glob("checkpoint-*") if p.name.split("-")[1].isdigit()),
                   key=lambda p: int(p.name.split("-")[1]))
    return [c for c in ckpts if (c / STATE_FILE).is_file()]


def latest_checkpoint(out: str | Path) -> Path | None:
    """The newest complete ``checkpoint-<step>`` folder under ``out``, or None."""
    done = complete_checkpoints(out)
    return done[-1] if done else None


def resume_latest(out: str | Path, load: Callable[[Path], T], log=print) -> tuple[Path, T] | None:
    """``load`` the newest checkpoint that loads on every rank: one that fails (a truncated or unreadable file,
    on any rank) is passed over with a warning for the one before it. None when there is no checkpoint; a
    :class:`CheckpointError` when there are some and none loads (never a silent restart from step 0). ``load``
    must restore everything it touches, so a later candidate overwrites what a failed one half-restored."""
    # rank 0's listing for every rank: ranks that saw different folders (a network filesystem's cache) would
    # otherwise enter different collectives
    candidates = on_rank0(lambda: complete_checkpoints(out)[::-1], "listing the checkpoints")
    failed: list[str] = []
    for path in candidates:
        error: Exception | None = None
        try:
            result = load(path)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 (reported; the previous one is tried)
            error = exc
        if not all_reduce_max(int(error is not None)):
            if failed:
                log(f"warning: resumed from {path.name}, not the newest checkpoint ({'; '.join(failed)})")
            return path, result
        why = f"{error.__class__.__name__}: {error}" if error is not None else "it failed on another rank"
        failed.append(f"{path.name} cannot be loaded: {why}")
        log(f"warning: {path} cannot be loaded ({why}); trying the checkpoint before it")
    if failed:
        raise CheckpointError(f"no checkpoint under {out} can be loaded:\n  " + "\n  ".join(failed) +
                              "\nmove them away to start from scratch")
    return None


def prune_checkpoints(out: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (rank 0 only); returns what was deleted."""
    if rank_world()[0] != 0 or keep <= 0:
        return []
    ckpts = sorted((p for p in Path(out).glob("checkpoint-*")
                    if p.name.split("-")[1].isdigit() and (p / STATE_FILE).is_file()),
                   key=lambda p: int(p.name.split("-")[1]))
    old = ckpts[:-keep]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def save_checkpoint(path: Path, model, optimizer, scheduler, step: int, extra: dict | None = None,
                    blobs: dict | None = None, rank_blobs: dict | None = None) -> None:
    """Model + optimizer (DCP, sharded under FSDP), scheduler, RNG, ``extra`` (JSON), ``blobs`` (pickled, rank
    0's: state every rank shares) and ``rank_blobs`` (pickled, one file per rank: state each rank keeps for
    itself, e.g. its replay buffer), written to a temporary folder and renamed: a crash mid-save leaves the
    previous checkpoint whole."""
    rank, _ = rank_world()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:  # what an interrupted save left (another world size's rank files among it) goes first
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    if rank_blobs is not None:
        torch.save({"blobs": rank_blobs, "rng": torch.get_rng_state()}, tmp / f"rank-{rank}.pt")
    if rank == 0:
        torch.save({"scheduler": scheduler.state_dict(), "rng": torch.get_rng_state(), "blobs": blobs or {}},
                   tmp / "extra.pt")
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **(extra or {})}))
    barrier()
    if rank == 0:
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)  # complete checkpoints only: a crash mid-save leaves the old one usable
    barrier()


def load_checkpoint(path: Path, model, optimizer, scheduler) -> int:
    """Restore model, optimizer, scheduler and RNG from ``path``; returns the step."""
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = torch.load(Path(path) / "extra.pt", weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    mine = Path(path) / f"rank-{rank_world()[0]}.pt"
    torch.set_rng_state(torch.load(mine, weights_only=False)["rng"] if mine.is_file() else extra["rng"])
    return json.loads((Path(path) / STATE_FILE).read_text())["step"]


def load_blobs(path: Path) -> dict:
    """The ``blobs`` a checkpoint was saved with."""
    return torch.load(Path(path) / "extra.pt", weights_only=False).get("blobs", {})


def load_rank_blobs(path: Path, rank: int) -> dict | None:
    """The ``rank_blobs`` rank ``rank`` saved, or None when it saved none (an older checkpoint, or a rank beyond
    the world size it was saved with; a smaller world leaves the other ranks' state unread)."""
    f = Path(path) / f"rank-{rank}.pt"
    return torch.load(f, weights_only=False)["blobs"] if f.is_file() else None


def export_model(model, processor, path: Path, agent_config_yaml: str | None = None) -> Path:
    """A plain model directory that ``from_pretrained``, SGLang and the agent load (every rank calls it).

    Under FSDP2 the parameters are gathered one at a time onto rank 0's CPU (full state dict, CPU-offloaded)
    and written through a skeleton built on the meta device: no second copy of the model is loaded from disk
    and no GPU holds the whole model. Written under a temporary name and renamed."""

    path = Path(path)
    rank, world = rank_world()
    sd = None
    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if sd is not None:
            plain = _skeleton(model)
            plain.load_state_dict(sd, assign=True)  # the gathered CPU tensors themselves, no copy
            plain.tie_weights()  # assign=True replaced tied parameters by separate tensors: tie them again
            plain.save_pretrained(tmp)
        else:
            model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        if agent_config_yaml is not None:
            (tmp / AGENT_CONFIG_FILE).write_text(agent_config_yaml)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    barrier()
    return path


def _skeleton(model):
    """An empty (meta-device) model of ``model``'s class and config, with its generation config."""
    import copy

    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # fully_shard subclasses it
    with torch.device("meta"):
        plain = cls._from_config(copy.deepcopy(model.config))
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain
