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
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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

__all__ = ["CheckpointError", "ServerExport", "as_saved", "atomic_directory", "complete_checkpoints", "export_model",
           "latest_checkpoint", "load_blobs", "load_checkpoint", "load_model_weights", "load_rank_blobs",
           "prune_checkpoints",
           "resume_latest", "save_checkpoint", "write_model_dir"]

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
        torch.save({"blobs": rank_blobs, **_rng_state()}, tmp / f"rank-{rank}.pt")
    if rank == 0:
        torch.save({"scheduler": scheduler.state_dict(), **_rng_state(), "blobs": blobs or {}}, tmp / "extra.pt")
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
    _set_rng_state(torch.load(mine, weights_only=False) if mine.is_file() else extra)
    return json.loads((Path(path) / STATE_FILE).read_text())["step"]


def _rng_state() -> dict:
    """The generators a resumed run must continue: the CPU's and, on a GPU, this process's CUDA devices'."""
    state = {"rng": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(saved: dict) -> None:
    torch.set_rng_state(saved["rng"])
    cuda = saved.get("cuda_rng")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)  # a checkpoint of another machine's devices keeps this one's


def load_blobs(path: Path) -> dict:
    """The ``blobs`` a checkpoint was saved with."""
    return torch.load(Path(path) / "extra.pt", weights_only=False).get("blobs", {})


def load_rank_blobs(path: Path, rank: int) -> dict | None:
    """The ``rank_blobs`` rank ``rank`` saved, or None when it saved none (an older checkpoint, or a rank beyond
    the world size it was saved with; a smaller world leaves the other ranks' state unread)."""
    f = Path(path) / f"rank-{rank}.pt"
    return torch.load(f, weights_only=False)["blobs"] if f.is_file() else None


def load_model_weights(model, path: str | Path, rank: int = 0, world: int = 1) -> None:
    """A saved model directory's weights into ``model`` (every rank calls it): one process loads the state dict;
    under FSDP2 rank 0 reads the directory and the shards are filled from it (a broadcast)."""
    from transformers import AutoModelForImageTextToText

    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        sd = AutoModelForImageTextToText.from_pretrained(str(path)).state_dict() if rank == 0 else {}
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        model.load_state_dict(AutoModelForImageTextToText.from_pretrained(str(path)).state_dict())


def as_saved(model, tensors: dict) -> dict:
    """``tensors`` (by their state-dict names) as the model's own ``save_pretrained`` writes them, which is what
    SGLang's loaders read: transformers' reverse weight conversion (a Qwen2-VL or Qwen2.5-VL checkpoint names the text
    model ``model.layers.*`` and the tower ``visual.*``, where transformers 5 holds ``model.language_model.*`` and
    ``model.visual.*``; SGLang 0.5.23's loaders of those families know only the checkpoint names). The tensors
    themselves for a model without conversions (Qwen3-VL)."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion  # what save_pretrained applies

    return revert_weight_conversion(model, dict(tensors)) if isinstance(model, PreTrainedModel) else dict(tensors)


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
        plain = model
        if sd is not None:
            plain = _skeleton(model)
            plain.load_state_dict(sd, assign=True)  # the gathered CPU tensors themselves, no copy
            plain.tie_weights()  # assign=True replaced tied parameters by separate tensors: tie them again
        write_model_dir(plain, processor, path, agent_config_yaml)
    barrier()
    return path


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """A directory written under a temporary name (``<name>.tmp``, what an interrupted write left removed first) and
    renamed to ``path`` when the block ends without an error: a crash mid-write leaves the previous ``path`` whole.
    The one atomic export of this package: model directories (:func:`write_model_dir`) and LoRA adapters
    (:func:`paravt_train.infra.lora.save_adapter`). One process writes it (rank 0)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def write_model_dir(model, processor, path: str | Path, agent_config_yaml: str | None = None) -> Path:
    """A plain model directory from a whole (unsharded) model: its weights, the processor and the agent config it
    was trained with, in an :func:`atomic_directory`. What :func:`export_model` and a LoRA run's merged model
    (:func:`paravt_train.infra.lora.export_merged`) write; rank 0 calls it."""
    with atomic_directory(path) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        if agent_config_yaml is not None:
            (tmp / AGENT_CONFIG_FILE).write_text(agent_config_yaml)
    return Path(path)


