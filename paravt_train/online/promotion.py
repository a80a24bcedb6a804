"""How the online learner's candidates become (or do not become) the served model: the gate, promotion, the
versions, rollback — automatic on live feedback, or an operator's.

:class:`Promotion` is an object the learner holds (``OnlineLearner.promotion``), made with the trainer whose weights
it exports and reloads, the version registry and the run's config; the state it shares with the learner is the
trainer's checkpointed ``extra_state`` (:func:`online_state`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from paravt_agent import telemetry
from paravt_train.data import PromptItem, prompts_from_rl
from paravt_train.infra.distributed import barrier, on_rank0
from paravt_train.online.gate import decide, evaluate_dir
from paravt_train.online.versions import VersionRegistry, push_version
from paravt_train.rl.config import GRPOConfig
from paravt_train.sync import make_weight_sync

__all__ = ["Promotion", "online_state"]


def online_state(trainer) -> dict:
    """The online learner's state — the feedback cursor, the queue, skip counts, what was trained, the candidate's
    pending rows, per-user times, first answers, live accuracy counts, updates since the last promotion and the
    serving version — kept in the trainer's ``extra_state``, so it is saved and restored with the weights."""
    st = trainer.extra_state
    for key, empty in (("cursor", 0), ("queue", []), ("skipped", 0), ("skipped_by", {}), ("trained", []),
                       ("pending", []), ("users", {}), ("answers", {}), ("live", {}), ("since_promotion", 0),
                       ("serving", None)):
        st.setdefault(key, empty)
    return st


class Promotion:
    """The gate, promotion, rollback and the operator's decisions for the candidates of ``trainer`` (a
    :class:`~paravt_train.rl.trainer.GRPOTrainer` that pushes nothing by itself), recorded in ``registry``."""

    def __init__(self, trainer, registry: VersionRegistry, cfg: GRPOConfig, log=print):
        self.trainer, self.registry, self.cfg, self.log = trainer, registry, cfg, log
        self.online = cfg.online
        self._gate_prompts: list[PromptItem] | None = None

    @property
    def state(self) -> dict:
        return online_state(self.trainer)

    # ------------------------------------------------------------------ versions

    def gate_prompts(self) -> list[PromptItem]:
        if self._gate_prompts is None:
            g = self.online.gate
            self._gate_prompts = prompts_from_rl(g.eval_set, g.video_root, g.limit) if g.enabled else []
        return self._gate_prompts

    def _gate_config(self):
        cfg = self.trainer.eval_agent_config()
        n = self.online.gate.n_frames
        return cfg if n is None else cfg.model_copy(update={"frames": cfg.frames.model_copy(update={"n_frames": n})})

    def _scores(self, path: Path) -> list:
        g = self.online.gate
        if g.mode != "shadow":
            return evaluate_dir(path, self._gate_config(), self.gate_prompts(), self.cfg.concurrency * 2)
        # the candidate onto the shadow server with the run's own sync (its keys; a LoRA run's adapter by its name)
        sync = make_weight_sync(self.cfg, g.shadow_endpoint)
        sync.serve(path, f"candidate-{path.name}")
        return evaluate_dir(path, self._gate_config(), self.gate_prompts(), self.cfg.concurrency * 2,
                            g.shadow_endpoint, adapter=sync.adapter_name, api_key=self.cfg.sglang_api_key())

    def start_versions(self) -> None:
        """The registry's first version is the starting weights; the serving version goes (back) on the server.

        The starting weights are the learner's own: the base model on a fresh start, the checkpoint's weights (as
        ``v<step>``, exported) when it resumed without a registry. Registering the base there would put the base
        on the server under the checkpoint's weight version, and the redone updates would roll out from a policy
        they do not train while taking it for their own."""
        tr, reg = self.trainer, self.registry
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
                gate = {"scores": scores, "candidate": _mean(scores), "seconds": time.perf_counter() - t0}
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
            served = reg.serving()
            t0 = time.perf_counter()
            scores = self._scores(path)
            res = decide(scores, served["gate"].get("scores", []), g, g.mode, time.perf_counter() - t0)
            return {"promote": res.promote, "summary": res.summary(), **res.as_dict()}

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
        self._event({"event": "promoted" if verdict["promote"] else "refused", "version": vid,
                     "gate": {k: v for k, v in gate.items() if k != "scores"}, "feedback": feedback})
        self.log(f"candidate {vid}: {verdict['summary']}")
        return verdict

    def check_rollback(self) -> str | None:
        """Roll back when the serving version's live accuracy is below the previous promoted version's by more
        than the margin (each with at least ``min_rows`` labels). Returns the version rolled back to."""
        r, reg = self.online.rollback, self.registry
        if not r.enabled:
            return None
        serving = reg.serving()
        before = [v for v in reg.promoted() if v["id"] != serving["id"] and v["promoted_at"] < serving["promoted_at"]]
        if not before:
            return None
        prev = before[-1]
        live = self.state["live"]
        (a, n), (pa, pn) = live.get(serving["id"], [0, 0]), live.get(prev["id"], [0, 0])
        if n < r.min_rows or pn < r.min_rows or a / n >= pa / pn - r.margin:
            return None
        why = (f"rollback: live accuracy of {serving['id']} {a / n:.2f} on {n} labels is below {prev['id']}'s "
               f"{pa / pn:.2f} on {pn} by more than {r.margin:g}")
        return self.rollback_to(prev, why)

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


def _mean(xs: list) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else 0.0
