"""The online learner's settings, defined in its own room (TRL's config-subclass pattern): :class:`OnlineConfig` is the
run's :class:`~paravt_train.rl.config.GRPOConfig` (the trainer the learner holds) plus ``online:`` —
:class:`OnlineSettings` (promotion cadence, per-user limits, refused candidates kept), :class:`GateSettings` (the
gate before a candidate serves) and :class:`RollbackSettings`. One YAML configures the trainer and the learner;
``paravt-train grpo`` reads the same file without ``online:`` (a GRPOConfig refuses the key, saying where it
belongs)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from paravt_train.rl.config import GRPOConfig

__all__ = ["GateSettings", "OnlineConfig", "OnlineSettings", "RollbackSettings"]


class GateSettings(BaseModel):
    """The gate: a candidate (the weights after ``promote_every`` updates) is evaluated on a pinned set before it
    is served, and promoted only when it is not worse than the served version by more than ``margin``."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Evaluate each candidate before it is pushed; off: every candidate is "
                                             "served as it comes (versions are still kept for rollback).")
    eval_set: str | None = Field(None, description="The pinned evaluation set: an RL Parquet file of questions with "
                                 "answers (the format `paravt-train eval` and `eval.data` read; for the toy, held-out "
                                 "worlds' rows).")
    video_root: str | None = Field(None, description="Relative video paths of the evaluation set resolve here.")
    limit: int | None = Field(None, ge=1, description="At most this many evaluation questions.")
    n_frames: int | None = Field(None, ge=1, description="Overview frames of the evaluation (None: the serving "
                                 "protocol's).")
    margin: float | None = Field(
        None, gt=0, description="Non-inferiority margin, in the metric's units (accuracy, F1 or IoU points): a "
        "candidate is promoted when the one-sided `confidence` lower bound of candidate − served, and of candidate − "
        "the starting version, is above −margin. None: the smallest margin the pinned set supports (its size, "
        "`confidence`, `power`, `discordance`: about 2.72·sqrt(discordance / n), 0.15 at 100 questions, 0.067 at 500); "
        "a margin below that is refused at start with the number of questions it needs.")
    confidence: float = Field(0.9, gt=0.5, lt=1, description="One-sided confidence of the non-inferiority test "
                              "(binary scores: the exact unconditional test ordered by Tango's score statistic; "
                              "F1/IoU: the paired t-test with Hall's skewness correction): a candidate exactly "
                              "`margin` worse is promoted at most 1 − confidence of the time.")
    power: float = Field(0.85, gt=0.5, lt=1, description="The sizing's power: an equally good candidate is refused "
                         "at most 1 − power of the time (split over the two comparisons, served and start) when the "
                         "versions disagree on at most `discordance` of the questions.")
    discordance: float = Field(0.3, gt=0, le=1, description="Planned mean squared per-question difference between "
                               "two versions (binary scores: the share of questions on which they disagree) the "
                               "sizing assumes; each gate records the one it observed (`observed`), the margin that "
                               "would support (`detectable`) and the refusal rate of an equally good candidate there "
                               "(`refusal_rate`), and warns when it is past the one the margin was sized at.")
    discordance_window: int = Field(5, ge=0, description="With `margin` unset: size the margin at the mean "
                                    "discordance the last this many gates observed when that is above `discordance` "
                                    "(versions that disagree more need a wider margin for an equally good candidate to "
                                    "pass at `power`; at 50 % discordance a margin sized for 30 % refused one 30 % of "
                                    "the time). 0: always the planned `discordance`. An operator's `margin` is never "
                                    "resized (its gates warn instead).")
    rotate_every: int | None = Field(None, ge=1, description="Draw a new pinned set of `limit` questions from "
                                     "`eval_set` every this many candidates (seeded by the round), so no run of "
                                     "candidates is selected on one set; the served and starting versions are scored "
                                     "again on each new set. None: the same set throughout. Needs `limit`.")
    audit_share: float = Field(0.0, ge=0, lt=0.5, description="Hold out this share of `eval_set` as an audit set the "
                               "gate never decides on: every promoted version is scored on it and the score recorded "
                               "(`audit` in the version's gate record and the event), so a gate tuned to its pinned "
                               "set shows as a gap between the two.")
    mode: Literal["in-process", "shadow"] = Field(
        "in-process", description="Where a candidate is evaluated: in-process (rank 0 loads the exported candidate; "
        "users' server untouched) or shadow (pushed to `shadow_endpoint`, a second SGLang server, and evaluated "
        "there). The served version's scores were taken when it passed its own gate.")
    shadow_endpoint: str | None = Field(None, description="mode shadow: the second SGLang server's URL.")
    on_refuse: Literal["revert", "continue"] = Field(
        "revert", description="A refused candidate is kept aside (recorded, not served); the learner then goes on "
        "from the served weights (revert: the optimizer's moments are reset) or from the candidate (continue).")

    @model_validator(mode="after")
    def _needs(self):
        if self.enabled and not self.eval_set:
            raise ValueError("online.gate.enabled needs online.gate.eval_set (questions with answers)")
        if self.rotate_every is not None and self.limit is None:
            raise ValueError("online.gate.rotate_every draws `limit` questions from eval_set: set online.gate.limit")
        if self.mode == "shadow" and not self.shadow_endpoint:
            raise ValueError("online.gate.mode shadow needs online.gate.shadow_endpoint")
        return self


