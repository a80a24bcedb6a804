"""Online learning from the trajectory store: served traces + user feedback → PARA-GRPO updates.

The serving agent writes traces (``Agent(store=...)``) and users attach feedback
(``agent.feedback(trace_id, answer=...)``, the Gradio page's feedback panel, the
API). :class:`OnlineLearner` polls the store for feedback newer than its cursor;
each feedback row carrying a correct answer becomes an RL prompt (the trace's
video, question and options; the task is MCQ with options, grounding when the
answer is a span, else open-ended). Rows with only a reward or thumbs are counted
and skipped: without a reference answer there is nothing to score fresh rollouts
against.

Each update runs fresh on-policy rollouts of up to ``prompts_per_step`` queued
prompts (plus replayed rollouts when ``replay.enabled``), then pushes the weights
to the serving endpoint every ``sync_every`` updates. With ``max_staleness`` η > 0
(``backend: sglang`` only) the updates take the asynchronous loop's objective and
bound (:meth:`GRPOTrainer.train_step`): decoupled PPO, and a group sampled more
than η versions before its update (a served policy that lags the trainer, e.g. a
server restarted on older weights) is dropped, counted in ``dropped_stale``, and
its prompt queued again, first, for the next update (rolled out on the weights
that update pushed): no feedback is lost to the bound. Under ``torchrun`` every
rank reads the same store and queue, takes its share of each update's prompts and
trains in step with the others (a rank whose share is empty still runs the
collectives).

Crash safety: the cursor and the queue of not-yet-trained prompts are saved in
the same atomic checkpoint as the weights and the optimizer, every ``save_every``
updates (the newest ``keep_checkpoints`` are kept; at 8B a checkpoint with the
optimizer is ~96 GB, too much to write after every update). After every update a
small ``online_state.json`` says where the learner is (step, cursor, queue,
prompts trained into the weights the server now holds). A restart resumes from
the newest checkpoint: feedback read after it is read again and the updates after
it are redone, so no feedback is lost and none is trained on twice.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from paravt_agent.errors import ParaVTError
from paravt_agent.protocol import parse_span
from paravt_agent.store import TrajectoryStore
from paravt_agent.video.fetch import local_video
from paravt_train.infra.interrupt import GracefulStop
from paravt_train.rl.async_loop import require_served_policy
from paravt_train.rl.config import GRPOConfig
from paravt_train.rl.rollout import PromptItem
from paravt_train.rl.trainer import GRPOTrainer

__all__ = ["OnlineLearner", "prompt_from_feedback"]


def prompt_from_feedback(row: dict, store: TrajectoryStore) -> PromptItem | None:
    """An RL prompt from one feedback row, or None when the row has no correct answer."""
    if not row.get("answer"):
        return None
    trace = store.get(row["trace_id"])
    answer = row["answer"].strip()
    if trace.options:
        task, value = "mcq", answer
    elif parse_span(answer) is not None and "[" in answer:
        task, value = "tvg", list(parse_span(answer))
    else:
        task, value = "oe", answer
    return PromptItem(f"feedback-{row['seq']}", trace.video, trace.question, trace.options, value, task)


class OnlineLearner:
    def __init__(self, cfg: GRPOConfig, store: str | Path | TrajectoryStore, progress: bool = True, log=print):
        self.trainer = GRPOTrainer(cfg, progress=progress, log=log)
        self.store = store if isinstance(store, TrajectoryStore) else TrajectoryStore(store)
        self.log = log
        self.consumed = 0
        self.saved_step: int | None = None  # the newest checkpoint this run wrote
        self.stopped: str | None = None  # the signal that ended run() early

    @property
    def state(self) -> dict:
        st = self.trainer.extra_state
        st.setdefault("cursor", 0)
        st.setdefault("queue", [])
        st.setdefault("skipped", 0)
        st.setdefault("trained", [])
        return st

    def poll(self) -> int:
        """Queue the prompts of feedback newer than the cursor; returns how many were queued."""
        st = self.state
        added = 0
        for row in self.store.feedback_since(st["cursor"]):
            try:
                item = prompt_from_feedback(row, self.store)
            except ParaVTError as exc:  # the trace is gone: skip the row, say so
                self.log(f"feedback {row['seq']}: {exc}; skipped")
                item = None
            if item is not None:
                try:  # a trace of a URL: its download (cached) is the video

                    item.video = local_video(item.video)
                except ParaVTError as exc:
                    self.log(f"feedback {row['seq']}: {exc}; skipped")
                    item = None
            if item is None:
                st["skipped"] += 1
            elif not Path(item.video).is_file():
                self.log(f"feedback {row['seq']}: video {item.video} is not readable here; skipped")
                st["skipped"] += 1
            else:
                st["queue"].append(asdict(item))
                added += 1
            st["cursor"] = row["seq"]
            self.consumed += 1
        return added

    def _poll_everywhere(self) -> None:
        """Rank 0 reads the store; every rank then holds the same cursor and queue."""
        tr = self.trainer
        if tr.world == 1:
            self.poll()
            return
        import torch.distributed as dist

        if tr.rank == 0:
            self.poll()
        st = self.state
        box = [{k: st[k] for k in ("cursor", "queue", "skipped")}]
        dist.broadcast_object_list(box, src=0)
        st.update(box[0])

    def _stale_everywhere(self) -> set[str]:
        """The prompts of the last update whose groups were dropped as too stale, over every rank."""
        tr = self.trainer
        mine = list(tr.stale_prompts)
        if tr.world == 1:
            return set(mine)
        import torch.distributed as dist

        shards: list = [None] * tr.world
        dist.all_gather_object(shards, mine)
        return {p for shard in shards for p in shard}

    def write_progress(self) -> None:
        """``online_state.json`` (rank 0, atomically): step, cursor, queue length, skipped rows and the prompts
        trained since the start — what the served weights have learned, after every update."""
        import json

        tr = self.trainer
        if tr.rank != 0:
            return
        st = self.state
        path = tr.out / "online_state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": tr.step, "cursor": st["cursor"], "queued": len(st["queue"]),
                                   "skipped": st["skipped"], "trained": st["trained"],
                                   "checkpoint_step": self.saved_step}))
        tmp.replace(path)

    def run(self, poll: float = 30.0, max_steps: int | None = None, once: bool = False) -> int:
        """Train until interrupted (or ``max_steps`` updates, or the queue is empty with ``once``)."""
        tr = self.trainer
        tr.setup()
        if tr.cfg.max_staleness > 0:  # refused now, not at the first feedback (which may come hours later)
            require_served_policy(tr)
        if self.saved_step is None and tr.step:  # resumed: that checkpoint is the newest
            self.saved_step = tr.step
        P = tr.cfg.prompts_per_step
        steps = 0
        with GracefulStop() as stop:
            while max_steps is None or steps < max_steps:
                if stop.requested():  # SIGTERM (here or on another rank): the updates so far are saved below
                    break
                self._poll_everywhere()
                st = self.state
                if not st["queue"]:
                    if once:
                        break
                    stop.sleep(poll)
                    continue
                rows = st["queue"][:P]
                batch = [PromptItem(**d) for d in rows]
                mine = batch[tr.rank :: tr.world]
                rec = tr.train_step(mine)
                stale = self._stale_everywhere()  # η > 0: too stale to train; queued again, first
                st["queue"] = [d for d in rows if d["id"] in stale] + st["queue"][len(batch):]
                st["trained"].extend(p.id for p in batch if p.id not in stale)
                if tr.step % tr.cfg.save_every == 0:
                    tr.save()  # weights, optimizer, cursor and queue together
                    self.saved_step = tr.step
                self.write_progress()
                steps += 1
                self.log(f"update {tr.step}: {len(batch)} prompts, reward {rec['reward']:.3f}, "
                         f"f_tau {rec['f_tau']:.2f}, kappa {rec['kappa']:.2f}"
                         + (f"; {len(stale)} too stale, queued again" if stale else ""))
        if steps and tr.step % tr.cfg.save_every:  # a clean stop keeps every update
            tr.save()
            self.saved_step = tr.step
            self.write_progress()
        tr.close()
        self.stopped = stop.signal_name
        if self.stopped:
            self.log(f"stopped by {self.stopped} after update {tr.step}; the checkpoint holds it and the cursor")
        return steps
