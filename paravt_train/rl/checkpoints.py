"""The GRPO trainer's checkpoints: save and resume (model, optimizer, scheduler, RNG, every rank's replay buffer
and unused rollouts), with the replayed frames stored once by content key.

:class:`TrainerCheckpoints` is an object the trainer holds (``GRPOTrainer.checkpoints``), given what it needs when
it is made (the output folder, the rank, how many checkpoints to keep) and what it saves or restores when it is
called; it reads nothing else of the trainer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from paravt_train.infra.checkpoint import (
    load_blobs,
    load_checkpoint,
    load_rank_blobs,
    prune_checkpoints,
    resume_latest,
    save_checkpoint,
)
from paravt_train.rl.replay import ReplayBuffer, store_frames

__all__ = ["Restored", "TrainerCheckpoints"]


@dataclass
class Restored:
    """What a resumed run continues from: the checkpoint, its step, the state every rank shares (``extra_state``:
    the online learner's cursor and queue, the held-out scores before training) and this rank's unused rollouts
    (``queue``: None unless they were stored and are kept)."""

    path: Path
    step: int
    extra_state: dict
    queue: dict | None


class TrainerCheckpoints:
    """``OUTPUT_DIR/checkpoint-<step>`` folders of one rank of a GRPO run: ``keep`` newest kept; the unused rollouts
    of the asynchronous loop restored only when ``keep_queue`` (``stale_queue_on_resume: keep``)."""

    def __init__(self, out: Path, rank: int = 0, world: int = 1, keep: int = 2, keep_queue: bool = False,
                 log=print):
        self.out, self.rank, self.world, self.keep, self.keep_queue, self.log = \
            Path(out), rank, world, keep, keep_queue, log

    @property
    def frame_store(self) -> Path:
        """Replayed rollouts' frames, stored once by content key and shared by every checkpoint."""
        return self.out / "replay_frames"

    def resume(self, model, optimizer, scheduler, replay: ReplayBuffer) -> Restored | None:
        """Restore the newest checkpoint that loads on every rank into ``model``, ``optimizer``, ``scheduler`` and
        ``replay`` (:func:`~paravt_train.infra.checkpoint.resume_latest`); None when there is none."""
        import numpy as np

        def load(path: Path) -> Restored:
            step = load_checkpoint(path, model, optimizer, scheduler)
            blobs = load_blobs(path)
            mine = load_rank_blobs(path, self.rank)
            if mine is None and self.rank == 0:  # a checkpoint from before per-rank state: rank 0's was shared
                mine = {"replay": blobs["replay"]} if "replay" in blobs else None
            if mine and "replay" in mine:
                replay.load_state_dict(mine["replay"], lambda key: np.load(self.frame_store / f"{key}.npy"))
            queue = mine.get("queue") if mine and self.keep_queue else None
            return Restored(path, step, blobs.get("extra_state", {}), queue)

        resumed = resume_latest(self.out, load, self.log)
        return None if resumed is None else resumed[1]

    def save(self, step: int, model, optimizer, scheduler, replay: ReplayBuffer, extra_state: dict,
             queue: dict | None = None) -> Path:
        """A checkpoint of ``step`` (model, optimizer, scheduler, RNG, ``extra_state``, and every rank's own replay
        buffer, its frames stored once by content, and its unused rollouts ``queue`` when given); the ``keep``
        newest are kept. Every rank calls it."""
        path = self.out / f"checkpoint-{step}"
        state, frames = replay.state_dict()
        store_frames(frames, self.frame_store, self.rank)
        keys = sorted(frames)
        if self.world > 1:
            import torch.distributed as dist

            shards: list = [None] * self.world
            dist.all_gather_object(shards, keys)
            keys = sorted({k for shard in shards for k in shard})
        mine = {"replay": state}
        if queue is not None:
            mine["queue"] = queue  # rolled out, not yet trained
        save_checkpoint(path, model, optimizer, scheduler, step,
                        blobs={"extra_state": extra_state}, rank_blobs=mine, extra={"replay_frames": keys})
        if self.rank == 0:
            prune_checkpoints(self.out, self.keep)
            self._collect_frames()
        return path

    def _collect_frames(self) -> None:
        """Delete stored frames no kept checkpoint refers to."""
        if not self.frame_store.is_dir():
            return
        used: set[str] = set()
        for state in self.out.glob("checkpoint-*/trainer_state.json"):
            used.update(json.loads(state.read_text()).get("replay_frames", []))
        for f in self.frame_store.glob("*.npy"):
            if f.stem not in used:
                f.unlink(missing_ok=True)