class RollbackSettings(BaseModel):
    """Automatic rollback: the served version's live score (the gate's metric: accuracy, F1 or IoU of the answers
    users labelled, after the per-principal limits) against the version served immediately before it, by a
    one-sided two-sample test checked only at planned label counts (Bonferroni over the looks), with labels from at
    least `min_users` principals — the voters: an API key's owner, the web page, ...
    (`paravt_agent/store/principals.py`), never a name a caller chooses — and a decision no `leave_out` of them can
    tip either way (`paravt_train/online/rollback.py`)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Roll back to the version served immediately before when the served one "
                                            "does worse on live feedback.")
    min_rows: int = Field(40, ge=1, description="Counted labels of the served version at the first look (and of the "
                          "version before it, for any look); the j-th look is at j × min_rows labels.")
    looks: int = Field(4, ge=1, description="Planned looks per version (at min_rows, 2·min_rows, …); each tests at "
                       "alpha / looks, so a version as good as the one before is rolled back at most alpha of the "
                       "time over all of them. After the last look the version is not checked again.")
    alpha: float = Field(0.05, gt=0, lt=0.5, description="The false-rollback rate over a version's looks.")
    min_users: int = Field(3, ge=1, description="Distinct principals among a version's counted labels before it "
                           "is tested.")
    leave_out: int = Field(
        2, ge=0, description="Principals whose labels a decision must survive losing, either way: it stands with any "
        "`leave_out` principals' labels removed, or — where `leave_out` or fewer tip it — is taken with the "
        "`leave_out` pushing hardest against a rollback set aside and any `leave_out` + 1 of the rest removed "
        "(`paravt_train/online/rollback.py`). 2 is the smallest value whose equal-version rollbacks stay within "
        "`alpha` and which neither one key posing as 10 users nor 2 colluding principals push above 5 % "
        "(`perf/bench_online_decisions.py --only voters`: 60 principals, accuracy 0.5/0.8, 100/500 labels a version, "
        "1000 trials a cell: 2 colluders force 1.5–2.8 % at 2, up to 27 % at 1; 3 colluders 2.7–7.3 %). Its cost: a "
        "0.15-worse version is rolled back 22–78 % of the time (0.5.1's leave-one-user-out: 26–81 %; 0, the plain "
        "z-test, which one principal forces up to 56 % of the time: 42–92 %).")
    max_labels_per_user: int = Field(10, ge=1, description="Labels of one principal counted per version (the first "
                                     "ones; after `max_rows_per_user`): one voter's share of a look is bounded.")
    web_votes: bool = Field(True, description="The web page's labels (principal `web`: all its sessions together, "
                            "one anonymous voter) count in the live score; false: they still train, but never vote.")
    margin: float = Field(0.0, ge=0, description="Rolled back when the live score is lower than the version before's "
                          "by more than this (the test's null: at most `margin` worse), in the gate's units.")


class OnlineSettings(BaseModel):
    """``paravt-train online``: how feedback becomes updates and updates become the served model."""

    model_config = ConfigDict(extra="forbid")

    promote_every: int = Field(1, ge=1, description="Updates per candidate: the weights after this many updates are "
                               "gated (or, without the gate, served).")
    gate: GateSettings = Field(default_factory=GateSettings, description="The gate before a candidate is served.")
    rollback: RollbackSettings = Field(default_factory=RollbackSettings, description="Automatic rollback.")
    max_rows_per_user: int | None = Field(200, ge=1, description="Feedback rows one principal (an API key's owner, "
                                          "the web page, a user the operator's code names) may contribute per "
                                          "`user_window_hours`; the rest are skipped (counted). None: no limit. The "
                                          "operator's own rows (no principal, no user) are not limited, here or by "
                                          "`max_user_share`.")
    user_window_hours: float = Field(24.0, gt=0, description="The window of `max_rows_per_user`.")
    max_user_share: float = Field(0.5, gt=0, le=1, description="At most this share of an update's prompts from one "
                                  "principal (rounded up); the rest wait for later updates.")
    keep_refused: int = Field(3, ge=0, description="Refused candidates whose weights are kept for inspection (every "
                                                   "promoted version is kept).")


class OnlineConfig(GRPOConfig):
    """``paravt-train online``: the GRPO run the learner trains with, and ``online:``."""

    online: OnlineSettings = Field(default_factory=OnlineSettings, description="`paravt-train online` only: the "
                                   "gate before a candidate is served, versions and rollback, per-user limits.")

    @classmethod
    def of(cls, cfg: GRPOConfig) -> OnlineConfig:
        """``cfg`` as an online config (a GRPOConfig given to the learner: the online settings' defaults)."""
        return cfg if isinstance(cfg, cls) else cls.model_validate(cfg.model_dump(exclude_unset=True))
