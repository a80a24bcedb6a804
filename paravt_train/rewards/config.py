"""The reward's settings: :class:`RewardConfig` (the paper's weights, Appendix B / Table 4) and the optional LLM
judge (:class:`JudgeSettings`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["JudgeSettings", "RewardConfig"]


class JudgeSettings(BaseModel):
    """An LLM judge for open-ended answers (OpenAI-compatible endpoint); token F1 when it fails."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(description="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1.")
    model: str = Field(description="Served model name.")
    api_key: str = Field("EMPTY", description="API key sent to the endpoint.")
    timeout: float = Field(20.0, gt=0, description="Seconds per judgement before falling back to token F1.")


class RewardConfig(BaseModel):
    """Reward weights; defaults are the paper's released values (Appendix B, Table 4)."""

    model_config = ConfigDict(extra="forbid")

    think_content: float = Field(0.2, description="R_base: <think> with at least `min_think_chars` characters.")
    min_think_chars: int = Field(10, description="What counts as substantive reasoning.")
    answer_open: float = Field(0.3, description="R_base: an <answer> tag around a non-empty answer.")
    answer_close: float = Field(0.2, description="R_base: its </answer> tag.")
    think_tool_order: float = Field(0.3, description="R_base: </think> closed before a parseable tool call.")
    balanced: float = Field(0.1, description="R_base: every tag pair balanced.")
    answer_suffix: bool = Field(
        True, description="Paper's Answer Suffix (3.2.1, part of Exploration Anchoring): credit the answer tags "
        "even when the structure before them is imperfect. Off: only when </think> closed before <answer>."
    )
    alpha: float = Field(0.4, description="R_anchor: </think> correctly closed (Eq. 1).")
    beta: float = Field(0.3, description="R_anchor: full think -> answer flow kept (Eq. 1).")
    gamma: float = Field(0.3, description="R_anchor: penalty for a <think> never closed (Eq. 1).")
    lambda_anchor: float = Field(0.5, description="ANCHOR_WEIGHT: R_fmt = R_base + λ_anchor R_anchor (Table 4).")
    lambda_fmt: float = Field(1.0, description="FORMAT_WEIGHT: R = R_acc + λ_fmt R_fmt + R_tool (Eq. 3). Weaver: "
                              "λ2 = 0.2.")
    acc_weight: float = Field(1.0, description="λ_acc, the weight of R_acc: 1 in the paper's Eq. 3; Weaver "
                              "(Sec. 3.4.3, R = λ1 R_corr + λ2 R_format + λ3 R_tool): λ1 = 0.7.")
    format_reward: Literal["paravt", "answer"] = Field(
        "paravt", description="R_fmt: paravt = R_base + λ_anchor R_anchor (the paper's); answer = Weaver's R_format, "
        "1 when the rollout has a non-empty <answer>...</answer>, else 0.")
    anchor: bool = Field(True, description="Exploration Anchoring's selective reward on (PARA-GRPO) or off.")
    tool_bonus: float = Field(0.1, description="R_tool's weight (Weaver: λ3 = 0.1).")
    tool_reward: Literal["well_formed", "success"] = Field(
        "well_formed", description="R_tool: well_formed = tool_bonus × the fraction of closed, parseable "
        "<tool_call>s (the paper's); success = Weaver's tool-success reward (after DeepEyes): tool_bonus × R_acc "
        "when the rollout made a tool call that worked, else 0 (tool use that led to a right answer).")
    collaboration: float = Field(1.0, description="R_col's weight in a collaborating agent's reward (VideoChat-M1, "
                                 "A.5: R = R_res + R_format + R_col; paravt_train.rewards.multi_agent).")
    reward_bias: float = Field(0.0, description="Added to every reward (the paper's RL: -0.2; GRPOConfig sets it).")
    degenerate_count: int = Field(5, description="<|im_start|> count that marks a degenerate output ...")
    degenerate_window: int = Field(300, description="... within this many characters.")
    extra_terms: dict[str, float] = Field(default_factory=dict, description="Weights of extra reward terms by "
                                          "name (registered with `reward_term` or the paravt.rewards entry points).")
    judge: JudgeSettings | None = Field(None, description="LLM judge for open-ended answers; None = token F1.")

    @property
    def max_format(self) -> float:
        if self.format_reward == "answer":
            return 1.0
        base = self.think_content + self.answer_open + self.answer_close + self.think_tool_order + self.balanced
        return base + (self.lambda_anchor * (self.alpha + self.beta) if self.anchor else 0.0)

    @property
    def min_total(self) -> float:
        """The lowest reward a rollout can get: zero accuracy, the anchor's penalty, the bias (what a
        degenerate output scores)."""
        penalty = self.lambda_anchor * self.gamma if self.anchor and self.format_reward == "paravt" else 0.0
        return self.reward_bias - self.lambda_fmt * penalty - sum(abs(w) for w in self.extra_terms.values())


