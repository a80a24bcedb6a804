"""SFT settings (:class:`SFTConfig`): the cold start of the paper (Section 3.1, Appendix B).

Every field is documented once; defaults follow the paper where it gives a value
(lr 2e-5, global batch 32, checkpoints every 100 steps, 64 frames at 1 fps,
50176 pixels per frame). Loaded from YAML and overridden with ``--set key=value``.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from paravt_agent.config import load_yaml_model
from paravt_agent.video import FrameConfig
from paravt_train.infra.lora import LoraSettings
from paravt_train.infra.tracking import ReportTo

__all__ = ["LoraSettings", "SFTConfig"]


class SFTConfig(BaseModel):
    """SFT settings; defaults follow the paper (Appendix B)."""

    model_config = ConfigDict(extra="forbid")

    #: what a user sets, by topic (docs/config.md lists these first; the rest is advanced)
    user_settings: ClassVar[dict[str, tuple[str, ...]]] = {
        "model": ("model", "lora"),
        "data": ("data", "video_root", "frames"),
        "budget": ("batch_size", "micro_batch_size", "max_steps", "epochs", "lr", "gradient_checkpointing"),
        "output": ("output_dir", "save_every", "report_to"),
    }

    model: str = Field(description="Model directory to start from (a Qwen3-VL, Qwen2.5-VL or Qwen2-VL checkpoint).")
    data: str = Field(description="SFT Parquet file or dataset directory (`messages` as a JSON string per row).")
    video_root: str | None = Field(None, description="Relative video paths in the data are resolved against this.")
    output_dir: str = Field("runs/sft", description="Checkpoints, metrics.jsonl and the final model go here.")
    frames: FrameConfig = Field(default_factory=FrameConfig, description="Frame protocol for the video parts "
                                "(paper, Appendix B); the final model's agent_config.yaml records it.")
    lr: float = Field(2e-5, gt=0, description="Peak learning rate of AdamW (paper: 2e-5).")
    batch_size: int = Field(32, ge=1,
                            description="Global batch: samples per optimizer step over all ranks (paper: 32).")
    micro_batch_size: int = Field(4, ge=1, description="Samples per forward pass on one rank.")
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; None = `epochs` passes over the data.")
    epochs: float = Field(1.0, gt=0, description="Passes over the data when max_steps is None.")
    warmup_ratio: float = Field(0.03, ge=0, le=1, description="Linear warmup, as a fraction of the steps; then cosine.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping (global L2 norm).")
    save_every: int = Field(100, ge=0, description="Steps between checkpoints (paper: 100); 0 = none.")
    export_every: int = Field(0, ge=0, description="Steps between plain model directories written as "
                              "OUTPUT_DIR/model-<step> (loadable as an agent's model: e.g. an early checkpoint "
                              "as the RL start, as the paper selects one, Section 4.1); 0 = none.")
    keep_checkpoints: int = Field(0, ge=0, description="Newest checkpoints kept; 0 = all.")
    log_every: int = Field(1, ge=1, description="Steps between metrics.jsonl lines.")
    report_to: ReportTo = Field(default_factory=list, description="Experiment trackers that also receive every "
                                 "metric of metrics.jsonl and the run's config (rank 0): tensorboard, mlflow, wandb, "
                                 "trackio, several at once (a list or tensorboard,mlflow); none by default. Where "
                                 "each writes: paravt_train/infra/tracking.py.")
    seed: int = Field(0, description="Data order and initialisation seed.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass.")
    bf16: str = Field("auto", pattern="^(auto|true|false)$",
                      description="bf16 autocast: auto (on GPUs), true or false.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model trains: auto = a GPU when one is present and the model has 64 MiB of "
        "weights or more (the local backend's rule: a tiny model such as the toy trains faster on the CPU), cpu, or "
        "cuda.")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="LoRA instead of full fine-tuning.")
    resume: bool = Field(True, description="Continue from the newest checkpoint in output_dir, if any.")
    save_final: bool = Field(True, description="Write OUTPUT_DIR/final (a plain model directory, LoRA merged).")

    @classmethod
    def from_yaml(cls, path, overrides=None) -> SFTConfig:
        return load_yaml_model(cls, path, overrides)