class ServerExport:
    """The model directory a rollout server loads (``sync.via: disk``), kept up to date across updates.

    Unlike :func:`export_model` (a model to keep), this writes what the server serves: every tensor in the serving
    ``dtype`` (bfloat16 on GPUs: half the bytes of the fp32 the trainer holds), tied weights once, as one
    safetensors file per part of the model (the vision tower, each decoder layer, the embeddings and head)
    listed in ``model.safetensors.index.json``; and after the first export only the parts whose parameters
    changed since the previous one (the optimizer updates parameters in place, which bumps their version
    counter) are written again — a frozen vision tower or frozen layers cost nothing per sync. Config,
    processor and agent config are written once. Every rank calls :meth:`write` (gathering a sharded model is a
    collective); files are written under a temporary name and renamed."""

    INDEX = "model.safetensors.index.json"

    def __init__(self, path: Path, processor, dtype, agent_config_yaml: str | None = None):
        self.path, self.processor, self.dtype, self.agent_yaml = Path(path), processor, dtype, agent_config_yaml
        self._versions: dict[str, list[tuple]] | None = None
        self.written: list[str] = []  # the parts the last write wrote (others were current)
        self.bytes = 0  # what the last write wrote

    @staticmethod
    def part_of(name: str) -> str:
        parts = name.split(".")
        if "layers" in parts:  # model.language_model.layers.3.mlp... -> model.language_model.layers.3
            i = parts.index("layers")
            return ".".join(parts[: i + 2])
        if "blocks" in parts:  # the vision tower's blocks
            i = parts.index("blocks")
            return ".".join(parts[: i + 2])
        return ".".join(parts[:2])

    def _local_versions(self, model) -> dict[str, list[tuple]]:
        """Each part's parameters on this rank: which tensors they are (weak references) and their version
        counters. Under FSDP2 the optimizer's in-place update bumps the parameter's own counter (the DTensor's),
        not its local shard's (the op reaches the shard inside DTensor's dispatch, below the layer that counts
        versions: the shard's counter stays 0 for good); a load may write through either, or put new tensors in.
        Both counters and both identities count."""
        out: dict[str, list[tuple]] = {}
        for name, p in model.named_parameters():
            local = p._local_tensor if hasattr(p, "_local_tensor") else p  # an FSDP2 shard
            out.setdefault(self.part_of(name), []).append(
                (weakref.ref(p), weakref.ref(local), int(p._version), int(local._version)))
        return out

    @staticmethod
    def _same(now: list[tuple], before: list[tuple] | None) -> bool:
        """The same tensors at the same versions (a tensor freed or replaced since is a change)."""
        return before is not None and len(now) == len(before) and all(
            p() is q() and lp() is lq() and v == w and lv == lw
            for (p, lp, v, lv), (q, lq, w, lw) in zip(now, before, strict=True))

    def write(self, model) -> Path:
        rank, world = rank_world()
        versions = self._local_versions(model)
        changed = sorted(p for p in versions
                         if self._versions is None or not self._same(versions[p], self._versions.get(p)))
        if world > 1:  # a part is rewritten when it changed on any rank
            import torch.distributed as dist

            shards: list = [None] * world
            dist.all_gather_object(shards, changed)
            changed = sorted({p for shard in shards for p in shard})
        sd = None
        if world > 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            self._write_rank0(model, sd if sd is not None else model.state_dict(), set(changed))
        self._versions = versions
        barrier()
        return self.path

    def _write_rank0(self, model, sd: dict, changed: set[str]) -> None:
        from safetensors.torch import save_file

        self.path.mkdir(parents=True, exist_ok=True)
        first = not (self.path / self.INDEX).is_file()
        tied = set((getattr(model, "all_tied_weights_keys", None) or {}).keys())
        groups: dict[str, dict] = {}
        for name, t in sd.items():
            if name in tied:  # lm_head tied to the embeddings: the server ties it again
                continue
            groups.setdefault(self.part_of(name), {})[name] = t
        weight_map, self.written, self.bytes = {}, [], 0
        for part, tensors in groups.items():
            file = f"{part}.safetensors"
            weight_map.update({name: file for name in as_saved(model, {k: v.to("meta") for k, v in tensors.items()})})
            if not first and part not in changed and (self.path / file).is_file():
                continue
            out = as_saved(model, {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().to(
                "cpu", self.dtype).contiguous() for k, v in tensors.items()})
            tmp = self.path / f".{file}.tmp"
            save_file(out, str(tmp), metadata={"format": "pt"})
            tmp.replace(self.path / file)
            self.written.append(part)
            self.bytes += sum(v.numel() * v.element_size() for v in out.values())
        index = {"metadata": {"total_size": sum(v.numel() * torch.tensor([], dtype=self.dtype).element_size()
                                                for v in sd.values())}, "weight_map": weight_map}
        tmp = self.path / f".{self.INDEX}.tmp"
        tmp.write_text(json.dumps(index, indent=1))
        tmp.replace(self.path / self.INDEX)
        if first:
            cfg = model.config.to_dict() if not hasattr(model, "module") else model.module.config.to_dict()
            dtype_name = str(self.dtype).replace("torch.", "")
            cfg["dtype"] = dtype_name
            if isinstance(cfg.get("text_config"), dict):
                cfg["text_config"]["dtype"] = dtype_name
            (self.path / "config.json").write_text(json.dumps(cfg, indent=2))
            gen = getattr(model, "generation_config", None)
            if gen is not None:
                gen.save_pretrained(self.path)
            self.processor.save_pretrained(self.path)
            if self.agent_yaml is not None:
                (self.path / AGENT_CONFIG_FILE).write_text(self.agent_yaml)


def _skeleton(model):
    """An empty (meta-device) model of ``model``'s class and config, with its generation config."""
    import copy

    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # fully_shard subclasses it
    with torch.device("meta"):
        plain = cls._from_config(copy.deepcopy(model.config))
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain
