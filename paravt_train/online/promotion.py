"""How the online learner's candidates become (or do not become) the served model: the gate, promotion, the
versions, rollback — automatic on live feedback, or an operator's.

:class:`Promotion` is an object the learner holds (``OnlineLearner.promotion``), made with the trainer whose weights
it exports and reloads, the version registry and the run's config; the state it shares with the learner is the
trainer's checkpointed ``extra_state`` (:func:`online_state`).

Automatic rollback (:func:`rollback_decision`, a pure function of the live counts): the served version's live
score — the gate's metric (accuracy, F1, IoU) of the answers users labelled, counted after the per-user limits and
at most ``max_labels_per_user`` labels of one user per version — against the version served immediately before
it (:meth:`VersionRegistry.served_before`, never a rolled-back one), by a one-sided pooled two-sample z-test
(for binary scores the two-proportion test) at ``alpha / looks``, checked only when the served version's count
reaches ``j × min_rows`` (j = 1 … ``looks``; Bonferroni over the planned looks: a version as good as the one
before is rolled back at most ``alpha`` of the time), with labels from at least ``min_users`` users on each side,
and only when the test stays significant with any single user's labels left out of both sides."""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

from paravt_agent import telemetry
from paravt_agent.errors import ParaVTError
from paravt_train.data import PromptItem, prompts_from_rl
from paravt_train.infra.distributed import barrier, on_rank0
from paravt_train.online.config import RollbackSettings
from paravt_train.online.gate import decide, evaluate_dir, gate_margin, pinned_hash, questions_needed
from paravt_train.online.versions import VersionRegistry, push_version
from paravt_train.rl.config import GRPOConfig
from paravt_train.sync import make_weight_sync

__all__ = ["OPERATOR", "Promotion", "RollbackCheck", "live_counts", "online_state", "rollback_decision",
           "rollback_look"]

OPERATOR = "(operator)"  # the live labels of rows without a user (the operator's own code): one user, not limited


def online_state(trainer) -> dict:
    """The online learner's state — the feedback cursor, the queue, skip counts, what was trained, the candidate's
    pending rows, per-user times, first answers, live score counts (per version, per user: [sum, sum of squares,
    labels]), the rollback looks taken per version, candidates gated, updates since the last promotion and the
    serving version — kept in the trainer's ``extra_state``, so it is saved and restored with the weights."""
    st = trainer.extra_state
    for key, empty in (("cursor", 0), ("queue", []), ("skipped", 0), ("skipped_by", {}), ("trained", []),
                       ("pending", []), ("users", {}), ("answers", {}), ("live", {}), ("looks", {}), ("gated", 0),
                       ("since_promotion", 0), ("serving", None)):
        st.setdefault(key, empty)
    return st


def live_counts(entry) -> dict[str, list]:
    """A version's live counts by user ``{user: [sum, sum of squares, labels]}`` (a checkpoint written before
    labels were counted per user holds ``[right, labelled]``: one user, binary scores)."""
    if entry is None:
        return {}
    if isinstance(entry, list):
        return {"(earlier)": [float(entry[0]), float(entry[0]), int(entry[1])]}
    return entry


@dataclass
class RollbackCheck:
    rollback: bool
    tested: bool  # False: not enough labels or users to test (the look is not used up)
    served: float = 0.0  # live means
    before: float = 0.0
    n: int = 0
    n_before: int = 0
    z: float = 0.0
    critical: float = 0.0
    why: str = ""


def _totals(counts: dict, leave_out: str | None = None) -> tuple[float, float, int]:
    s = ss = 0.0
    n = 0
    for user, (a, b, k) in counts.items():
        if user != leave_out:
            s, ss, n = s + a, ss + b, n + k
    return s, ss, n


def _z(cur: tuple, base: tuple, margin: float) -> float:
    """The pooled two-sample z of ``base − margin − cur`` (large: the served version is worse)."""
    (s1, ss1, n1), (s2, ss2, n2) = cur, base
    if not n1 or not n2:
        return -math.inf
    pooled = (s1 + s2) / (n1 + n2)
    var = max(0.0, (ss1 + ss2) / (n1 + n2) - pooled * pooled)
    num = s2 / n2 - margin - s1 / n1
    if var <= 1e-15:
        return math.inf if num > 1e-12 else -math.inf
    return num / math.sqrt(var * (1 / n1 + 1 / n2))


