"""How the online learner's candidates become (or do not become) the served model: the gate, promotion, the
versions, rollback — automatic on live feedback, or an operator's.

:class:`Promotion` is an object the learner holds (``OnlineLearner.promotion``), given a narrow port to the trainer
(:class:`TrainerPort`: export the weights as a version, load a version's weights, push them, the evaluation agent,
the metrics log — never the trainer itself), the version registry, the run's config and the learner's
:class:`~paravt_train.online.state.OnlineState`. The statistics it decides by are pure functions beside it:
:mod:`paravt_train.online.gate` (the gate) and :mod:`paravt_train.online.rollback` (automatic rollback).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from paravt_agent import telemetry
from paravt_agent.errors import ParaVTError
from paravt_train.data import PromptItem, prompts_from_rl
from paravt_train.infra.distributed import barrier, on_rank0
from paravt_train.online.config import OnlineConfig
from paravt_train.online.gate import (
    decide,
    evaluate_dir,
    gate_margin,
    is_binary,
    pinned_hash,
    questions_needed,
    sized_discordance,
)
from paravt_train.online.rollback import RollbackCheck, rollback_decision, rollback_look
from paravt_train.online.state import OPERATOR, OnlineState, live_counts
from paravt_train.online.versions import VersionRegistry, push_version, write_event
from paravt_train.sync import make_weight_sync, server_keys
from paravt_train.sync.lease import push_lock

__all__ = ["OPERATOR", "Promotion", "RollbackCheck", "TrainerPort", "live_counts", "rollback_decision",
           "rollback_look"]


@dataclass(frozen=True)
class TrainerPort:
    """What promotion needs of the trainer, and nothing more (STYLE.md: a held object gets a port, not the owner)."""

    step: Callable[[], int]  # the updates made so far
    rank: int
    world: int
    out: Path  # the run's output directory (online_events.jsonl)
    export: Callable[[Path], Path]  # the current weights as a version directory (a LoRA run: its adapter); every rank
    load_weights: Callable[[Path], None]  # continue from a version's weights, the optimizer's moments reset; every rank
    push: Callable[[], object]  # the current weights onto the servers as version str(step); every rank
    eval_agent_config: Callable[[], object]  # the held-out agent (greedy, the trained budgets)
    log_metrics: Callable[[dict, int], None]  # numbers into metrics.jsonl's event lines and the trackers

    @classmethod
    def of(cls, trainer) -> TrainerPort:
        """The port of a :class:`~paravt_train.rl.trainer.GRPOTrainer` that is set up."""
        return cls(step=lambda: trainer.step, rank=trainer.rank, world=trainer.world, out=trainer.out,
                   export=trainer.export, load_weights=trainer.load_weights, push=trainer.push_weights,
                   eval_agent_config=trainer.eval_agent_config, log_metrics=trainer.metrics.log_event)


class Promotion:
    """The gate, promotion, rollback and the operator's decisions for the candidates of the trainer behind ``port``
    (one that pushes nothing by itself), recorded in ``registry``; ``state`` is the learner's, changed in place;
    ``journal`` is where every push it makes journals itself (the learner's ``OUTPUT_DIR/push.json``)."""

    def __init__(self, port: TrainerPort, registry: VersionRegistry, cfg: OnlineConfig, state: OnlineState,
                 log=print, journal: Path | None = None):
        self.port, self.registry, self.cfg, self.state, self.log = port, registry, cfg, state, log
        self.online = cfg.online
        self.journal = journal
        self._pinned: tuple[int, list[PromptItem], str] | None = None  # (round, the pinned set, its hash)
        self._audit: list[PromptItem] | None = None
        self.margin: float | None = None  # the gate's margin (sized at start)

    # ------------------------------------------------------------------ the pinned set

    def _pool(self) -> tuple[list[PromptItem], list[PromptItem]]:
        """The questions the gate decides on and the audit set held out of them (``audit_share``, seeded)."""
        g = self.online.gate
        if not g.rotate_every and not g.audit_share:
            return prompts_from_rl(g.eval_set, g.video_root, g.limit), []
        pool = prompts_from_rl(g.eval_set, g.video_root, None)
        order = list(range(len(pool)))
        random.Random(0).shuffle(order)
        k = round(g.audit_share * len(pool))
        audit = [pool[i] for i in sorted(order[:k])]
        rest = [pool[i] for i in sorted(order[k:])]
        return (rest if g.rotate_every else rest[: g.limit]), audit

    def gate_prompts(self) -> list[PromptItem]:
        """The pinned set of this round (a new draw of ``limit`` questions every ``rotate_every`` candidates)."""
        return self.pinned()[0]

    def pinned(self) -> tuple[list[PromptItem], str]:
        g = self.online.gate
        if not g.enabled:
            return [], ""
        rnd = self.state.gated // g.rotate_every if g.rotate_every else 0
        if self._pinned is None or self._pinned[0] != rnd:
            pool, self._audit = self._pool()
            prompts = random.Random(rnd).sample(pool, min(g.limit, len(pool))) if g.rotate_every else pool
            self._pinned = (rnd, prompts, pinned_hash(prompts, self.protocol()))
        return self._pinned[1], self._pinned[2]

    def size_gate(self) -> float | None:
        """The gate's margin on this pinned set (:func:`~paravt_train.online.gate.gate_margin`): refused here, at
        start, when the configured margin is below what the set can detect."""
        if not self.online.gate.enabled:
            return None
        prompts = self.gate_prompts()
        binary = all(p.task == "mcq" for p in prompts)
        g = self.online.gate
        self.margin = gate_margin(len(prompts), g, binary)
        if g.margin is None and self.margin > 0.05:
            self.log(f"warning: the gate holds a margin of {self.margin:.3f} on {len(prompts)} pinned questions (no "
                     f"online.gate.margin set: the smallest this set supports): a candidate up to that much worse "
                     f"can be promoted; a margin of 0.05 needs "
                     f"{questions_needed(0.05, g.confidence, g.power, g.discordance, binary)} questions")
        pool = len(self._pool()[0]) if g.rotate_every else 0
        if g.rotate_every and g.limit is not None and g.limit >= pool:
            self.log(f"warning: online.gate.rotate_every draws {g.limit} questions from a pool of {pool}: every "
                     "draw is the whole pool, nothing rotates")
        return self.margin

    def protocol(self) -> dict:
        """What the pinned scores were taken with, besides the questions (part of the pinned set's hash): the
        evaluation agent (its protocol, sampling, frames, budgets, tools) and the gate settings that change a score
        (``n_frames``, ``limit``, where it runs); not how many questions run at once. Scores taken under another
        protocol are stale."""
        g = self.online.gate
        agent = self._gate_config()
        agent = agent.model_dump(mode="json", exclude={"max_concurrency"}) if hasattr(agent, "model_dump") else agent
        return {"agent": agent, "n_frames": g.n_frames, "limit": g.limit, "mode": g.mode}

    def _gate_config(self):
        cfg = self.port.eval_agent_config()
        n = self.online.gate.n_frames
        return cfg if n is None else cfg.model_copy(update={"frames": cfg.frames.model_copy(update={"n_frames": n})})

    def _scores(self, path: Path, prompts: list[PromptItem] | None = None) -> list:
        g = self.online.gate
        prompts = self.gate_prompts() if prompts is None else prompts
        if g.mode != "shadow":
            return evaluate_dir(path, self._gate_config(), prompts, self.cfg.concurrency * 2)
        # the candidate onto the shadow server with the run's own sync (its keys; a LoRA run's adapter by its name)
        sync = make_weight_sync(self.cfg, g.shadow_endpoint)
        sync.serve(path, f"candidate-{path.name}")
        return evaluate_dir(path, self._gate_config(), prompts, self.cfg.concurrency * 2,
                            g.shadow_endpoint, adapter=sync.adapter_name, api_key=server_keys(self.cfg).api_key)

    def reference_scores(self, version: dict) -> list:
        """``version``'s scores on this round's pinned set: the stored ones when they were taken on it (the same
        :func:`~paravt_train.online.gate.pinned_hash`), else taken again from its weights and stored — a version
        without scores (the gate turned on later, an operator's promote) or with stale ones is scored, not an
        error (rank 0)."""
        prompts, h = self.pinned()
        gate = version.get("gate") or {}
        if gate.get("scores") is not None and gate.get("pinned") == h and len(gate["scores"]) == len(prompts):
            return gate["scores"]
        why = "its stored scores are of another pinned set" if gate.get("scores") else "no stored scores"
        self.log(f"gate: scoring {version['id']} on the pinned set ({why})")
        scores = self._scores(Path(version["path"]), prompts)
        self.registry.update(version["id"], gate={**gate, "scores": scores, "pinned": h, "candidate": _mean(scores)})
        return scores

    def _observed(self) -> list[float]:
        """The discordance each earlier gate observed, oldest first (the registry's gate records)."""
        gates = [v.get("gate") or {} for v in sorted(self.registry.versions(), key=lambda v: v.get("created", 0))]
        return [g["observed"] for g in gates if isinstance(g.get("observed"), int | float)]

    def _audit_score(self, path: Path) -> float | None:
        if not self.online.gate.audit_share:
            return None
        self.pinned()
        return _mean(self._scores(path, self._audit), none_is_zero=True) if self._audit else None

    # ------------------------------------------------------------------ versions

    def _barrier(self) -> None:
        if self.port.world > 1:
            barrier()

    def start_versions(self) -> None:
        """The registry's first version is the starting weights; the serving version goes (back) on the server.

        The starting weights are the learner's own: the base model on a fresh start, the checkpoint's weights (as
        ``v<step>``, exported) when it resumed without a registry. Registering the base there would put the base
        on the server under the checkpoint's weight version, and the redone updates would roll out from a policy
        they do not train while taking it for their own."""
        port, reg = self.port, self.registry
        margin = self.size_gate()  # refused before anything is exported or pushed
        if margin is not None:
            g = self.online.gate
            self.log(f"gate: {len(self.gate_prompts())} pinned questions hold a margin of {margin:.3f} (confidence "
                     f"{g.confidence:g}, power {g.power:g} at discordance {g.discordance:g})")
        first = not reg.versions()
        step = port.step()
        vid = f"v{step}"
        start = Path(self.cfg.model)
        if first and (self.cfg.lora.enabled or step):  # an adapter, or the checkpoint's weights: every rank exports
            start = port.export(reg.root / vid)
        if port.rank == 0 and first:
            gate = {}
            if self.online.gate.enabled:
                t0 = time.perf_counter()
                scores = self._scores(start)
                gate = {"scores": scores, "candidate": _mean(scores), "seconds": time.perf_counter() - t0,
                        "pinned": self.pinned()[1], "audit": self._audit_score(start)}
            why = "the starting weights" if not step else f"the starting weights (checkpoint-{step}'s)"
            reg.add(vid, step, start, "candidate", gate=gate, reason=why)
            reg.set_serving(vid, reason=why)
        self._barrier()
        serving = reg.serving()
        if port.rank == 0:
            push_version(self.cfg, serving, self.log, journal=self.journal)
        self._barrier()
        self.state.serving = serving["id"]

    def load_version(self, version: dict) -> None:
        """Continue from ``version``'s weights (every rank); the optimizer's moments start again."""
        self.port.load_weights(Path(version["path"]))
        self.state.serving = version["id"]

    def promote_candidate(self) -> dict:
        """Export the candidate, gate it (rank 0), then promote (push + record) or keep it aside."""
        port, reg, g, st = self.port, self.registry, self.online.gate, self.state
        step = port.step()
        vid = f"v{step}"
        path = port.export(reg.root / vid)  # every rank (gathered from the shards); a LoRA run: its adapter
        feedback = [d["seq"] for d in st.pending]

        def judge() -> dict:
            if not g.enabled:
                return {"promote": True, "summary": "no gate"}
            served, start = reg.serving(), reg.versions()[0]  # the registry's first version: the starting weights
            t0 = time.perf_counter()
            prompts, h = self.pinned()
            scores = self._scores(path, prompts)
            try:
                ref = self.reference_scores(served)
                ref0 = None if start["id"] == served["id"] else self.reference_scores(start)
            except (ParaVTError, OSError) as exc:  # their weights are gone: refused, said why, not a crash
                return {"promote": False, "summary": f"refused: the served or starting version could not be scored "
                        f"on the pinned set ({exc})", "scores": scores, "pinned": h}
            margin, planned = self.margin or self.size_gate(), sized_discordance(self._observed(), g)
            if planned > g.discordance:  # the versions disagree more than planned: the automatic margin widens
                sized = gate_margin(len(prompts), g.model_copy(update={"discordance": planned}),
                                    is_binary(scores, ref, ref0 or []))
                self.log(f"gate: the last gates observed discordance {planned:.2f} (planned {g.discordance:g}): "
                         f"margin {sized:.3f} (was {margin:.3f})")
                margin = max(margin, sized)
            res = decide(scores, ref, g, g.mode, time.perf_counter() - t0, start=ref0, start_id=start["id"],
                         margin=margin, pinned=h, planned=planned)
            if res.warning:
                self.log(f"gate warning: {res.warning}")
            out = {"promote": res.promote, "summary": res.summary(), **res.as_dict()}
            if res.promote:
                out["audit"] = self._audit_score(path)
            return out

        with telemetry.span("paravt.online.gate", attributes={"paravt.version": vid, "paravt.gate.mode": g.mode,
                                                               "paravt.gate.enabled": g.enabled}) as sp:
            verdict = on_rank0(judge, "the gate") if port.world > 1 else judge()
            telemetry.set_attributes(sp, {f"paravt.gate.{k}": v for k, v in verdict.items()
                                          if isinstance(v, bool | int | float | str)})
        gate = {k: v for k, v in verdict.items() if k not in ("promote", "summary")}
        if verdict["promote"]:
            if port.rank == 0:
                reg.add(vid, step, path, "candidate", feedback, gate, verdict["summary"])
            with self._one_push(), telemetry.span("paravt.online.promote", attributes={"paravt.version": vid,
                                                                                      "paravt.step": step}):
                # under the lock: an operator's push that came first stands (None: no version known to have served)
                moved = self._served_elsewhere(st.serving) if st.serving is not None else None
                if moved is None:
                    port.push()  # the candidate's weights to the server, as weight version str(step)
                    if port.rank == 0:  # with the push, under its lock: an operator's push comes before or after
                        reg.set_serving(vid, reason=f"promoted ({verdict['summary']})")
            if moved is not None:
                why = (f"candidate {vid} not pushed: it was gated against {st.serving}, and the server now holds "
                       f"{moved} (an operator's push while it was judged)")
                self.record_event({"event": "superseded", "version": vid, "serving": moved, "reason": why})
                self.log(why)
                self.follow_operator()
                st.since_promotion = 0
                return {**verdict, "promote": False, "summary": why}
            st.serving, st.pending = vid, []
        else:
            if port.rank == 0:
                reg.add(vid, step, path, "refused", feedback, gate, verdict["summary"])
                reg.prune_refused(self.online.keep_refused)
            if g.on_refuse == "revert":
                self.load_version(reg.serving())
                st.pending = []
        st.since_promotion = 0
        st.gated += 1  # the pinned set's round (rotate_every)
        self.record_event({"event": "promoted" if verdict["promote"] else "refused", "version": vid,
                           "gate": {k: v for k, v in gate.items() if k != "scores"}, "feedback": feedback})
        self.log(f"candidate {vid}: {verdict['summary']}")
        return verdict

    def check_rollback(self) -> str | None:
        """At the served version's planned looks (its counted labels reaching ``j × min_rows``), test its live score
        against the version served immediately before it (:func:`~paravt_train.online.rollback.rollback_decision`)
        and roll back when it is worse. Returns the version rolled back to."""
        r, reg, st = self.online.rollback, self.registry, self.state
        if not r.enabled:
            return None
        serving = reg.serving()
        prev = reg.served_before(serving["id"]) if serving else None
        if prev is None:
            return None
        sid = serving["id"]
        cur, before = live_counts(st.live.get(sid)), live_counts(st.live.get(prev["id"]))
        st.looks[sid], chk = rollback_look(cur, before, st.looks.get(sid, 0), r)
        if chk is None:
            self._untestable(sid, prev["id"], cur, before)
            return None
        self.log(f"rollback look {st.looks[sid]}/{r.looks} of {sid}: {chk.served:.3f} on {chk.n} labels vs "
                 f"{prev['id']}'s {chk.before:.3f} on {chk.n_before}; {chk.why}")
        if not chk.rollback:
            return None
        why = (f"rollback: live score of {sid} {chk.served:.2f} on {chk.n} labels is below {prev['id']}'s "
               f"{chk.before:.2f} on {chk.n_before} ({chk.why})")
        return self.rollback_to(prev, why, judged=sid)

    def _untestable(self, sid: str, prev: str, cur: dict, before: dict) -> None:
        """Said once per version: it has its first look's labels but cannot be tested (too few labels of the version
        before it, which no longer serves, or too few users): a rollback that is quietly off is an operator's
        surprise."""
        r, st = self.online.rollback, self.state
        if sum(c[2] for c in cur.values()) < r.min_rows or sid in st.untestable:
            return
        chk = rollback_decision(cur, before, r)
        if chk.tested:
            return
        st.untestable.append(sid)
        why = f"{sid} cannot be rolled back to {prev} yet: {chk.why}"
        self.log(f"rollback {why}")
        self.record_event({"event": "rollback-untestable", "version": sid, "before": prev, "reason": why})

    def _one_push(self):
        """The push lock (rank 0, :func:`~paravt_train.sync.lease.push_lock`) around a push and the registry's
        record of it, so an operator's push never lands between the two."""
        return push_lock(self.journal, log=self.log) if self.journal is not None else contextlib.nullcontext()

    def _moved_from(self, expected: str | None) -> str | None:
        """The version the registry says serves when it is not ``expected`` (the one a decision was taken against):
        an operator pushed in between. Rank 0, under the push lock."""
        now = self.registry.serving()
        return now["id"] if now is not None and now["id"] != expected else None

    def _served_elsewhere(self, expected: str | None) -> str | None:
        """:meth:`_moved_from` asked on rank 0, the answer given to every rank (every rank calls it)."""
        look = lambda: self._moved_from(expected)  # noqa: E731
        return on_rank0(look, "the registry") if self.port.world > 1 else look()

    def rollback_to(self, version: dict, why: str, judged: str | None = None) -> str | None:
        """Put ``version`` back on the server. ``judged``: the version the decision was taken against; when an
        operator's push replaced it meanwhile, nothing is pushed (the operator's choice stands) and None returned."""
        moved = None
        if self.port.rank == 0:
            with self._one_push():
                moved = self._moved_from(judged) if judged is not None else None
                if moved is None:
                    push_version(self.cfg, version, self.log, journal=self.journal)
                    self.registry.set_serving(version["id"], reason=why)
        if self.port.world > 1:
            moved = on_rank0(lambda: moved, "the rollback")
        if moved is not None:
            self.log(f"rollback to {version['id']} not pushed: the server now holds {moved} (an operator's push "
                     f"while {judged} was judged)")
            self.follow_operator()
            return None
        self._barrier()
        self.load_version(version)
        self.record_event({"event": "rolled-back", "version": version["id"], "reason": why})
        self.log(why)
        return version["id"]

    def follow_operator(self) -> None:
        """An operator promoted or rolled back (``paravt-train online promote|rollback``): continue from that."""
        serving = self.registry.serving()
        if serving is not None and serving["id"] != self.state.serving:
            self.log(f"the server now holds {serving['id']} ({serving.get('reason', '')}); continuing from it")
            self.load_version(serving)

    def record_event(self, rec: dict) -> None:
        """One line of ``online_events.jsonl`` (rank 0), its numbers into the metrics log."""
        port = self.port
        if port.rank != 0:
            return
        step = port.step()
        rec = write_event(port.out, {"step": step, **rec})
        gate = rec.get("gate") or {}
        numbers = {f"online/{k}": v for k, v in gate.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        numbers["online/promoted"] = float(rec["event"] == "promoted")
        port.log_metrics(numbers, step)


def _mean(xs: list, none_is_zero: bool = False) -> float:
    xs = [0.0 if x is None else x for x in xs] if none_is_zero else [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else 0.0
