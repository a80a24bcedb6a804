"""The GRPO trainer's checkpoints: save and resume (model, optimizer, scheduler, RNG, every rank's replay buffer
and unused rollouts), with the replayed frames stored once by content key. A mixin of
:class:`~paravt_train.rl.trainer.GRPOTrainer` (which owns ``out``, ``model``, ``replay``, … it reads)."""

from __future__ import annotations

import json
from pathlib import Path

from paravt_train.infra.checkpoint import (
    load_blobs,
    load_checkpoint,
    load_rank_blobs,
    prune_checkpoints,
    resume_latest,
    save_checkpoint,
)
from paravt_train.rl.replay import store_frames

__all__ = ["TrainerCheckpoints"]


class TrainerCheckpoints:
    @property
    def frame_store(self) -> Path:
        """Replayed rollouts' frames, stored once by content key and shared by every checkpoint."""
        return self.out / "replay_frames"

    def _resume(self) -> None:
        import numpy as np

        def load(path: Path) -> None:
            self.step = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
            blobs = load_blobs(path)
            mine = load_rank_blobs(path, self.rank)
            if mine is None and self.rank == 0:  # a checkpoint from before per-rank state: rank 0's was shared
                mine = {"replay": blobs["replay"]} if "replay" in blobs else None
            if mine and "replay" in mine:
                self.replay.load_state_dict(mine["replay"], lambda key: np.load(self.frame_store / f"{key}.npy"))
            self.restored_queue = mine.get("queue") if mine and self.cfg.stale_queue_on_resume == "keep" else None
            self.extra_state = blobs.get("extra_state", {})

        self.model.train()
        resumed = resume_latest(self.out, load, self.log) if self.cfg.resume else None
        self.metrics.start(self.step if resumed is not None else 0)  # drops the lines of steps to be redone
        if resumed is None:
            return
        latest = resumed[0]
        self.log(f"resumed from {latest} (step {self.step})")
        if self.syncer is not None and self.auto_sync:
            self.sync()

    def save(self) -> Path:
        """A checkpoint of this step (model, optimizer, scheduler, RNG, ``extra_state``, and every rank's own
        replay buffer, its frames stored once by content); the ``keep_checkpoints`` newest are kept."""
        path = self.out / f"checkpoint-{self.step}"
        state, frames = self.replay.state_dict()
        store_frames(frames, self.frame_store, self.rank)
        keys = sorted(frames)
        if self.world > 1:
            import torch.distributed as dist

            shards: list = [None] * self.world
            dist.all_gather_object(shards, keys)
            keys = sorted({k for shard in shards for k in shard})
        mine = {"replay": state}
        if self.producer is not None and self.cfg.stale_queue_on_resume == "keep":
            mine["queue"] = self.producer.unused()  # rolled out, not yet trained
        save_checkpoint(path, self.model, self.optimizer, self.scheduler, self.step,
                        blobs={"extra_state": self.extra_state}, rank_blobs=mine, extra={"replay_frames": keys})
        if self.rank == 0:
            prune_checkpoints(self.out, self.cfg.keep_checkpoints)
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

