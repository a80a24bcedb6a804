"""Online learning from the trajectory store: served traces + user feedback → PARA-GRPO updates → gated versions.

The loop, top to bottom (:meth:`~paravt_train.online.learner.OnlineLearner.run`)::

    config.py     OnlineConfig: the run's GRPOConfig and its ``online:`` settings (gate, rollback, per-user limits)
    state.py      OnlineState: where the learner is (cursor, queue, live counts, ...), typed and versioned, saved
                  with the weights in every checkpoint
    learner.py    OnlineLearner: a GRPOTrainer (its own pushes off: only promoted versions reach the server), its
                  OnlineState and a Promotion (given a TrainerPort to the trainer and that state, never the trainer)
    promotion.py  at start: the registry's first version is the starting weights; the serving version goes (back)
                  on the server
    loop:
      promotion.py  follow the operator: a promote or rollback done by hand (cli.py) → continue from that version
      learner.py    poll the store: feedback rows newer than the cursor, each checked again (an answer the trace's
                    question can have, no conflict with an earlier answer, its principal — the authenticated voter,
                    paravt_agent/store/principals.py — within ``max_rows_per_user`` per window); a row that fails is
                    skipped with a counted reason; a row with an answer is also a label of the answer its user got
                    (live accuracy of the version that served it)
      learner.py    take a batch: up to ``prompts_per_step`` queued prompts, at most ``max_user_share`` from one
                    principal
      learner.py    update: fresh rollouts (on the served policy: rollouts of an older version are corrected by
                    decoupled PPO's behaviour weight) → one PARA-GRPO update of the learner's weights
                    (GRPOTrainer.train_step, paravt_train.rl)
      promotion.py  every ``promote_every`` updates the candidate is exported and, with the gate on,
        gate.py     evaluated on the pinned set against the served and the starting version (paired
        bounds.py   non-inferiority tests, sized: a margin its questions cannot hold is refused at start):
        versions.py promoted (pushed: pause → update → continue; recorded as a version) or kept aside (refused;
                    the learner reverts to the served weights or goes on, ``on_refuse``)
      promotion.py  live score: at planned label counts, when the served version's score on the feedback about its
        rollback.py own answers (per-principal capped, several principals, a decision no ``leave_out`` of them can
                    tip either way) is significantly below the version served before it, that version goes back
      learner.py    every ``save_every`` updates: one atomic checkpoint of the weights, the optimizer, the cursor,
                    the queue and the live counts; ``online_state.json`` after every update
    cli.py        ``paravt-train online`` runs it; ``online versions | promote V | rollback [V] | status`` act on the
                  versions (OUTPUT_DIR/versions, versions.py), pushing as the learner does
    lock.py       one learner per output directory and store, held from set-up to the end

Every promoted version is kept. The learner never pushes a candidate by itself (its trainer is made with
``push_updates=False``): the server only ever gets promoted versions. At start it puts the serving version on the
server again, so a learner killed during a gate or a promotion restarts with the server on a promoted version.

Crash safety: the cursor, the queue, the live counts and the users' counts are in the same atomic checkpoint as
the weights and the optimizer (every ``save_every`` updates); ``online_state.json`` says where the learner is
after every update. A restart resumes from the newest checkpoint: feedback read after it is read again and the
updates after it are redone, so no feedback is lost and none is trained on twice.
"""

_LAZY = {
    "OnlineLearner": "paravt_train.online.learner",
    "check_row": "paravt_train.online.learner",
    "prompt_from_feedback": "paravt_train.online.learner",
    "Promotion": "paravt_train.online.promotion",
    "TrainerPort": "paravt_train.online.promotion",
    "OnlineState": "paravt_train.online.state",
    "OnlineConfig": "paravt_train.online.config",
    "VersionRegistry": "paravt_train.online.versions",
    "push_version": "paravt_train.online.versions",
    "GateSettings": "paravt_train.online.config",
    "OnlineSettings": "paravt_train.online.config",
    "RollbackSettings": "paravt_train.online.config",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):  # lazy: the CLI's --help and the versions commands do not import torch
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