def rollback_decision(served: dict, before: dict, r: RollbackSettings) -> RollbackCheck:
    """Whether the served version's live counts (``{user: [sum, sum of squares, labels]}``) are worse than the
    version before's by more than ``r.margin`` at one look (one-sided at ``r.alpha / r.looks``), with at least
    ``r.min_users`` users on each side and the decision unchanged with any one user's labels left out."""
    cur, base = _totals(served), _totals(before)
    users = {u for u, c in served.items() if c[2]}
    users_before = {u for u, c in before.items() if c[2]}
    out = RollbackCheck(False, False, cur[0] / cur[2] if cur[2] else 0.0, base[0] / base[2] if base[2] else 0.0,
                        cur[2], base[2])
    if base[2] < r.min_rows or len(users) < r.min_users or len(users_before) < r.min_users:
        out.why = (f"not tested: {cur[2]} labels from {len(users)} users against {base[2]} from "
                   f"{len(users_before)} (needs {r.min_rows} labels and {r.min_users} users on each side)")
        return out
    out.tested = True
    out.critical = NormalDist().inv_cdf(1 - r.alpha / r.looks)
    out.z = _z(cur, base, r.margin)
    if out.z <= out.critical:
        out.why = f"kept: z {out.z:.2f} ≤ {out.critical:.2f}"
        return out
    for user in sorted(users | users_before):
        z = _z(_totals(served, user), _totals(before, user), r.margin)
        if z <= out.critical:
            out.why = f"kept: significant (z {out.z:.2f}) only with user {user}'s labels (without: {z:.2f})"
            return out
    out.rollback = True
    out.why = (f"z {out.z:.2f} > {out.critical:.2f} (one-sided alpha {r.alpha:g} / {r.looks} looks), with any "
               f"one of {len(users | users_before)} users left out too")
    return out


def rollback_look(served: dict, before: dict, looks_done: int, r: RollbackSettings) -> tuple[int, RollbackCheck | None]:
    """The planned looks: test (:func:`rollback_decision`) only when the served version's counted labels reach
    the next ``j × min_rows`` and a look is left. Returns the looks used up (several passed at once count as used)
    and the check (None: no look now)."""
    n = sum(c[2] for c in served.values())
    if looks_done >= r.looks or n < (looks_done + 1) * r.min_rows:
        return looks_done, None
    chk = rollback_decision(served, before, r)
    if not chk.tested:  # not enough labels or users before it: the look stays
        return looks_done, None
    return min(r.looks, max(looks_done + 1, n // r.min_rows)), chk


class Promotion:
    """The gate, promotion, rollback and the operator's decisions for the candidates of ``trainer`` (a
    :class:`~paravt_train.rl.trainer.GRPOTrainer` that pushes nothing by itself), recorded in ``registry``."""

    def __init__(self, trainer, registry: VersionRegistry, cfg: GRPOConfig, log=print):
        self.trainer, self.registry, self.cfg, self.log = trainer, registry, cfg, log
        self.online = cfg.online
        self._pinned: tuple[int, list[PromptItem], str] | None = None  # (round, the pinned set, its hash)
        self._audit: list[PromptItem] | None = None
        self.margin: float | None = None  # the gate's margin (sized at start)

    @property
    def state(self) -> dict:
        return online_state(self.trainer)

    # ------------------------------------------------------------------ versions

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
        rnd = self.state["gated"] // g.rotate_every if g.rotate_every else 0
        if self._pinned is None or self._pinned[0] != rnd:
            pool, self._audit = self._pool()
            prompts = random.Random(rnd).sample(pool, min(g.limit, len(pool))) if g.rotate_every else pool
            self._pinned = (rnd, prompts, pinned_hash(prompts, g.n_frames))
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

    def _gate_config(self):
        cfg = self.trainer.eval_agent_config()
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
                            g.shadow_endpoint, adapter=sync.adapter_name, api_key=self.cfg.sglang_api_key())

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

    def _audit_score(self, path: Path) -> float | None:
        if not self.online.gate.audit_share:
            return None
        self.pinned()
        return _mean(self._scores(path, self._audit), none_is_zero=True) if self._audit else None

    def start_versions(self) -> None:
        """The registry's first version is the starting weights; the serving version goes (back) on the server.

        The starting weights are the learner's own: the base model on a fresh start, the checkpoint's weights (as
        ``v<step>``, exported) when it resumed without a registry. Registering the base there would put the base
        on the server under the checkpoint's weight version, and the redone updates would roll out from a policy
        they do not train while taking it for their own."""
        tr, reg = self.trainer, self.registry
        margin = self.size_gate()  # refused before anything is exported or pushed
        if margin is not None:
            g = self.online.gate
            self.log(f"gate: {len(self.gate_prompts())} pinned questions hold a margin of {margin:.3f} (confidence "
                     f"{g.confidence:g}, power {g.power:g} at discordance {g.discordance:g})")
        first = not reg.versions()
        vid = f"v{tr.step}"
        start = Path(self.cfg.model)
        if first and self.cfg.lora.enabled:
            start = tr.save_adapter(reg.root / vid)
        elif first and tr.step:  # resumed: every rank takes part in gathering the shards
            start = tr.save_model(reg.root / vid)
        if tr.rank == 0 and first:
            gate = {}
            if self.online.gate.enabled:
                t0 = time.perf_counter()
                scores = self._scores(start)
                gate = {"scores": scores, "candidate": _mean(scores), "seconds": time.perf_counter() - t0,
                        "pinned": self.pinned()[1], "audit": self._audit_score(start)}
            why = "the starting weights" if not tr.step else f"the starting weights (checkpoint-{tr.step}'s)"
            reg.add(vid, tr.step, start, "candidate", gate=gate, reason=why)
            reg.set_serving(vid, reason=why)
        tr_barrier(tr)
        serving = reg.serving()
        if tr.rank == 0:
            push_version(self.cfg, serving, self.log)
        tr_barrier(tr)
        self.state["serving"] = serving["id"]

    def _load_version(self, version: dict) -> None:
        """Continue from ``version``'s weights (every rank); the optimizer's moments start again."""
        from transformers import AutoModelForImageTextToText

        tr = self.trainer
        if (Path(version["path"]) / "adapter_config.json").is_file():  # a LoRA version: its adapter
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(tr.model, load_file(str(Path(version["path"]) / "adapter_model.safetensors")))
            tr.optimizer.state.clear()
            self.state["serving"] = version["id"]
            return
        if tr.world > 1:  # rank 0 reads the directory, the shards are filled from it
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            sd = AutoModelForImageTextToText.from_pretrained(version["path"]).state_dict() if tr.rank == 0 else {}
            set_model_state_dict(tr.model, sd, options=StateDictOptions(full_state_dict=True,
                                                                        broadcast_from_rank0=True))
        else:
            tr.model.load_state_dict(AutoModelForImageTextToText.from_pretrained(version["path"]).state_dict())
        tr.optimizer.state.clear()
        self.state["serving"] = version["id"]

    def promote_candidate(self) -> dict:
        """Export the candidate, gate it (rank 0), then promote (push + record) or keep it aside."""
        tr, reg, g = self.trainer, self.registry, self.online.gate
        vid = f"v{tr.step}"
        # every rank (gathered from the shards); a LoRA run keeps the adapter: megabytes, not a model
        path = tr.save_adapter(reg.root / vid) if self.cfg.lora.enabled else tr.save_model(reg.root / vid)
        st = self.state
        feedback = [d["seq"] for d in st["pending"]]

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
            res = decide(scores, ref, g, g.mode, time.perf_counter() - t0, start=ref0, start_id=start["id"],
                         margin=self.margin or self.size_gate(), pinned=h)
            out = {"promote": res.promote, "summary": res.summary(), **res.as_dict()}
            if res.promote:
                out["audit"] = self._audit_score(path)
            return out

        with telemetry.span("paravt.online.gate", attributes={"paravt.version": vid, "paravt.gate.mode": g.mode,
                                                               "paravt.gate.enabled": g.enabled}) as sp:
            verdict = on_rank0(judge, "the gate") if tr.world > 1 else judge()
            telemetry.set_attributes(sp, {f"paravt.gate.{k}": v for k, v in verdict.items()
                                          if isinstance(v, bool | int | float | str)})
        gate = {k: v for k, v in verdict.items() if k not in ("promote", "summary")}
        if verdict["promote"]:
            if tr.rank == 0:
                reg.add(vid, tr.step, path, "candidate", feedback, gate, verdict["summary"])
            with telemetry.span("paravt.online.promote", attributes={"paravt.version": vid, "paravt.step": tr.step}):
                tr.sync()  # the candidate's weights to the server, as weight version str(step)
            if tr.rank == 0:
                reg.set_serving(vid, reason=f"promoted ({verdict['summary']})")
            st["serving"], st["pending"] = vid, []
        else:
            if tr.rank == 0:
                reg.add(vid, tr.step, path, "refused", feedback, gate, verdict["summary"])
                reg.prune_refused(self.online.keep_refused)
            if g.on_refuse == "revert":
                self._load_version(reg.serving())
                st["pending"] = []
        st["since_promotion"] = 0
        st["gated"] += 1  # the pinned set's round (rotate_every)
        self._event({"event": "promoted" if verdict["promote"] else "refused", "version": vid,
                     "gate": {k: v for k, v in gate.items() if k != "scores"}, "feedback": feedback})
        self.log(f"candidate {vid}: {verdict['summary']}")
        return verdict

    def check_rollback(self) -> str | None:
        """At the served version's planned looks (its counted labels reaching ``j × min_rows``), test its live score
        against the version served immediately before it (:func:`rollback_decision`) and roll back when it is
        worse. Returns the version rolled back to."""
        r, reg, st = self.online.rollback, self.registry, self.state
        if not r.enabled:
            return None
        serving = reg.serving()
        prev = reg.served_before(serving["id"]) if serving else None
        if prev is None:
            return None
        sid = serving["id"]
        cur, before = live_counts(st["live"].get(sid)), live_counts(st["live"].get(prev["id"]))
        st["looks"][sid], chk = rollback_look(cur, before, st["looks"].get(sid, 0), r)
        if chk is None:
            self._untestable(sid, prev["id"], cur, before)
            return None
        self.log(f"rollback look {st['looks'][sid]}/{r.looks} of {sid}: {chk.served:.3f} on {chk.n} labels vs "
                 f"{prev['id']}'s {chk.before:.3f} on {chk.n_before}; {chk.why}")
        if not chk.rollback:
            return None
        why = (f"rollback: live score of {sid} {chk.served:.2f} on {chk.n} labels is below {prev['id']}'s "
               f"{chk.before:.2f} on {chk.n_before} ({chk.why})")
        return self.rollback_to(prev, why)

    def _untestable(self, sid: str, prev: str, cur: dict, before: dict) -> None:
        """Said once per version: it has its first look's labels but cannot be tested (too few labels of the version
        before it, which no longer serves, or too few users): a rollback that is quietly off is an operator's
        surprise."""
        r, st = self.online.rollback, self.state
        if sum(c[2] for c in cur.values()) < r.min_rows or sid in st.setdefault("untestable", []):
            return
        chk = rollback_decision(cur, before, r)
        if chk.tested:
            return
        st["untestable"].append(sid)
        why = f"{sid} cannot be rolled back to {prev} yet: {chk.why}"
        self.log(f"rollback {why}")
        self._event({"event": "rollback-untestable", "version": sid, "before": prev, "reason": why})

    def rollback_to(self, version: dict, why: str) -> str:
        tr = self.trainer
        if tr.rank == 0:
            push_version(self.cfg, version, self.log)
            self.registry.set_serving(version["id"], reason=why)
        tr_barrier(tr)
        self._load_version(version)
        self._event({"event": "rolled-back", "version": version["id"], "reason": why})
        self.log(why)
        return version["id"]

    def follow_operator(self) -> None:
        """An operator promoted or rolled back (``paravt-train online promote|rollback``): continue from that."""
        serving = self.registry.serving()
        if serving is not None and serving["id"] != self.state["serving"]:
            self.log(f"the server now holds {serving['id']} ({serving.get('reason', '')}); continuing from it")
            self._load_version(serving)

    def _event(self, rec: dict) -> None:
        tr = self.trainer
        if tr.rank != 0:
            return
        rec = {"time": time.time(), "step": tr.step, **rec}
        with (tr.out / "online_events.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
        gate = rec.get("gate") or {}
        numbers = {f"online/{k}": v for k, v in gate.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        numbers["online/promoted"] = float(rec["event"] == "promoted")
        tr.metrics.log_event(numbers, tr.step)


def tr_barrier(tr) -> None:
    if tr.world > 1:
        barrier()


def _mean(xs: list, none_is_zero: bool = False) -> float:
    xs = [0.0 if x is None else x for x in xs] if none_is_zero else [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else 0.0
