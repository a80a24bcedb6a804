"""Settings of online learning (``GRPOConfig.online``): the gate a candidate passes before it is served, the
versions kept for rollback, automatic rollback, and how much one user's feedback may weigh.

Defined here, beside the config that holds them (``rl/`` is below ``online/``: the learner holds a GRPO trainer);
the online learner reads them as :mod:`paravt_train.online.config`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["GateSettings", "OnlineSettings", "RollbackSettings"]


class GateSettings(BaseModel):
    """The gate: a candidate (the weights after ``promote_every`` updates) is evaluated on a pinned set before it
    is served, and promoted only when it is not worse than the served version by more than ``margin``."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Evaluate each candidate before it is pushed; off: every candidate is "
                                             "served as it comes (versions are still kept for rollback).")
    eval_set: str | None = Field(None, description="The pinned evaluation set: an RL Parquet file of questions with "
                                 "answers (the format `paravt-train eval` and `eval_data` read; for the toy, held-out "
                                 "worlds' rows).")
    video_root: str | None = Field(None, description="Relative video paths of the evaluation set resolve here.")
    limit: int | None = Field(None, ge=1, description="At most this many evaluation questions.")
    n_frames: int | None = Field(None, ge=1, description="Overview frames of the evaluation (None: the serving "
                                 "protocol's).")
    margin: float = Field(0.02, ge=0, description="Non-inferiority margin, in the metric's units (accuracy points): "
                          "promoted when the paired difference candidate − served is above −margin with confidence "
                          "`confidence` (the lower bound of its bootstrap interval).")
    confidence: float = Field(0.9, gt=0.5, lt=1, description="One-sided confidence of the paired test (bootstrap over "
                              "the evaluation questions, 10,000 resamples).")
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
        if self.mode == "shadow" and not self.shadow_endpoint:
            raise ValueError("online.gate.mode shadow needs online.gate.shadow_endpoint")
        return self


class RollbackSettings(BaseModel):
    """Automatic rollback: the served version's live accuracy on the feedback that arrives after its promotion
    (rows with an answer are labels of the answers users got) against the previous version's."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Roll back to the previous promoted version when the served one does "
                                            "worse on live feedback.")
    min_rows: int = Field(20, ge=1, description="Labelled answers of a version before its live accuracy counts.")
    margin: float = Field(0.1, ge=0, description="Rolled back when its live accuracy is below the previous "
                                                 "version's by more than this.")


class OnlineSettings(BaseModel):
    """``paravt-train online``: how feedback becomes updates and updates become the served model."""

    model_config = ConfigDict(extra="forbid")

    promote_every: int = Field(1, ge=1, description="Updates per candidate: the weights after this many updates are "
                               "gated (or, without the gate, served).")
    gate: GateSettings = Field(default_factory=GateSettings, description="The gate before a candidate is served.")
    rollback: RollbackSettings = Field(default_factory=RollbackSettings, description="Automatic rollback.")
    max_rows_per_user: int | None = Field(200, ge=1, description="Feedback rows one user may contribute per "
                                          "`user_window_hours`; the rest are skipped (counted). None: no limit. Rows "
                                          "without a user (written by the operator's own code: the API and the web "
                                          "page always name one) are not limited, here or by `max_user_share`.")
    user_window_hours: float = Field(24.0, gt=0, description="The window of `max_rows_per_user`.")
    max_user_share: float = Field(0.5, gt=0, le=1, description="At most this share of an update's prompts from one "
                                  "user (rounded up); the rest wait for later updates.")
    keep_refused: int = Field(3, ge=0, description="Refused candidates whose weights are kept for inspection (every "
                                                   "promoted version is kept).")
