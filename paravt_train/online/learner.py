"""The online learner (``paravt-train online``): :class:`OnlineLearner` polls the trajectory store's feedback,
queues the rows it can train on, runs PARA-GRPO updates on them with the trainer it holds and hands each candidate
to the promotion it holds (:class:`~paravt_train.online.promotion.Promotion`, given a port to the trainer and the
learner's :class:`~paravt_train.online.state.OnlineState`). The loop reads top to bottom in :mod:`paravt_train.online`
and in :meth:`OnlineLearner.run`.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

from paravt_agent.errors import FeedbackError, ParaVTError
from paravt_agent.protocol import parse_span
from paravt_agent.store import TrajectoryStore
from paravt_agent.store.feedback import check_answer, task_of
from paravt_agent.store.principals import WEB, principal_of
from paravt_agent.video.fetch import local_video
from paravt_train.data.records import PromptItem
from paravt_train.infra.interrupt import GracefulStop
from paravt_train.online.config import OnlineConfig
from paravt_train.online.lock import LearnerLock
from paravt_train.online.promotion import Promotion, TrainerPort
from paravt_train.online.state import OPERATOR, OnlineState, live_counts
from paravt_train.online.versions import VersionRegistry, push_version, repair_push
from paravt_train.rewards import accuracy_reward
from paravt_train.rl.async_loop import require_served_policy
from paravt_train.rl.config import GRPOConfig
from paravt_train.rl.trainer import GRPOTrainer

__all__ = ["OnlineLearner", "check_row", "prompt_from_feedback"]


def check_row(row: dict, trace) -> str | None:
    """Why a feedback row cannot be trained on (None: it can): no answer, or an answer the trace's question cannot
    have (:func:`paravt_agent.store.feedback.check_answer`)."""
    return _checked(row, trace)[1]


def _checked(row: dict, trace) -> tuple[str | None, str | None]:
    """The row's answer as the trace's question takes it, and why it cannot be trained on (one check, one fetch)."""
    if row.get("answer") is None:
        return None, "no answer (a reward or thumbs only)"
    try:
        return check_answer(trace, row["answer"]), None
    except FeedbackError as exc:
        return None, f"invalid answer ({str(exc).split(';')[0][:80]})"


def prompt_from_feedback(row: dict, trace, answer: str | None = None) -> PromptItem | None:
    """An RL prompt from one feedback row and its trace (``answer``: the row's answer, checked already), or None
    when the row cannot be trained on."""
    if answer is None:
        answer, why = _checked(row, trace)
        if why is not None:
            return None
    task = task_of(trace)
    value = list(parse_span(answer)) if task == "tvg" else answer
    return PromptItem(id=f"feedback-{row['seq']}", video=trace.video, question=trace.question, options=trace.options,
                      answer=value, task=task)


class OnlineLearner:
    """Feedback → updates → gated versions. It holds the :class:`~paravt_train.rl.trainer.GRPOTrainer` that updates
    (``trainer``, its own pushes off), the :class:`~paravt_train.online.state.OnlineState` it keeps (``state``, saved
    with the weights) and the :class:`~paravt_train.online.promotion.Promotion` that decides what serves
    (``promotion``, given a port to the trainer and that state)."""

    def __init__(self, cfg: OnlineConfig | GRPOConfig, store: str | Path | TrajectoryStore, progress: bool = True,
                 log=print):
        cfg = OnlineConfig.of(cfg)
        self.trainer = GRPOTrainer(cfg, progress=progress, log=log, push_updates=False)  # promoted versions only
        self.cfg, self.online = cfg, cfg.online
        self.store = store if isinstance(store, TrajectoryStore) else TrajectoryStore(store)
        self.registry = VersionRegistry(Path(cfg.output_dir) / "versions")
        self.log = log
        self.consumed = 0
        self.saved_step: int | None = None  # the newest checkpoint this run wrote
        self.stopped: str | None = None  # the signal that ended run() early
        self.state = OnlineState()  # replaced by the checkpoint's at setup (resume)
        self.promotion: Promotion | None = None  # made at setup: the port needs the trainer set up
        self.lock: LearnerLock | None = None  # this learner's hold on its output directory and store (rank 0)

    @property
    def journal(self) -> Path:
        """The push journal and lease (:mod:`paravt_train.sync.lease`): ``OUTPUT_DIR/push.json`` while a push runs
        (``paravt serve --sync-lease`` reads it), left behind by a learner killed during one."""
        return Path(self.cfg.output_dir) / "push.json"

    def setup(self) -> None:
        """The learner's lock (rank 0: one learner per output directory and store, refused here naming the one that
        holds them), the trainer (resumed from its newest checkpoint), the state that checkpoint kept, the
        promotion."""
        if self.lock is None and int(os.environ.get("RANK", "0")) == 0:  # before anything loads or pushes
            self.lock = LearnerLock(self.cfg.output_dir, self.store).acquire()
        tr = self.trainer
        tr.setup()
        if self.promotion is None:
            if tr.extra_state:  # resumed: the checkpoint's state (else the one made here, polled or not)
                self.state = OnlineState.from_dict(tr.extra_state)
            self.promotion = Promotion(TrainerPort.of(tr), self.registry, self.cfg, self.state, self.log,
                                       journal=self.journal if tr.rank == 0 else None)

    def close(self) -> None:
        """Let go of the output directory and the store (another learner may start)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def save(self) -> None:
        """A checkpoint: the weights, the optimizer and the state together (atomic)."""
        self.trainer.save(extra_state=self.state.to_dict())
        self.saved_step = self.trainer.step

    # ------------------------------------------------------------------ feedback

    def _skip(self, row: dict, reason: str) -> None:
        st, key = self.state, reason.split(" (")[0]
        st.skipped += 1
        st.skipped_by[key] = st.skipped_by.get(key, 0) + 1
        self.log(f"feedback {row['seq']}: {reason}; skipped")

    def _within_limit(self, user: str, created: float) -> bool:
        """Counts the row against its user's window; False when the user is over ``max_rows_per_user``."""
        cap, window = self.online.max_rows_per_user, self.online.user_window_hours * 3600
        times = [t for t in self.state.users.get(user, []) if t > created - window]
        if cap is not None and len(times) >= cap:
            self.state.users[user] = times
            return False
        self.state.users[user] = [*times, created]
        return True

    def poll(self) -> int:
        """Queue the prompts of feedback newer than the cursor (each row fetched once and checked once, its skip
        reason counted); count each labelled row within its user's limits for the live score of the version that
        served its trace (:meth:`_count_live`). Returns how many prompts were queued."""
        st = self.state
        added = 0
        for row in self.store.feedback_since(st.cursor):
            st.cursor = row["seq"]
            self.consumed += 1
            try:
                trace = self.store.get(row["trace_id"])
            except ParaVTError as exc:
                self._skip(row, f"trace not found ({exc})")
                continue
            answer, why = _checked(row, trace)
            if why is not None:
                self._skip(row, why)
                continue
            repeat = row["trace_id"] in st.answers  # the same label again: one answer is one live label
            first = st.answers.setdefault(row["trace_id"], answer)
            if first != answer:
                self._skip(row, f"conflicts with earlier feedback ({first!r} vs {answer!r})")
                continue
            # the limits count principals (the key's owner, the web page, ...: never a name the caller chose); the
            # operator's own rows (no principal, no user) are not limited: they guard against users
            user = principal_of(row)
            user = None if user == OPERATOR else user
            if user is not None and not self._within_limit(user, row.get("created") or time.time()):
                self._skip(row, f"user over max_rows_per_user ({user})")
                continue
            item = prompt_from_feedback(row, trace, answer)
            if not repeat:
                self._count_live(trace, item.answer, user)  # after the limit: a row over it is no label either
            try:  # a trace of a URL: its download (cached) is the video
                item.video = local_video(item.video)
            except ParaVTError as exc:
                self._skip(row, f"video unreadable ({exc})")
                continue
            if not Path(item.video).is_file():
                self._skip(row, f"video unreadable (not at {item.video})")
                continue
            st.queue.append({**asdict(item), "user": user, "seq": row["seq"]})
            added += 1
        return added

    def _count_live(self, trace, value, user: str | None = None) -> None:
        """A label of the answer the trace's user got (``value``: the label as the reward takes it), scored with the
        gate's metric (accuracy, F1 or IoU), for the version that served it: counted per principal (``user``), at
        most ``rollback.max_labels_per_user`` of one principal's labels per version (the operator's own rows count
        as one voter, not limited; the web page's not at all with ``rollback.web_votes`` off)."""
        vid = self.registry.served_at(trace.created)
        if vid is None:
            return
        score = accuracy_reward(trace.response, value, task_of(trace), trace.options)
        live = self.state.live
        if user == WEB and not self.online.rollback.web_votes:
            return
        counts = live[vid] = live_counts(live.get(vid))
        who = counts.setdefault(user or OPERATOR, [0.0, 0.0, 0])
        if user is not None and who[2] >= self.online.rollback.max_labels_per_user:
            return
        who[0] += score
        who[1] += score * score
        who[2] += 1

    def take_batch(self) -> list[dict]:
        """Up to ``prompts_per_step`` queued prompts, oldest first, at most ``ceil(max_user_share · P)`` from one
        user (the rest stay queued, in order; the operator's own rows, without a user, are not limited)."""
        P = self.cfg.prompts_per_step
        cap = max(1, math.ceil(self.online.max_user_share * P))
        batch, per_user = [], {}
        for d in self.state.queue:
            if len(batch) == P:
                break
            user = d.get("user")
            if user is None or per_user.get(user, 0) < cap:
                batch.append(d)
                per_user[user] = per_user.get(user, 0) + 1
        return batch

    def _poll_everywhere(self) -> None:
        """Rank 0 reads the store; every rank then holds the same state."""
        tr = self.trainer
        if tr.world == 1:
            self.poll()
            return
        import torch.distributed as dist

        if tr.rank == 0:
            self.poll()
        box = [self.state.polled()]
        dist.broadcast_object_list(box, src=0)
        self.state.take_polled(box[0])

    def _stale_everywhere(self) -> set[str]:
        tr = self.trainer
        mine = list(tr.stale_prompts)
        if tr.world == 1:
            return set(mine)
        import torch.distributed as dist

        shards: list = [None] * tr.world
        dist.all_gather_object(shards, mine)
        return {p for shard in shards for p in shard}

    # ------------------------------------------------------------------ the loop

    def write_progress(self) -> None:
        """``online_state.json`` (rank 0, atomically): where the learner is after every update (what
        ``paravt-train online status`` prints)."""
        tr = self.trainer
        if tr.rank != 0:
            return
        st = self.state
        per_user: dict[str, int] = {}
        for d in st.queue:
            who = d.get("user") or "operator"
            per_user[who] = per_user.get(who, 0) + 1
        path = tr.out / "online_state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({
            "step": tr.step, "cursor": st.cursor, "queued": len(st.queue), "queued_by_user": per_user,
            "skipped": st.skipped, "skipped_by": st.skipped_by, "trained": st.trained, "serving": st.serving,
            "pending": [d["seq"] for d in st.pending], "live": st.live,
            "users": {u: len(t) for u, t in st.users.items()}, "checkpoint_step": self.saved_step}, indent=1))
        tmp.replace(path)

    def repair_push(self, restore: bool = False) -> dict | None:
        """A push the journal says never ended (its pusher died: the last learner, or an operator's ``promote`` /
        ``rollback``): continue generation on the servers it names (the supervisor of ``paravt serve`` may have done
        so already) and close a weight-update session it left open
        (:func:`~paravt_train.online.versions.repair_push`: under the push lock, once its lease is known dead by
        this process's own clock; a live pusher's push is waited for, a pusher renewing without the lock refused).
        At start :meth:`Promotion.start_versions` then puts the version the registry says serves back on them,
        whatever the half-applied push left there; while the learner runs (``restore``) that push is made here,
        under the same lock. Returns what was found (None: nothing)."""
        self.setup()  # the events it records, and the servers it names, are the set-up run's
        if self.trainer.rank != 0:
            return None
        serving = self.registry.serving()
        back = None
        if restore and serving is not None:
            def back():
                return push_version(self.cfg, serving, self.log, journal=self.journal)
        left = repair_push(self.cfg, self.journal, self.log, restore=back)
        if left is None:
            return None
        done, errors = left["continued"], left["errors"]
        why = (f"a push of version {left['version']} ({left['sync']}, pid {left.get('pid')} on {left.get('host')}) "
               f"never ended: generation continued on {', '.join(done) or 'no server'}"
               + (f" (failed: {'; '.join(errors)})" if errors else "")
               + (f"; {serving['id']}, the version that serves, goes back on the servers" if serving else ""))
        self.log(why)
        self.promotion.record_event({"event": "push-repaired", "version": left["version"], "servers": done,
                                     "errors": errors, "reason": why})
        return left

    def run(self, poll: float = 30.0, max_steps: int | None = None, once: bool = False) -> int:
        """Train until interrupted (or ``max_steps`` updates, or the queue is empty with ``once``). A push the last
        learner left half-applied is repaired first (:meth:`repair_push`, and while it runs: an operator's push
        that died); every push journals itself (:attr:`journal`) until it ends. The learner's lock is let go when
        it ends, however it ends."""
        try:
            return self._learn(poll, max_steps, once)
        finally:
            self.close()

    def _learn(self, poll: float, max_steps: int | None, once: bool) -> int:
        tr = self.trainer
        self.setup()
        self.repair_push()
        if tr.cfg.max_staleness > 0:  # refused now, not at the first feedback (which may come hours later)
            require_served_policy(tr)
        if self.saved_step is None and tr.step:  # resumed: that checkpoint is the newest
            self.saved_step = tr.step
        promotion = self.promotion
        promotion.start_versions()
        steps = 0
        with GracefulStop() as stop:
            while max_steps is None or steps < max_steps:
                if stop.requested():  # SIGTERM (here or on another rank): the updates so far are saved below
                    break
                try:
                    self.repair_push(restore=True)  # an operator's push that died while this learner ran (rank 0)
                except (ParaVTError, OSError) as exc:  # a server or the journal's disk: tried again next round
                    self.log(f"repairing a push that never ended failed ({exc}); trying again next round")
                promotion.follow_operator()
                self._poll_everywhere()
                st = self.state
                batch_rows = self.take_batch()
                if not batch_rows:
                    if once:
                        break
                    stop.sleep(poll)
                    continue
                batch = [PromptItem(**{k: v for k, v in d.items() if k not in ("user", "seq")}) for d in batch_rows]
                rec = tr.train_step(batch[tr.rank:: tr.world])
                stale = self._stale_everywhere()  # η > 0: too stale to train; queued again, first
                taken = {id(d) for d in batch_rows}
                st.queue = [d for d in batch_rows if d["id"] in stale] + [d for d in st.queue if id(d) not in taken]
                st.trained.extend(d["id"] for d in batch_rows if d["id"] not in stale)
                st.pending.extend(d for d in batch_rows if d["id"] not in stale)
                st.since_promotion += 1
                if st.since_promotion >= self.online.promote_every:
                    promotion.promote_candidate()
                promotion.check_rollback()
                if tr.step % tr.cfg.save_every == 0:
                    self.save()  # weights, optimizer, cursor, queue, live counts together
                self.write_progress()
                steps += 1
                self.log(f"update {tr.step}: {len(batch)} prompts, reward {rec['reward']:.3f}, "
                         f"f_tau {rec['f_tau']:.2f}, kappa {rec['kappa']:.2f}"
                         + (f"; {len(stale)} too stale, queued again" if stale else ""))
        if steps and tr.step % tr.cfg.save_every:  # a clean stop keeps every update
            self.save()
            self.write_progress()
        tr.close()
        self.stopped = stop.signal_name
        if self.stopped:
            self.log(f"stopped by {self.stopped} after update {tr.step}; the checkpoint holds it and the cursor")
        return steps
