"""Asynchronous PARA-GRPO: rollouts never wait for the update (the paper trained ParaVT-8B with AReaL).

::
    producer (a thread) ── the groups of step s, s+1, … through the agent graph, against the served policy ──┐
                                                                                                             ▼
    trainer ── takes step k's groups ──► decoupled-PPO update ──► weight push ──► version k+1 ──► takes k+1 …

* **The producer** rolls out each step's prompts (:meth:`GRPOTrainer.prompts_for`, the same prompts and
  seeds as the synchronous loop) through the same agent graph, against the rollout server (``backend:
  sglang``); every token is tagged with the policy version that sampled it (SGLang's ``weight_version``
  and ``weight_versions`` spans: :func:`paravt_train.rl.rollout.policy_versions`).
* **Bounded staleness** (``max_staleness`` η, AReaL's ``max_head_offpolicyness``): the producer starts step
  s only once the trainer has reached version s − η, so it throttles itself instead of generating what would
  be discarded; a group whose oldest token is more than η versions behind at its update is dropped (counted
  in ``dropped_stale``).
* **Weight pushes do not stop generation**: the sync pauses the server with ``retract`` (requests in flight
  keep their tokens and continue on the new weights: a partial rollout, each token trained with its own
  behaviour logprob), then generation goes on.
* **The objective**: decoupled PPO (:func:`paravt_train.rl.update.behaviour_weights`): the ratio to π_prox
  (this model at the start of the update), each token weighted by π_prox / π_behav, capped.
* η = 0 is the synchronous loop itself (:meth:`GRPOTrainer.train_step`), number for number.
* Under ``torchrun`` every rank runs its own producer on its share of each step's prompts; ranks take the
  same step together. A restart starts the producer at the checkpoint's step; finished groups not yet
  trained are dropped or kept with the checkpoint (``stale_queue_on_resume``).
"""

from __future__ import annotations

import dataclasses
import threading
import time

from paravt_agent.errors import ConfigError

__all__ = ["AsyncRollouts", "require_served_policy", "within_staleness"]


def require_served_policy(trainer) -> None:
    """η > 0 rolls out on a served policy that the trainer updates while it generates: ``backend: sglang``
    (a backend that generates with the trained parameters in this process has no versions to bound)."""
    if trainer.syncer is None:
        raise ConfigError("asynchronous RL (max_staleness > 0) rolls out on a served policy that the trainer "
                          "updates while it generates: use backend sglang")


def within_staleness(groups: list, version: int, eta: int) -> tuple[list, list]:
    """The groups an update at ``version`` may train, and those it drops: a group whose oldest token was
    sampled more than η versions before ``version`` (AReaL's bound; groups without reported versions pass)."""
    fresh, stale = [], []
    for g in groups:
        oldest = min((min(e.versions) for e in g if e.versions), default=version)
        (stale if version - oldest > eta else fresh).append(g)
    return fresh, stale


class AsyncRollouts:
    """The producer thread and the trainer's side of it: ``AsyncRollouts(trainer, prompts).train_step()``."""

    def __init__(self, trainer, prompts: list, restored: dict | None = None):
        cfg = trainer.cfg
        if cfg.max_staleness < 1:
            raise ConfigError("max_staleness 0 is the synchronous loop: use GRPOTrainer.train_step")
        require_served_policy(trainer)
        if cfg.dynamic_sampling:
            raise ConfigError("dynamic sampling replaces groups after they are rolled out; it is not supported "
                              "with max_staleness > 0")
        self.trainer, self.prompts, self.eta = trainer, prompts, cfg.max_staleness
        self.version = trainer.step  # the policy version the server holds
        self.next_step = trainer.step
        self.done: dict[int, tuple[list, float]] = dict(restored or {})  # step -> (groups, rollout seconds)
        self.timeline: list[dict] = []  # phases of both sides: name, step, start, end (perf_counter)
        self.error: BaseException | None = None
        self.cv = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._produce, name="paravt-rollout-producer", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ producer

    def _produce(self) -> None:
        tr, cfg = self.trainer, self.trainer.cfg
        step = self.next_step
        try:
            while step < cfg.steps:
                with self.cv:
                    # AReaL's bound: no rollout starts more than η versions ahead of the policy that trains on it
                    while not self.stopped and (self.version < step - self.eta or step in self.done):
                        if step in self.done:  # restored with the checkpoint
                            step += 1
                            continue
                        self.cv.wait()
                    if self.stopped or step >= cfg.steps:
                        return
                t0 = time.perf_counter()
                groups = tr.rollout(tr.prompts_for(step, self.prompts), step=step)
                t1 = time.perf_counter()
                with self.cv:
                    self.done[step] = (groups, t1 - t0)
                    self.timeline.append({"name": "rollout", "step": step + 1, "start": t0, "end": t1})
                    self.cv.notify_all()
                step += 1
        except BaseException as exc:  # noqa: BLE001 (handed to the trainer, which raises it)
            with self.cv:
                self.error = exc
                self.cv.notify_all()

    # ------------------------------------------------------------------ trainer side

    def _take(self, step: int) -> tuple[list, float, float]:
        t0 = time.perf_counter()
        with self.cv:
            while step not in self.done and self.error is None:
                self.cv.wait()
            if self.error is not None:
                raise self.error
            groups, seconds = self.done.pop(step)
        t1 = time.perf_counter()
        self.timeline.append({"name": "wait", "step": step + 1, "start": t0, "end": t1})
        return groups, seconds, t1 - t0

    def train_step(self) -> dict:
        """Train on the next step's groups (waiting for them only if the producer is behind), push the
        weights, let the producer go one version further; returns the step's metrics."""
        tr = self.trainer
        step = tr.step
        groups, rollout_s, wait_s = self._take(step)
        fresh, stale = within_staleness(groups, step, self.eta)  # more than η versions behind: not trained
        t0 = time.perf_counter()
        rec = tr.learn(fresh, groups, tr.prompts_for(step, self.prompts),
                       {"rollout_seconds": rollout_s, "wait_seconds": wait_s, "dropped_stale": len(stale)})
        self.timeline.append({"name": "update+sync", "step": step + 1, "start": t0, "end": time.perf_counter()})
        with self.cv:
            self.version = tr.step
            self.cv.notify_all()
        return rec

    def unused(self) -> dict[int, tuple[list, float]]:
        """Finished groups not yet trained, for a checkpoint: copies of their episodes without the full answers
        (the graph's records, not needed to train; the queued episodes themselves keep theirs: this run still
        trains on them and they are not the checkpoint's to change)."""
        with self.cv:
            return {step: ([[dataclasses.replace(e, answer=None) for e in g] for g in groups], seconds)
                    for step, (groups, seconds) in self.done.items()}

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()
        self.thread.join(timeout=600)
